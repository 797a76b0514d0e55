"""SwiGLU as FLUX.2 computes it, in one pass: ``silu(x[..., :F]) * x[..., F:]``.

Usable without any patching::

    y = swiglu(x)                      # x [..., 2F] -> y [..., F]
    swiglu(x, out=buf[..., :F])        # write into a (strided) slice of a larger buffer

``x`` may be a strided view (unit-stride last dim), e.g. the MLP part of FLUX.2's fused
QKV+MLP projection. ``out`` must have x's dtype and device, shape ``[..., F]`` and a unit-stride last
dim, and its leading dims must flatten to rows without a copy; it must be writable and must not share
memory with ``x`` (``ValueError`` before anything is written, ``_memory``).

Numerics: diffusers' ``Flux2SwiGLU`` rounds after ``silu`` and after the product; so does the
kernel. ``silu`` is ``x / (1 + exp(-x))`` in fp32 as in torch's kernel; Triton's ``exp`` may differ
in the last fp32 bit, so outputs match diffusers to one ulp (bit-identical on the CPU tiers).

Tiers (``_tiers``): Triton on CUDA, PyTorch elsewhere and for calls autograd records. Under ``torch.compile`` the call is one
``torchpatches::swiglu`` custom op (with a fake; it mutates ``out``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._runtime import args as _args, dispatch as _dispatch
from ._runtime.memory import check_out
from ._runtime.tiers import choose_tier, force_tier, needs_grad

__all__ = ["swiglu", "force_tier"]



def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """A 2-D [rows, cols] view without copying, or ValueError."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name}'s leading dims cannot be flattened without a copy "
                         f"(shape {tuple(t.shape)}, strides {t.stride()})") from None


def _impl(x: torch.Tensor, out: torch.Tensor, tier: str) -> None:
    half = x.shape[-1] // 2
    if tier == "torch":
        # diffusers.models.transformers.transformer_flux2.Flux2SwiGLU.forward
        out.copy_(F.silu(x[..., :half]) * x[..., half:])
        return
    from . import _swiglu_triton

    _swiglu_triton.launch(_rows(x, "x"), _rows(out, "out"))


@torch.library.custom_op("torchpatches::swiglu_out", mutates_args=("out",))
def _swiglu_op(x: torch.Tensor, out: torch.Tensor, tier: str) -> None:
    _impl(x, out, tier)


@_swiglu_op.register_fake
def _(x, out, tier) -> None:
    return None


@_dispatch.public
def swiglu(x: torch.Tensor, *, out: Optional[torch.Tensor] = None, tier: Optional[str] = None) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]``; returns ``out`` (a new contiguous tensor if not given).

    Raises:
        ValueError: on an odd last dim, unsupported dtype, or an ``out`` that does not fit.
    """
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
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    if out is None:
        out = x.new_empty(shape)  # new_empty: batched under vmap
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != x.dtype
          or out.device != x.device or out.stride(-1) != 1):
        raise ValueError(f"out must be a {x.dtype} tensor of shape {shape} on {x.device} with a unit-stride "
                         "last dim")
    else:
        _rows(out, "out")
        check_out(x, out, elementwise_in_place=False)
    grad = needs_grad(x, out)
    chosen = choose_tier(x.device.type, tier, grad)
    _dispatch.run(x, grad, _impl, _swiglu_op, x, out, chosen)  # the PyTorch tier: differentiable through copy_
    return out
