"""A linear layer with LoRA adapters, each adapter's product added in the epilogue of its GEMM.

Usable without any patching::

    y = lora_linear(x, weight, bias, [(A, B, scaling), ...])            # peft's lora.Linear, stock case
    y = lora_linear(x, weight, bias, adapters, gelu=True)               # then F.gelu(..., approximate="tanh")

computes ``F.linear(x, weight, bias) + sum(F.linear(F.linear(x, A), B) * scaling)`` (adapters in order), then
the tanh GELU if asked.

Tiers:

- ``epilogue`` (any device): the base result is computed once, then for each adapter ``t = x @ A.T`` (a small
  GEMM, ``[tokens, rank]``) and ``result.addmm_(t, B.T, alpha=scaling)``: the adapter's product is added to
  the result by the GEMM itself (cuBLAS with ``beta=1``), where peft's ``result + lora_B(lora_A(x)) * scaling``
  writes ``lora_B``'s output, multiplies it and adds it in three more passes over the ``[tokens, out]`` output
  and two temporaries. With ``gelu=True`` the last adapter's GEMM applies the tanh GELU in its epilogue on
  CUDA: ``torch._addmm_activation(result, t, B.T, beta=1, alpha=scaling, use_gelu=True, out=result)`` (cuBLASLt
  ``CUBLASLT_EPILOGUE_GELU`` with C = the result where torch sends a 2-D ``self`` through Lt; otherwise torch
  runs the GEMM and ``gelu_(result, "tanh")``: the tanh form either way). **On the CPU
  ``_addmm_activation(use_gelu=True)`` is the erf GELU** (torch 2.11, 2.13), so there the GELU is
  ``F.gelu(..., approximate="tanh")`` after the last ``addmm_``. A scaling held in a 0-d tensor on the device
  (peft's hotswap preparation stores them so) scales ``t`` in place instead of passing ``alpha``: reading the
  value would wait for the GPU.
- ``torch``: peft's and diffusers' own ops in their order (differentiable; every call autograd records, and
  ``torch.jit.trace``).

Rounding against peft's order (``u = round(t @ B.T)``, ``round(u * s)``, ``round(result + ...)``): fp32 is
bit-identical when ``scaling`` is a power of two (``s * x`` is then exact, so it does not matter whether the
GEMM fuses ``alpha * acc + C`` into one FMA or, as MKL does on the CPU, applies ``alpha`` to the packed operand
before it accumulates); otherwise both are the same products summed with roundings in another order, within
the GEMM's own error bound (``(rank + 2) * u * (|C| + s * |t| @ |B|.T)``, measured at 3 - 5 units of
``u = 2**-24``). bf16/fp16 round the sum once where peft rounds three times (the fused result is the more
accurate one), so the fused output is within, in ulps of peft's at the magnitude of the summands: **1** per
adapter whose scaling is a power of two; **2** per adapter otherwise, because peft rounds the unscaled product
``u`` and then ``u * s`` (up to ``s/2`` ulp of ``u`` plus 1/2 ulp of the product, at most 1.5 ulp of it, before
the sum's rounding, which both paths make); one more with the GELU. Several adapters' bounds add up (each sum is
rounded into the result, peft's too). The bounds are reached (CPU, ``tests/patches/test_lora.py``): 1 ulp for
scalings 0.5, 1, 2 (0 on an H200), 2 for 1.25 and 1.5 (an H200 too), 3 with the GELU at 1.5; two adapters 2 (1, 2) and 3 (1.25,
1.5).
A scaling of 0 runs peft's order for its adapter (``result + u * 0``): a GEMM with ``alpha=0`` may skip its
product (MKL's fp32 GEMM and cuBLAS do), and peft's result is NaN wherever ``u`` is not finite (an inf or NaN adapter
weight). Where ``u`` overflows fp16 but ``u * s`` would not, peft's result is inf and the fused one finite. A
device-tensor scaling that is not a power of two rounds ``t * s`` instead of ``u * s``: within 2 ulp at the
magnitude of ``s * |t| @ |B|.T``, which can be many ulps of the output where the rank sum cancels.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ._runtime import args as _args
from ._runtime.dispatch import public
from ._runtime.tiers import forced_tier, grad_refusal, jit_tracing, needs_grad

__all__ = ["lora_linear", "prechecked", "Adapter"]

#: One adapter: (lora_A weight ``[rank, in]``, lora_B weight ``[out, rank]``, scaling: a number or a 0-d tensor).
Adapter = Tuple[torch.Tensor, torch.Tensor, Union[float, torch.Tensor]]


@public
def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    adapters: Sequence[Adapter],
    *,
    gelu: bool = False,
    tier: Optional[str] = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias) + sum(F.linear(F.linear(x, A), B) * s for A, B, s in adapters)``, then
    ``F.gelu(..., approximate="tanh")`` if ``gelu``.

    ``tier``: ``"epilogue"``, ``"torch"`` or None (automatic: the epilogue tier unless autograd records the
    call or ``torch.jit.trace`` is recording; a forced ``"torch"`` tier is honoured, any other forced tier
    means the epilogue tier).
    """
    _args.tensor(x, "x"), _args.tensor(weight, "weight"), _args.tensor(bias, "bias", optional=True)
    for i, (a, b, scaling) in enumerate(adapters):
        _args.tensor(a, f"adapters[{i}] A"), _args.tensor(b, f"adapters[{i}] B")
        if not isinstance(scaling, torch.Tensor):
            _args.number(scaling, f"adapters[{i}] scaling")
    requested = tier if tier is not None else forced_tier()
    if requested not in (None, "epilogue", "torch", "triton", "flashinfer"):
        raise ValueError(f"unknown tier {requested!r}; expected 'epilogue', 'torch' or None")
    tensors = [x, weight, bias] + [t for a, b, s in adapters for t in (a, b, s)]
    if needs_grad(*tensors):  # in-place epilogues are not what autograd should record
        if requested == "epilogue":
            raise ValueError(grad_refusal("epilogue"))
        requested = "torch"
    if requested is None and jit_tracing():
        requested = "torch"
    if requested == "torch":
        return _peft_order(x, weight, bias, adapters, gelu)
    return _epilogue(x, weight, bias, adapters, gelu)


