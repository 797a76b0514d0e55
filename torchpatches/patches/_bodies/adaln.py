"""The ``adaln`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/adaln.py``."""
from __future__ import annotations

from typing import Any

import torch

from .._fused_common import FALLBACK, fusable, linear, plain_layer_norm
from .._modulate_calls import modulated

def _covered(self: Any, x: Any, *tensors: Any) -> bool:
    """A [B, S, D] activation the kernel serves and a stock affine-free LayerNorm."""
    return fusable(x, (self,), *tensors) and x.dim() == 3 and plain_layer_norm(self.norm, x.shape[-1])


def _zero(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    if not _covered(self, x, emb):
        return FALLBACK
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = linear(self.linear, self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = modulated(self.norm, x, scale_msa, shift_msa, fuse=True)
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _zero_single(self, x, emb=None):
    if not _covered(self, x, emb):
        return FALLBACK
    emb = linear(self.linear, self.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    x = modulated(self.norm, x, scale_msa, shift_msa, fuse=True)
    return x, gate_msa


def _continuous(self, x, conditioning_embedding):
    if not _covered(self, x, conditioning_embedding):
        return FALLBACK
    emb = linear(self.linear, self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return modulated(self.norm, x, scale, shift, fuse=True)
