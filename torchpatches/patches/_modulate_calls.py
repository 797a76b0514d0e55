"""How the adaln and gate_residual patches call ``ops.modulate``, with diffusers' own math as the fallback.

Each helper takes the vectors as diffusers holds them (``[B, D]`` chunks in FLUX.1, ``[B, 1, D]`` in
FLUX.2, ``[B, S, D]`` in FLUX.2's KV-cache blend) and runs the fused op when every tensor fits
(same dtype and device as ``x``, plain tensors), else exactly the expression diffusers evaluates.
``modulated_once`` is the other rounding mode: Wan's fp32 compute, rounded once (``.type_as``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..ops._tiers import FLOAT_DTYPES
from ._fused_common import pattern_on, plain_layer_norm, tensors_fit


def _token_dim(v: torch.Tensor) -> torch.Tensor:
    return v[:, None] if v.dim() == 2 else v  # diffusers: scale_msa[:, None] / gate.unsqueeze(1)


def _vectors_fit(x: torch.Tensor, *vectors: Optional[torch.Tensor], rounding: str = "each") -> bool:
    if rounding == "once":  # fp32 compute: vectors of any float dtype (Wan's fp32 scale_shift_table)
        if not all(v is None or (type(v) is torch.Tensor and v.dtype in FLOAT_DTYPES and v.device == x.device)
                   for v in vectors):
            return False
    elif not tensors_fit(*vectors, dtype=x.dtype, device=x.device):
        return False
    B, S, D = x.shape
    for v in vectors:
        if v is None:
            continue
        if v.dim() == 2:
            if v.shape != (B, D):
                return False
        elif v.dim() != 3 or v.shape[0] != B or v.shape[2] != D or v.shape[1] not in (1, S):
            return False
    return True


def modulated(norm: Any, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, *, fuse: bool) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift``: one kernel when ``fuse`` and everything fits."""
    if fuse and x.dim() == 3 and plain_layer_norm(norm, x.shape[-1]) and _vectors_fit(x, scale, shift):
        from ..ops import modulate as ops

        return ops.layer_norm_modulate(x, scale, shift, eps=norm.eps)
    return norm(x) * (1 + _token_dim(scale)) + _token_dim(shift)


def modulated_once(norm: Any, norm_cls: type, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor
                   ) -> torch.Tensor:
    """Wan's ``(norm(x.float()) * (1 + scale) + shift).type_as(x)``: one kernel when everything fits."""
    if x.dim() == 3 and plain_layer_norm(norm, x.shape[-1], norm_cls) and _vectors_fit(x, scale, shift,
                                                                                        rounding="once"):
        from ..ops import modulate as ops

        return ops.layer_norm_modulate(x, scale, shift, eps=norm.eps, rounding="once")
    return (norm(x.float()) * (1 + _token_dim(scale)) + _token_dim(shift)).type_as(x)


def residual(h: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, *, clip: bool) -> torch.Tensor:
    """``h + gate * y`` (then diffusers' fp16 clip if ``clip``): one kernel when everything fits."""
    if h.dim() == 3 and y.shape == h.shape and _vectors_fit(h, gate) and tensors_fit(y, dtype=h.dtype, device=h.device):
        from ..ops import modulate as ops

        return ops.gate_residual(h, gate, y, clip_fp16=clip)
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
    fits = (
        h.dim() == 3
        and y.shape == h.shape
        and tensors_fit(y, dtype=h.dtype, device=h.device)
        and _vectors_fit(h, gate, scale, shift)
    )
    if fits and (pattern_on("adaln") if fuse is None else fuse) and plain_layer_norm(norm, h.shape[-1]):
        from ..ops import modulate as ops

        return ops.gate_residual_layer_norm_modulate(h, gate, y, scale, shift, eps=norm.eps)
    h = residual(h, gate, y, clip=False)
    return h, norm(h) * (1 + _token_dim(scale)) + _token_dim(shift)