def _peft_order(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                adapters: Sequence[Adapter], gelu: bool) -> torch.Tensor:
    """peft's ``Linear.forward`` (stock branch), then diffusers' ``GELU.gelu``: the reference."""
    result = F.linear(x, weight, bias)
    for a, b, scaling in adapters:
        result = result + F.linear(F.linear(x, a), b) * scaling
    return F.gelu(result, approximate="tanh") if gelu else result


def _epilogue(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              adapters: Sequence[Adapter], gelu: bool) -> torch.Tensor:
    result = F.linear(x, weight, bias)
    if not result.is_contiguous():  # the adapters accumulate into a [tokens, out] view of it
        result = result.contiguous()
    out2d = result.view(-1, result.shape[-1]) if result.dim() != 2 else result
    last = len(adapters) - 1
    for i, (a, b, scaling) in enumerate(adapters):
        t = F.linear(x, a)
        t2d = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
        alpha = _alpha(scaling, t2d)
        if alpha == 0:
            # peft's order: a GEMM with alpha=0 skips its product (MKL fp32, cuBLAS), dropping the NaN that
            # 0 * inf or 0 * NaN gives where lora_B's output is not finite (non-finite weights, fp16 overflow).
            result.add_(F.linear(t, b).mul_(alpha))
            continue
        if gelu and i == last and result.device.type == "cuda":
            # GELU in this GEMM's epilogue; on the CPU this op would be the erf GELU (see the module doc).
            torch._addmm_activation(out2d, t2d, b.t(), beta=1, alpha=alpha, use_gelu=True, out=out2d)
            return result
        out2d.addmm_(t2d, b.t(), beta=1, alpha=alpha)
    return F.gelu(result, approximate="tanh") if gelu else result


def prechecked(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], adapters: Sequence[Adapter],
               *, gelu: bool = False) -> torch.Tensor:
    """The epilogue tier without :func:`lora_linear`'s checks, for a caller that has made them: the ``lora``
    pattern (``patches/_lora_calls``), which serves a layer only with plain tensors of ``x``'s dtype and device, no
    gradient wanted and nothing traced or transformed. Wrong arguments are the caller's bug here."""
    return _epilogue(x, weight, bias, adapters, gelu)


def _alpha(scaling: Union[float, torch.Tensor], t2d: torch.Tensor) -> float:
    """The GEMM's ``alpha`` for ``scaling``; a scaling in a device tensor is applied to ``t2d`` instead (1.0)."""
    if not isinstance(scaling, torch.Tensor):
        return scaling
    if scaling.device.type == "cpu":
        return scaling.item()  # no device sync
    t2d.mul_(scaling)
    return 1.0
