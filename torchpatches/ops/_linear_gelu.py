"""``gelu(x @ W.T + b, approximate="tanh")`` with the GELU in the GEMM's epilogue (cuBLASLt).

Usable without any patching::

    y = linear_gelu_tanh(x, weight, bias)     # == F.gelu(F.linear(x, weight, bias), approximate="tanh")

Tiers:

- ``cublaslt`` (CUDA, fp16/bf16, 1-D bias, ``x`` flattening to a 2-D matrix): ``torch._addmm_activation(bias,
  x2d, weight.T, use_gelu=True)``, which torch sends to cuBLASLt with ``CUBLASLT_EPILOGUE_GELU_BIAS``
  (the tanh approximation, as cuBLASLt documents it; torch's own fallback when Lt is disabled is
  ``gelu_(..., "tanh")`` too). The GELU costs no pass over the ``[M, N]`` output.
- ``torch``: ``F.gelu(F.linear(x, weight, bias), approximate="tanh")``, diffusers' own two ops. Used for
  every call autograd records (``torch._addmm_activation`` has no derivative) and on every other device: **on CPU ``torch._addmm_activation(use_gelu=True)`` computes the exact (erf) GELU,
  not the tanh form** (torch 2.11 and 2.13, checked), so it is never used there.

Rounding: diffusers rounds the GEMM output to bf16/fp16 and then rounds the GELU of that; the
epilogue applies GELU to the fp32 accumulator (plus bias) and rounds once. So the fused result is
the more accurate one and differs from diffusers by at most about one ulp of the output (the GELU's
slope is at most ~1.13, so the input rounding moves the output by at most ~1.13 input ulps, plus
diffusers' second rounding).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._runtime import args as _args
from ._runtime.tiers import forced_tier, grad_refusal, jit_tracing, needs_grad

__all__ = ["linear_gelu_tanh", "lt_tier_fits"]


def lt_tier_fits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """True when the cuBLASLt epilogue tier can run this call."""
    return (
        x.device.type == "cuda"
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and bias is not None
        and bias.dtype == x.dtype
        and bias.dim() == 1
        and weight.dim() == 2
        and x.shape[-1] == weight.shape[1]
        and x.numel() > 0
        and weight.shape[0] > 1
        and weight.shape[1] > 1
    )


def linear_gelu_tanh(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    *,
    tier: Optional[str] = None,
) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias), approximate="tanh")``, the GELU fused into the GEMM where possible.

    ``tier``: ``"cublaslt"``, ``"torch"`` or None (automatic: cuBLASLt when it fits).
    """
    _args.tensor(x, "x"), _args.tensor(weight, "weight"), _args.tensor(bias, "bias", optional=True)
    requested = tier if tier is not None else forced_tier()
    if requested not in (None, "cublaslt", "torch", "triton", "flashinfer"):
        raise ValueError(f"unknown tier {requested!r}; expected 'cublaslt', 'torch' or None")
    if needs_grad(x, weight, bias):  # torch._addmm_activation has no derivative
        if requested == "cublaslt":
            raise ValueError(grad_refusal("cublaslt"))
        requested = "torch"
    if requested is None and jit_tracing():
        requested = "torch"  # torch.jit.trace: diffusers' ops, traceable
    use_lt = requested in (None, "cublaslt", "triton", "flashinfer") and lt_tier_fits(x, weight, bias)
    if requested == "cublaslt" and not use_lt:
        raise ValueError("tier='cublaslt' needs CUDA fp16/bf16 x, weight and a 1-D bias of the same dtype")
    if not use_lt:
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    x2 = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])
