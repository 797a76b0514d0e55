"""Two partial attention results merged by their log-sum-exps, in one pass: the step ring attention repeats.

Usable without any patching::

    out, lse = lse_merge(out_a, lse_a, out_b, lse_b)                          # fp32 out
    out, lse = lse_merge(out_a, lse_a, out_b, lse_b, out_dtype=torch.bfloat16)  # the last step of a ring

``out_a`` / ``out_b`` are attention outputs over two disjoint sets of keys, ``[..., D]`` (diffusers' layout
``[B, S, H, D]``), of any float dtypes; ``lse_a`` / ``lse_b`` their log-sum-exps, ``[...]`` (``[B, S, H]``). The
result is the attention over both sets, as diffusers' ``TemplatedRingAttention.forward`` computes it with
``convert_to_fp32`` (its default), the formula of ring-flash-attention PR 34::

    out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)       fp32, then .to(out_dtype)
    lse = lse_a - logsigmoid(lse_a - lse_b)                      fp32

Returns new contiguous tensors: ``out`` of ``out_dtype`` (default fp32) and shape ``out_a.shape``, ``lse``
fp32 of ``lse_a.shape``. diffusers runs this as about ten torch ops over fp32 copies of the outputs (two
casts, five for ``out``, three for ``lse``, the final cast); the kernel reads each input once and writes
each output once.

Numerics: the PyTorch tier is diffusers' code. The Triton tier computes the same fp32 steps with the
functions torch's CUDA kernels call (``_lse_merge_triton``): bit-identical on CUDA, except that Triton links
libdevice flushing fp32 subnormals to zero, which torch's kernels do not. That shows only where the two
log-sum-exps are about 80 to 103 apart (sigmoid's weight, its product with ``out_a - out_b``, or
``exp(-|lse_a - lse_b|)`` subnormal) and the output or log-sum-exp is itself about zero: there the result is off by
less than 2^-124 (``benchmarks/lse_merge_edges.py`` and the CUDA test measure it on an H200: at most 3.5e-38).
Under the CPU interpreter (numpy's ``exp`` / ``log``) within a few fp32 ulps.

Tiers (``_tiers``): Triton on CUDA for head dims up to 8192, PyTorch elsewhere and for every call autograd
records (``tier="triton"`` then raises ``ValueError``). Traced, the call is one ``torchpatches::lse_merge``
custom op with a fake (``_dispatch``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._runtime import args as _args, dispatch as _dispatch
from ._runtime.tiers import FLOAT_DTYPES, choose_tier, force_tier, needs_grad

__all__ = ["lse_merge", "force_tier"]

#: The widest output row one program of the Triton tier holds.
MAX_TRITON_D = 8192


def _torch_tier(out_a, lse_a, out_b, lse_b, out_dtype) -> list[torch.Tensor]:
    # diffusers 0.42.1 TemplatedRingAttention.forward, convert_to_fp32=True
    prev_out, out = out_a.to(torch.float32), out_b.to(torch.float32)
    prev_lse, lse = lse_a.to(torch.float32).unsqueeze(-1), lse_b.to(torch.float32).unsqueeze(-1)
    out = prev_out - F.sigmoid(lse - prev_lse) * (prev_out - out)
    lse = prev_lse - F.logsigmoid(prev_lse - lse)
    # contiguous as the Triton tier's and the fake's (the inputs may be views)
    return [out.to(out_dtype).contiguous(), lse.squeeze(-1).contiguous()]


def _impl(out_a, lse_a, out_b, lse_b, out_dtype, tier) -> list[torch.Tensor]:
    if tier == "torch":
        return _torch_tier(out_a, lse_a, out_b, lse_b, out_dtype)
    from . import _lse_merge_triton

    out = torch.empty(out_a.shape, dtype=out_dtype, device=out_a.device)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
    _lse_merge_triton.launch(out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(), lse_b.contiguous(),
                             out, lse)
    return [out, lse]


@torch.library.custom_op("torchpatches::lse_merge", mutates_args=())
def _lse_merge_op(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                  out_dtype: torch.dtype, tier: str) -> list[torch.Tensor]:
    return _impl(out_a, lse_a, out_b, lse_b, out_dtype, tier)


@_lse_merge_op.register_fake
def _(out_a, lse_a, out_b, lse_b, out_dtype, tier):
    return [out_a.new_empty(out_a.shape, dtype=out_dtype), lse_a.new_empty(lse_a.shape, dtype=torch.float32)]


def _check(out_a, lse_a, out_b, lse_b, out_dtype) -> None:
    _args.float_tensor(out_a, "out_a")
    if out_a.dim() < 1:
        raise ValueError("out_a must have at least 1 dim [..., D]")
    for t, name in ((out_b, "out_b"), (lse_a, "lse_a"), (lse_b, "lse_b")):
        _args.float_tensor(t, name)
        if t.device != out_a.device:
            raise ValueError(f"{name} is on {t.device}, out_a on {out_a.device}")
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b's shape {tuple(out_b.shape)} differs from out_a's {tuple(out_a.shape)}")
    rows = out_a.shape[:-1]
    if lse_a.shape != rows or lse_b.shape != rows:
        raise ValueError(f"lse_a and lse_b must have shape {tuple(rows)} (out_a's without its last dim), got "
                         f"{tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")


@_dispatch.public
def lse_merge(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention over the keys of both partial results (see the module docstring).

    Raises:
        ValueError: on any input that does not fit, before anything is computed.
    """
    _check(out_a, lse_a, out_b, lse_b, out_dtype)
    grad = needs_grad(out_a, lse_a, out_b, lse_b)
    chosen = choose_tier(out_a.device.type, tier, grad)
    if chosen == "triton" and out_a.shape[-1] > MAX_TRITON_D:
        if tier == "triton":
            raise ValueError(f"tier='triton' serves rows of at most {MAX_TRITON_D} values, got {out_a.shape[-1]}")
        chosen = "torch"
    outs = _dispatch.run(out_a, grad, _impl, _lse_merge_op, out_a, lse_a, out_b, lse_b, out_dtype, chosen)
    return outs[0], outs[1]
