"""PyTorch tier of ``ops/modulate.py``: diffusers' own op sequence, so it rounds exactly where diffusers does.

``scale``, ``shift`` and ``gate`` are ``[B, S or 1, D]`` (the public API adds the token dim).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def layer_norm_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    # diffusers: self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale) + shift


def gate_residual(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, clip: bool) -> torch.Tensor:
    # diffusers: hidden_states = hidden_states + gate.unsqueeze(1) * attn_output (then fp16 clip)
    out = residual + gate * y
    if clip and out.dtype == torch.float16:
        out = out.clip(-65504, 65504)
    return out


def gate_residual_layer_norm_modulate(
    residual: torch.Tensor,
    gate: torch.Tensor,
    y: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    clip: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    h = gate_residual(residual, gate, y, clip)
    return h, layer_norm_modulate(h, scale, shift, eps)


def apply(
    residual: torch.Tensor,
    gate: Optional[torch.Tensor],
    y: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    shift: Optional[torch.Tensor],
    eps: float,
    clip: bool,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(h, out) for the three forms, as the Triton kernel computes them."""
    h = gate_residual(residual, gate, y, clip) if gate is not None else residual
    out = layer_norm_modulate(h, scale, shift, eps) if scale is not None else None
    return (h if gate is not None else None), out
