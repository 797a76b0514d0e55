"""The ``rope_tables`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/rope_tables.py``."""
from __future__ import annotations

from typing import Any

import torch

from ..._core.lazy import lazy_module
from ...ops._runtime.tiers import POSITION_DTYPES, forced_tier
from .._fused_common import declined, why_not_fusable

#: ``torchpatches.ops.rope_tables``, imported at the first fused call (it registers a torch.library op).
_tables = lazy_module("torchpatches.ops._rope_tables")


def _axes(self: Any) -> Any:
    """The embedder's axes as a tuple of positive even ints, else None."""
    axes = getattr(self, "axes_dim", None)
    try:
        dims = tuple(axes)
    except TypeError:
        return None
    if not dims or any(type(d) is not int or d <= 0 or d % 2 for d in dims):
        return None
    return dims


def _theta(self: Any) -> Any:
    theta = getattr(self, "theta", None)
    return theta if type(theta) in (int, float) and theta > 0 else None


def _ids_fit(ids: Any) -> bool:
    """Plain 2-D position ids of a dtype the op reads (any real float or integer: FLUX.2's pipeline passes int64),
    on a device the kernel serves, autocast off there, no gradient wanted (the embedder has no parameters)."""
    return (
        type(ids) is torch.Tensor
        and ids.dtype in POSITION_DTYPES
        and ids.dim() == 2
        and (ids.device.type == "cuda" or forced_tier() is not None)
        and not torch.is_autocast_enabled(ids.device.type)
        and not (ids.requires_grad and torch.is_grad_enabled())
    )


def _tables_for(self: Any, ids: Any, exact_axes: bool) -> Any:
    if not _ids_fit(ids):
        return declined(why_not_fusable(ids, POSITION_DTYPES) if type(ids) is not torch.Tensor or ids.dim() == 2
                        else "position ids that are not 2-D")
    dims, theta = _axes(self), _theta(self)
    if dims is None or theta is None:
        return declined("axes_dim that are not positive even ints, or a theta that is not a positive number")
    if (ids.shape[1] != len(dims)) if exact_axes else (ids.shape[1] < len(dims)):
        # FLUX.1 indexes axes_dim by ids' columns, FLUX.2 ids' columns by axes: its own error
        return declined("position ids whose columns do not match axes_dim")
    return _tables().rope_tables(ids, dims, theta)


def _flux(self, ids):
    return _tables_for(self, ids, exact_axes=True)


def _flux2(self, ids):
    return _tables_for(self, ids, exact_axes=False)
