"""Write rows into a column slice of a larger buffer: ``copy_into`` and ``gelu_tanh_into``.

A concat of two activations along the last dim (``torch.cat([attn, gelu(mlp)], dim=-1)``, FLUX.1's
single blocks) is one extra read and write of everything; writing each part straight into its slice
of a preallocated buffer avoids it. torch's elementwise kernels take a slow strided path for such
outputs (on an H100, GELU into a slice ran at 46% of the copy rate), so both writes are a Triton row
kernel on CUDA::

    buf = torch.empty(B, S, A + M)
    gelu_tanh_into(mlp, buf[..., A:])      # == F.gelu(mlp, approximate="tanh"), written into the slice
    copy_into(attn, buf[..., :A])          # == buf[..., :A].copy_(attn)

``x`` and ``out`` have the same shape, dtype (fp32, bf16, fp16) and device, unit-stride last dims, and
leading dims that flatten to rows without a copy; ``out`` must be writable and share no memory with ``x``
unless it is ``x`` itself (``ValueError`` before anything is written, ``_memory``). ``gelu_tanh_into`` computes torch's tanh GELU in
fp32 and rounds once (as torch does); Triton's ``exp``-based tanh may move a result by one ulp.

Tiers (``_tiers``): Triton on CUDA, PyTorch (``torch._C._nn.gelu(..., out=)``, ``copy_``)
elsewhere and for calls autograd records (through ``copy_``, differentiable). Under ``torch.compile`` each call is one mutating custom op with a fake.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._core.lazy import lazy_module
from ._runtime import args as _args, dispatch as _dispatch
from ._runtime.memory import check_out
from ._runtime.tiers import choose_tier, needs_grad

__all__ = ["gelu_tanh_into", "copy_into", "prechecked"]



def _rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _impl(x: torch.Tensor, out: torch.Tensor, act: int, tier: str) -> None:
    if tier == "triton":
        x2, o2 = _rows(x), _rows(out)
        if x2 is not None and o2 is not None:
            _triton_tier().launch(x2, o2, act)
            return
    if act and needs_grad(x, out):
        out.copy_(torch.nn.functional.gelu(x, approximate="tanh"))  # gelu(out=) refuses autograd
    elif act:
        torch._C._nn.gelu(x, approximate="tanh", out=out)
    else:
        out.copy_(x)


#: The Triton tier's module, imported at its first call (it imports triton).
_triton_tier = lazy_module(f"{__package__}._rows_triton")


@torch.library.custom_op("torchpatches::act_into", mutates_args=("out",))
def _act_into_op(x: torch.Tensor, out: torch.Tensor, act: int, tier: str) -> None:
    _impl(x, out, act, tier)


@_act_into_op.register_fake
def _(x, out, act, tier) -> None:
    return None


@_dispatch.public
def _run(x: torch.Tensor, out: torch.Tensor, act: int, tier: Optional[str]) -> torch.Tensor:
    for t, name in ((x, "x"), (out, "out")):
        if _args.float_tensor(t, name).dim() < 1:
            raise ValueError(f"{name} must have at least one dim")
    if x.shape != out.shape or x.dtype != out.dtype or x.device != out.device:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} on {x.device} and out {tuple(out.shape)} {out.dtype} on "
                         f"{out.device} must match")
    if out.stride(-1) != 1 or _rows(out) is None:
        raise ValueError("out needs a unit-stride last dim and leading dims that flatten without a copy")
    check_out(x, out, elementwise_in_place=True)
    if x.stride(-1) != 1 or _rows(x) is None:
        x = x.contiguous()
    grad = needs_grad(x, out)
    chosen = choose_tier(x.device.type, tier, grad)
    _dispatch.run(x, grad, _impl, _act_into_op, x, out, act, chosen)  # PyTorch tier: differentiable via copy_
    return out


def prechecked(x: torch.Tensor, out: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """``gelu_tanh_into`` (``gelu``) or ``copy_into`` for a caller that has made their checks: the FLUX.1 single
    block pattern, which writes plain tensors of one dtype and device into the column slices of a buffer it has
    just allocated (same shapes, no shared memory by construction, nothing traced or transformed). Skipped: those
    checks (about 13 us of Python per call on a 2-core CPU, 76 calls per FLUX.1 step). Kept: a copy of an ``x``
    whose rows are not unit-stride views, and the tier choice (a forced tier, autograd recording)."""
    if x.stride(-1) != 1 or _rows(x) is None:
        x = x.contiguous()
    grad = torch.is_grad_enabled() and (x.requires_grad or out.requires_grad)
    _impl(x, out, 1 if gelu else 0, choose_tier(x.device.type, None, grad))
    return out


def gelu_tanh_into(x: torch.Tensor, out: torch.Tensor, *, tier: Optional[str] = None) -> torch.Tensor:
    """``out[...] = F.gelu(x, approximate="tanh")``; returns ``out``."""
    return _run(x, out, 1, tier)


def copy_into(x: torch.Tensor, out: torch.Tensor, *, tier: Optional[str] = None) -> torch.Tensor:
    """``out.copy_(x)`` for same-dtype tensors (a row kernel on CUDA); returns ``out``."""
    return _run(x, out, 0, tier)
