"""RMSNorm adaLN for DiTs whose blocks are RMSNorm sandwiches (Z-Image, Ideogram 4): norm + scale, gated post-norm
residual, and both in one pass.

Usable without any patching::

    out = rms_norm_scale(x, weight, scale, eps=1e-5)                  # RMSNorm(x) * scale
    h = gate_rms_norm_residual(residual, gate, y, weight, eps=1e-5)   # residual + gate * RMSNorm(y)
    h, out = gate_rms_norm_residual_scale(residual, gate, y, y_weight, weight, scale)  # both, RMSNorm(h) * scale

``RMSNorm`` is diffusers' ``models.normalization.RMSNorm`` with a ``[D]`` weight of the activations' dtype:
``round(round(x * rsqrt(mean(x^2) + eps)) * weight)`` (fp32 statistics; ``x * rstd`` cast to the weight's dtype,
then the product with the weight). ``scale`` is the multiplier as the model forms it (Z-Image's ``1.0 + scale``),
``gate`` the gate as the model forms it (its ``tanh``). ``x``/``residual``/``y`` are ``[B, S, D]`` (last dim
unit-stride); ``scale`` and ``gate`` ``[B, D]``, ``[B, 1, D]`` or ``[B, S, D]``, of ``x``'s dtype; outputs are new
contiguous tensors of ``x``'s dtype (fp32, bf16, fp16).

Numerics: what diffusers computes, rounded where it rounds (each bf16/fp16 op rounds its fp32 result), so results
are bit-identical except where the fp32 statistics (another summation order) differ in their last bit and that
crosses a rounding boundary: then one ulp of the norm's output, carried through what follows.

Tiers (``_tiers``): Triton on CUDA (one program per token row), PyTorch elsewhere (the reference: diffusers' op
sequence) and for every call autograd records. Traced, each function is one ``torchpatches::rms_modulate`` custom op
with a fake.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._core.lazy import lazy_module
from ._modulate import _rows, _vector
from ._runtime import args as _args, dispatch as _dispatch
from ._runtime.tiers import choose_tier, force_tier, needs_grad

__all__ = ["rms_norm_scale", "gate_rms_norm_residual", "gate_rms_norm_residual_scale", "force_tier"]

_HALF = (torch.float16, torch.bfloat16)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers 0.42.1 ``RMSNorm.forward`` with a weight (its non-NPU branch), verbatim."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype in _HALF:
        x = x.to(weight.dtype)
    return x * weight


def _tokens(v: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return v[:, None] if v is not None and v.dim() == 2 else v


def _torch_tier(residual, gate, y, y_weight, weight, scale, eps_y, eps):
    h = residual
    if y is not None:
        # Z-Image / Ideogram 4: x + gate_msa * self.attention_norm2(attn_out)
        h = residual + _tokens(gate) * rms_norm_torch(y, y_weight, eps_y)
    out = None
    if weight is not None:
        # self.attention_norm1(x) * scale_msa
        out = rms_norm_torch(h, weight, eps) * _tokens(scale)
    return [t for t in ((h if y is not None else None), out) if t is not None]


def _impl(residual: torch.Tensor, gate: Optional[torch.Tensor], y: Optional[torch.Tensor],
          y_weight: Optional[torch.Tensor], weight: Optional[torch.Tensor], scale: Optional[torch.Tensor],
          eps_y: float, eps: float, tier: str) -> list[torch.Tensor]:
    """The op body: [h] (gated residual only), [out] (norm only) or [h, out]."""
    if tier == "torch":
        return _torch_tier(residual, gate, y, y_weight, weight, scale, eps_y, eps)
    h = torch.empty_like(residual, memory_format=torch.contiguous_format) if y is not None else None
    out = torch.empty_like(residual, memory_format=torch.contiguous_format) if weight is not None else None
    _triton_tier().launch(residual, gate, y, y_weight, weight, scale, h, out, eps_y=eps_y, eps=eps)
    return [t for t in (h, out) if t is not None]


#: The Triton tier's module, imported at its first call (it imports triton).
_triton_tier = lazy_module(f"{__package__}._rms_modulate_triton")


@torch.library.custom_op("torchpatches::rms_modulate", mutates_args=())
def _rms_modulate_op(residual: torch.Tensor, gate: Optional[torch.Tensor], y: Optional[torch.Tensor],
                     y_weight: Optional[torch.Tensor], weight: Optional[torch.Tensor], scale: Optional[torch.Tensor],
                     eps_y: float, eps: float, tier: str) -> list[torch.Tensor]:
    return _impl(residual, gate, y, y_weight, weight, scale, eps_y, eps, tier)


@_rms_modulate_op.register_fake
def _(residual, gate, y, y_weight, weight, scale, eps_y, eps, tier):
    n = int(y is not None) + int(weight is not None)
    return [torch.empty_like(residual, memory_format=torch.contiguous_format) for _ in range(n)]


def _weight(w: torch.Tensor, name: str, ref: torch.Tensor) -> torch.Tensor:
    """An RMSNorm's ``[D]`` weight of ``ref``'s dtype and device (another dtype changes diffusers' result dtype)."""
    if not isinstance(w, torch.Tensor) or w.shape != ref.shape[-1:]:
        raise ValueError(f"{name} must be a [{ref.shape[-1]}] tensor, got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if w.dtype != ref.dtype or w.device != ref.device:
        raise ValueError(f"{name} is {w.dtype} on {w.device}; expected {ref.dtype} on {ref.device}")
    return w.contiguous()


@_dispatch.public
def _run(residual, gate, y, y_weight, weight, scale, eps_y, eps, tier, y_names=("y_weight", "y_eps")):
    residual = _rows(residual, "x" if y is None else "residual")
    if y is not None:
        y = _rows(y, "y")
        if y.shape != residual.shape or y.dtype != residual.dtype or y.device != residual.device:
            raise ValueError(f"y {tuple(y.shape)} {y.dtype} on {y.device} does not match residual "
                             f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
        if gate is None:
            raise ValueError("gate must be a torch.Tensor, got None")
        gate = _vector(gate, "gate", residual, False)
        y_weight = _weight(y_weight, y_names[0], residual)  # named as the public function names it
        eps_y = _args.number(eps_y, y_names[1])
    if weight is not None:
        if scale is None:
            raise ValueError("scale must be a torch.Tensor, got None")
        weight = _weight(weight, "weight", residual)
        scale = _vector(scale, "scale", residual, False)
        eps = _args.number(eps, "eps")
    grad = needs_grad(residual, gate, y, y_weight, weight, scale)
    chosen = choose_tier(residual.device.type, tier, grad)
    return _dispatch.run(residual, grad, _impl, _rms_modulate_op, residual, gate, y, y_weight, weight, scale,
                         float(eps_y or 0.0), float(eps or 0.0), chosen)


def prechecked(residual: torch.Tensor, gate: Optional[torch.Tensor], y: Optional[torch.Tensor],
               y_weight: Optional[torch.Tensor], weight: Optional[torch.Tensor], scale: Optional[torch.Tensor],
               eps_y: float, eps: float) -> list[torch.Tensor]:
    """The op for a fusion pattern that has checked what the public entries check (plain tensors of one dtype and
    device, ``[B, S, D]`` rows, vectors and weights that fit, numbers for eps) and steps aside under tracing and
    transforms, as ``_modulate.prechecked``. Kept: unit-stride copies, a forced tier, the PyTorch tier when autograd
    records. Wrong arguments here are the caller's bug."""
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    if y is not None and y.stride(-1) != 1:
        y = y.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    if scale is not None and scale.stride(-1) != 1:
        scale = scale.contiguous()
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (residual, gate, y, y_weight, weight, scale))
    tier = choose_tier(residual.device.type, None, grad)
    return _impl(residual, gate, y, y_weight, weight, scale, float(eps_y), float(eps), tier)


def rms_norm_scale(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, eps: float = 1e-5,
                   tier: Optional[str] = None) -> torch.Tensor:
    """``RMSNorm(x) * scale`` (diffusers' RMSNorm with ``weight``), rounded where diffusers rounds.

    Raises:
        ValueError: on shapes, dtypes or devices that do not fit (see the module docstring).
    """
    if weight is None:
        raise ValueError("weight must be a torch.Tensor, got None")
    return _run(x, None, None, None, weight, scale, None, eps, tier)[0]


def gate_rms_norm_residual(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, *,
                           eps: float = 1e-5, tier: Optional[str] = None) -> torch.Tensor:
    """``residual + gate * RMSNorm(y)`` (``gate`` broadcast over tokens), rounded where diffusers rounds."""
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"y must be a torch.Tensor, got {type(y).__name__}")
    return _run(residual, gate, y, weight, None, None, eps, None, tier, ("weight", "eps"))[0]


def gate_rms_norm_residual_scale(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor,
                                 y_weight: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                                 y_eps: float = 1e-5, eps: float = 1e-5, tier: Optional[str] = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * RMSNorm_y(y)`` and ``RMSNorm(h) * scale`` in one pass: ``(h, out)``."""
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if weight is None:
        raise ValueError("weight must be a torch.Tensor, got None")
    h, out = _run(residual, gate, y, y_weight, weight, scale, y_eps, eps, tier)
    return h, out
