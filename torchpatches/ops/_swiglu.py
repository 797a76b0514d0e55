"""SwiGLU as diffusers computes it, in one pass: FLUX.2's ``silu(x[..., :F]) * x[..., F:]``, and the two-input
``silu(x) * up`` of Z-Image, Ideogram 4, Krea 2 and QwenImage 2.1 (``w2(F.silu(w1(x)) * w3(x))``).

Usable without any patching::

    y = swiglu(x)                      # x [..., 2F] -> y [..., F]
    swiglu(x, out=buf[..., :F])        # write into a (strided) slice of a larger buffer
    y = swiglu(x, up)                  # x, up [..., F] -> silu(x) * up, [..., F]
    swiglu(x, up, out=buf[..., :F])
    y = swiglu(gate, h, activation="sigmoid")   # sigmoid(gate) * h: Krea 2's attention output gate (GLU)

``x`` (and ``up``) may be strided views (unit-stride last dim), e.g. the MLP part of FLUX.2's fused
QKV+MLP projection; a view whose last dim is not unit-stride, or whose leading dims do not flatten to rows
without a copy, is copied first. ``up`` must have ``x``'s shape, dtype and device. ``out`` must have x's
dtype and device, shape ``[..., F]`` and a unit-stride last dim, and its leading dims must flatten to rows
without a copy; it must be writable and must not share memory with ``x`` or ``up`` (``ValueError`` before
anything is written, ``_memory``). ``prechecked(x, up)``: the two-input form without the checks, for the
fusion patterns. ``activation="sigmoid"`` (two-input form): ``sigmoid(x) * up`` (Krea 2's ``hidden_states *
torch.sigmoid(gate)``), rounded after the sigmoid and after the product as there.

Numerics: diffusers' ``Flux2SwiGLU`` (and the two-input feed-forwards) round after ``silu`` and after the
product; so does the kernel. ``silu`` is ``x / (1 + exp(-x))`` in fp32 as in torch's kernel; Triton's ``exp``
may differ in the last fp32 bit, so outputs match diffusers to one ulp. The PyTorch tier is diffusers' expression,
bit for bit; on the CPU, Triton's interpreter takes numpy's ``exp``: fp32 outputs a few ulps off, bf16/fp16 ones
now and then one ulp. Both forms run one kernel: the two-input form gives bit for bit what the one-input form
gives for ``torch.cat([x, up], -1)``.

Tiers (``_tiers``): Triton on CUDA, PyTorch elsewhere and for calls autograd records. Under ``torch.compile`` the
call is one ``torchpatches::swiglu_out`` custom op (with a fake; it mutates ``out``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ._runtime import args as _args, dispatch as _dispatch
from ._runtime.memory import check_out
from ._runtime.tiers import choose_tier, force_tier, needs_grad

__all__ = ["swiglu", "prechecked", "force_tier", "ACTIVATIONS"]



def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """A 2-D [rows, cols] view without copying, or ValueError."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name}'s leading dims cannot be flattened without a copy "
                         f"(shape {tuple(t.shape)}, strides {t.stride()})") from None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, cols] view, through a copy where the leading dims do not flatten (``prechecked``'s inputs)."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.contiguous().view(-1, t.shape[-1])


#: The two-input form's activations: ``"silu"`` (SwiGLU), ``"sigmoid"`` (GLU: Krea 2's attention output gate).
ACTIVATIONS = ("silu", "sigmoid")


def _impl(x: torch.Tensor, out: torch.Tensor, tier: str, up: Optional[torch.Tensor] = None,
          activation: str = "silu") -> None:
    if up is not None:
        if tier == "torch" and activation == "sigmoid":
            # Krea2AttnProcessor: hidden_states * torch.sigmoid(gate)
            out.copy_(up * torch.sigmoid(x))
            return
        if tier == "torch":
            # diffusers' two-input feed-forwards (Z-Image's FeedForward: self.w2(F.silu(self.w1(x)) * self.w3(x)))
            out.copy_(F.silu(x) * up)
            return
        from . import _swiglu_triton

        _swiglu_triton.launch(_flat(x), _rows(out, "out"), _flat(up), sigmoid=activation == "sigmoid")
        return
    half = x.shape[-1] // 2
    if tier == "torch":
        # diffusers.models.transformers.transformer_flux2.Flux2SwiGLU.forward
        out.copy_(F.silu(x[..., :half]) * x[..., half:])
        return
    from . import _swiglu_triton

    _swiglu_triton.launch(_rows(x, "x"), _rows(out, "out"))


@torch.library.custom_op("torchpatches::swiglu_out", mutates_args=("out",))
def _swiglu_op(x: torch.Tensor, out: torch.Tensor, tier: str, up: Optional[torch.Tensor] = None,
               activation: str = "silu") -> None:
    _impl(x, out, tier, up, activation)


@_swiglu_op.register_fake
def _(x, out, tier, up=None, activation="silu") -> None:
    return None


def _unit_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` itself if its last dim is unit-stride and its leading dims flatten to rows without a copy, else a
    contiguous copy."""
    if t.stride(-1) != 1:
        return t.contiguous()
    try:
        _rows(t, name)
    except ValueError:
        return t.contiguous()
    return t


def _swiglu_two(x: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor], tier: Optional[str],
                activation: str = "silu") -> torch.Tensor:
    """The two-input form of :func:`swiglu`: checks, then the op."""
    if _args.float_tensor(x, "x").dim() < 1:
        raise ValueError("x must be a tensor with at least 1 dim [..., F]")
    _args.tensor(up, "up", optional=True)
    if up.shape != x.shape or up.dtype != x.dtype or up.device != x.device:
        raise ValueError(f"up {tuple(up.shape)} {up.dtype} on {up.device} must match x {tuple(x.shape)} {x.dtype} "
                         f"on {x.device}")
    x, up = _unit_rows(x, "x"), _unit_rows(up, "up")
    out = _output(x, out, tuple(x.shape), also={"up": up})
    grad = needs_grad(x, up, out)
    chosen = choose_tier(x.device.type, tier, grad)
    _dispatch.run(x, grad, _impl, _swiglu_op, x, out, chosen, up, activation)  # PyTorch tier: autograd through copy_
    return out


def prechecked(x: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``swiglu(x, up)`` into a new contiguous tensor, for a caller that has already checked what the public entry
    checks: the fusion patterns, which test the same conditions before they choose the fused path. Skipped: the
    argument checks (plain ``torch.Tensor``s of one shape, a served dtype and one device) and the
    ``torch.jit.trace`` / torch.compile / functorch handling (the patterns step aside for all of them). Kept: a copy
    of an input whose last dim is not unit-stride (or whose leading dims do not flatten), a forced tier, the PyTorch
    tier when autograd records. Wrong arguments here are the caller's bug: they may fail inside the kernel."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    # Inference runs without grad mode: then nothing else is read.
    grad = torch.is_grad_enabled() and (x.requires_grad or up.requires_grad)
    # empty_like: a third of torch.empty(shape, dtype=, device=)'s host time (its arguments are parsed in C++)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _impl(x, out, choose_tier(x.device.type, None, grad), up, activation)
    return out


def _output(x: torch.Tensor, out: Optional[torch.Tensor], shape: tuple, **kwargs: Any) -> torch.Tensor:
    """``out`` checked against ``shape`` and ``x`` (and ``also``'s tensors: no overlap), or a new one."""
    if out is None:
        return x.new_empty(shape)  # new_empty: batched under vmap
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != x.dtype
            or out.device != x.device or out.stride(-1) != 1):
        raise ValueError(f"out must be a {x.dtype} tensor of shape {tuple(shape)} on {x.device} with a unit-stride "
                         "last dim")
    _rows(out, "out")
    check_out(x, out, elementwise_in_place=False, **kwargs)
    return out


@_dispatch.public
def swiglu(x: torch.Tensor, up: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
           activation: str = "silu", tier: Optional[str] = None) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]``, or ``silu(x) * up`` given ``up`` (``sigmoid(x) * up`` with
    ``activation="sigmoid"``); returns ``out`` (a new contiguous tensor if not given).

    Raises:
        ValueError: on an odd last dim (one input), an ``up`` that is not a tensor of x's shape, dtype and device,
            an unsupported dtype, an ``out`` that does not fit, or another activation (one of ``ACTIVATIONS``; the
            sigmoid with ``up`` only).
    """
    if activation not in ACTIVATIONS or (activation != "silu" and up is None):
        raise ValueError(f"activation must be one of {ACTIVATIONS} ('sigmoid' with up), got {activation!r}")
    if up is not None:
        return _swiglu_two(x, up, out, tier, activation)
    if _args.float_tensor(x, "x").dim() < 2:
        raise ValueError("x must be a tensor with at least 2 dims [..., 2F]")
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dim {x.shape[-1]} must be even")
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        _rows(x, "x")
    except ValueError:
        x = x.contiguous()
    out = _output(x, out, (*x.shape[:-1], x.shape[-1] // 2))
    grad = needs_grad(x, out)
    chosen = choose_tier(x.device.type, tier, grad)
    _dispatch.run(x, grad, _impl, _swiglu_op, x, out, chosen)  # the PyTorch tier: differentiable through copy_
    return out
