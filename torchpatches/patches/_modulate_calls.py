"""How the adaln and gate_residual patches call ``ops.modulate``, with diffusers' own math as the fallback.

Each helper takes the vectors as diffusers holds them (``[B, D]`` chunks in FLUX.1, ``[B, 1, D]`` in
FLUX.2, ``[B, S, D]`` in FLUX.2's KV-cache blend) and runs the fused op when every tensor fits
(same dtype and device as ``x``, plain tensors), else exactly the expression diffusers evaluates.

What the helpers check before they fuse is everything the op's public entries check (with ``fusable`` and
``steps_aside`` in the pattern that calls them), so they call ``ops.prechecked``, which skips the
second round of checks (host time: 191 calls per FLUX.1 step).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .._core.lazy import lazy_module
from ..ops._runtime.tiers import FLOAT_DTYPES
from ._fused_common import pattern_on, plain_layer_norm


def _rows_fit(h: torch.Tensor, y: Any) -> bool:
    """``y`` is a plain tensor of ``h``'s shape, dtype and device (a residual branch's output)."""
    return type(y) is torch.Tensor and y.shape == h.shape and y.dtype == h.dtype and y.device == h.device


def _token_dim(v: torch.Tensor) -> torch.Tensor:
    return v[:, None] if v.dim() == 2 else v  # diffusers: scale_msa[:, None] / gate.unsqueeze(1)


def _vectors_fit(x: torch.Tensor, *vectors: Optional[torch.Tensor], rounding: str = "each") -> bool:
    """``x`` is a plain float ``[B, S, D]`` tensor and each vector fits it: a plain tensor (not None) on its
    device, of its dtype (any float dtype with ``rounding="once"``), ``[B, D]``, ``[B, 1, D]`` or ``[B, S, D]``."""
    if type(x) is not torch.Tensor or x.dtype not in FLOAT_DTYPES or x.dim() != 3:
        return False
    B, S, D = x.shape
    once = rounding == "once"  # fp32 compute: vectors of any float dtype (Wan's fp32 scale_shift_table)
    for v in vectors:
        if type(v) is not torch.Tensor or v.device != x.device or (
                v.dtype not in FLOAT_DTYPES if once else v.dtype != x.dtype):
            return False
        shape = v.shape
        if len(shape) == 2:
            if shape[0] != B or shape[1] != D:
                return False
        elif len(shape) != 3 or shape[0] != B or shape[2] != D or shape[1] not in (1, S):
            return False
    return True


#: ``torchpatches.ops.modulate``, imported at the first fused call (importing it registers torch.library ops).
modulate_ops = lazy_module("torchpatches.ops._modulate")


def modulated(norm: Any, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, *, fuse: bool) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift``: one kernel when ``fuse`` and everything fits."""
    if fuse and _vectors_fit(x, scale, shift) and plain_layer_norm(norm, x.shape[-1]):
        return modulate_ops().prechecked(x, None, None, scale, shift, norm.eps)[0]
    return norm(x) * (1 + _token_dim(scale)) + _token_dim(shift)


def residual(h: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, *, clip: bool) -> torch.Tensor:
    """``h + gate * y`` (then diffusers' fp16 clip if ``clip``): one kernel when everything fits."""
    if _vectors_fit(h, gate) and _rows_fit(h, y):
        return modulate_ops().prechecked(h, gate, y, None, None, None, clip=clip)[0]
    out = h + _token_dim(gate) * y
    if clip and out.dtype == torch.float16:
        out = out.clip(-65504, 65504)
    return out


def residual_modulated(
    norm: Any, h: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
    *, fuse: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = h + gate * y`` and ``norm(h) * (1 + scale) + shift``; one kernel for both while adaln is on
    (``fuse=None``, FLUX) or when ``fuse`` (a pattern that owns its LayerNorm, QwenImage's block)."""
    fits = _vectors_fit(h, gate, scale, shift) and _rows_fit(h, y)
    if fits and (pattern_on("adaln") if fuse is None else fuse) and plain_layer_norm(norm, h.shape[-1]):
        h, out = modulate_ops().prechecked(h, gate, y, scale, shift, norm.eps)
        return h, out
    h = residual(h, gate, y, clip=False)
    return h, norm(h) * (1 + _token_dim(scale)) + _token_dim(shift)
