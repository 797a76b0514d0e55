"""The ``swiglu`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/swiglu.py``."""
from __future__ import annotations

import torch

from .._fused_common import FALLBACK, fusable, stock


def _swiglu(self, x):
    if not (fusable(x, (self,)) and x.dim() >= 2 and x.shape[-1] % 2 == 0 and stock(self.gate_fn, torch.nn.SiLU)):
        return FALLBACK
    from ...ops._swiglu import swiglu  # lazily: importing an op registers torch.library ops

    return swiglu(x)
