"""PyTorch tier of ``ops/_modulate.py``: the models' own op sequences, so it rounds exactly where they do.

``scale``, ``shift`` and ``gate`` are ``[B, D]`` or ``[B, S or 1, D]`` (a ``[B, D]`` one gets its token dim
here, as diffusers' ``[:, None]``). ``once``:
Wan's form, fp32 compute rounded once to ``x``'s dtype (``.type_as``); else diffusers' FLUX form.
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
    return _clip_fp16(residual + gate * y, clip)


def tokens(v: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A ``[B, D]`` vector with its token dim (diffusers' ``[:, None]``); other forms as they are."""
    return v[:, None] if v is not None and v.dim() == 2 else v


_tokens = tokens


def select_rows(v: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """``[B + 1, D]`` rows to per-token ``[B, S, D]`` vectors: diffusers 0.42.1 QwenImage 2.1
    ``_select_modulation_rows(params, target_token_mask)``, verbatim."""
    real, zero = v[:-1].unsqueeze(1), v[-1:].unsqueeze(0)
    return torch.where(select.view(1, -1, 1), real, zero)


def _clip_fp16(t: torch.Tensor, clip: bool) -> torch.Tensor:
    return t.clip(-65504, 65504) if clip and t.dtype == torch.float16 else t


def _once(fn, x: torch.Tensor, *tensors: torch.Tensor, **kwargs) -> torch.Tensor:
    # Wan: (norm(x.float()) * (1 + scale) + shift).type_as(x); (x.float() + y * gate).type_as(x)
    return fn(x.float(), *(t.float() for t in tensors), **kwargs).to(x.dtype)


def layer_norm_affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, once: bool
                      ) -> torch.Tensor:
    # Wan (cross_attn_norm): FP32LayerNorm(h.float()).type_as(h), i.e. F.layer_norm in fp32 rounded once
    if once:
        return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers 0.42.1 ``Krea2RMSNorm.forward``, verbatim: fp32 statistics, ``1 + weight``, one rounding."""
    dtype = x.dtype
    x = F.rms_norm(x.float(), (x.shape[-1],), weight=weight + 1.0, eps=eps)
    return x.to(dtype)


def rms_norm_weightless(x: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers 0.42.1 ``RMSNorm.forward`` without a weight (``elementwise_affine=False``), verbatim."""
    input_dtype = x.dtype
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return x.to(input_dtype)


def apply(residual: torch.Tensor, gate: Optional[torch.Tensor], y: Optional[torch.Tensor],
          scale: Optional[torch.Tensor], shift: Optional[torch.Tensor], eps: float, clip: bool,
          once: bool = False, affine: bool = False, norm_weight: Optional[torch.Tensor] = None, rms: bool = False
          ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(h, out) for the forms, as the Triton kernel computes them (the arguments of its ``launch``):
    ``y`` without ``gate`` is a plain residual add (Wan: ``hidden_states + attn_output``); ``affine``:
    ``scale``/``shift`` are a LayerNorm's weight and bias; ``norm_weight``: Krea 2's zero-centered RMSNorm in place
    of the LayerNorm (``(1.0 + scale) * norm(h) + shift``, diffusers' ``Krea2TransformerBlock``); ``rms`` without it:
    diffusers' weightless RMSNorm (LTX-2's ``norm(h) * (1 + scale) + shift``)."""
    gate = _tokens(gate)
    if not affine:  # affine: scale and shift are the LayerNorm's [D] weight and bias
        scale, shift = _tokens(scale), _tokens(shift)
    h = residual
    if gate is not None:
        h = _clip_fp16(_once(gate_residual, residual, gate, y, clip=False), clip) if once else \
            gate_residual(residual, gate, y, clip)
    elif y is not None:
        h = _clip_fp16(residual + y, clip)
    out = None
    if scale is not None and norm_weight is not None:
        out = (1.0 + scale) * zero_centered_rms_norm(h, norm_weight, eps) + shift
    elif scale is not None and rms:
        out = rms_norm_weightless(h, eps) * (1 + scale) + shift
    elif scale is not None and affine:
        out = layer_norm_affine(h, scale, shift, eps, once)
    elif scale is not None:
        out = _once(layer_norm_modulate, h, scale, shift, eps=eps) if once else layer_norm_modulate(h, scale, shift, eps)
    return (h if y is not None else None), out
