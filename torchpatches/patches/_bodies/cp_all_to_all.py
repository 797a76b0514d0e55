"""The ``cp_all_to_all`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/cp_all_to_all.py``."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..._core.compat import is_compiling
from ...ops._runtime.tiers import eager_transforms
from .._direct_collectives import direct_fits


def _direct_fits(x: Any, group: Any, process_group: type) -> bool:
    return direct_fits(x, group, process_group) and x.numel() % group.size() == 0


def _replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    import torch.distributed as dist

    process_group = dist.ProcessGroup
    all_to_all_single = dist.all_to_all_single

    def _all_to_all_single(x: torch.Tensor, group: Any) -> torch.Tensor:
        if is_compiling() or eager_transforms() or not _direct_fits(x, group, process_group):
            return original(x, group)
        flat = x.reshape(-1)
        if not flat.is_contiguous():  # a strided 1-D view: the original says what the collective says
            return original(x, group)
        out = torch.empty_like(flat)
        all_to_all_single(out, flat, group=group)
        return out.view(x.shape)

    _all_to_all_single.__doc__ = original.__doc__
    return _all_to_all_single
