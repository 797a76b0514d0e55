"""Triton SwiGLU kernel: ``out = round(round(silu(x[:, :F])) * x[:, F:])``, one pass.

diffusers' ``Flux2SwiGLU`` runs ``silu`` (fp32 math, rounded) and the product (rounded) as two
bf16 ops: three reads and two writes of ``[M, F]``; this reads ``x`` once and writes ``out`` once,
rounding at the same two points. ``x`` is ``[M, 2F]`` and ``out`` ``[M, F]``, both with unit-stride
columns and any row stride, so ``out`` may be a column slice of a larger buffer (FLUX.2's single
blocks write it straight into the attention-output/MLP concat).

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from ._triton_common import HELPERS_PY, KINDS, _exp, _round_to, cdiv, interpreted


def _swiglu_kernel(x_ptr, o_ptr, F, x_sr, o_sr, BLOCK: tl.constexpr, KIND: tl.constexpr,
                   LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < F
    a = tl.load(x_ptr + row * x_sr + c, mask=m, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + row * x_sr + F + c, mask=m, other=0.0).to(tl.float32)
    act = _round_to(a / (1.0 + _exp(-a, LIBDEVICE)), KIND)  # torch's silu: x / (1 + exp(-x))
    out = _round_to(act * g, KIND)
    tl.store(o_ptr + row * o_sr + c, out.to(o_ptr.dtype.element_ty), mask=m)


SWIGLU_KERNEL_PY = _swiglu_kernel
_swiglu_kernel = triton.jit(SWIGLU_KERNEL_PY)


@functools.lru_cache(maxsize=None)
def _interpreted_kernel() -> Any:
    return interpreted(SWIGLU_KERNEL_PY, HELPERS_PY)


def launch(x: torch.Tensor, out: torch.Tensor) -> None:
    """``x`` is 2-D ``[M, 2F]``, ``out`` 2-D ``[M, F]``; both unit-stride columns."""
    M, F = out.shape
    if M * F == 0:
        return
    block = 1024 if F >= 1024 else max(16, 1 << (F - 1).bit_length())
    kernel = _swiglu_kernel if x.device.type == "cuda" else _interpreted_kernel()
    kernel[(M, cdiv(F, block))](
        x, out, F, x.stride(0), out.stride(0), BLOCK=block, KIND=KINDS[x.dtype], LIBDEVICE=x.device.type == "cuda",
        num_warps=4 if block >= 1024 else 2,
    )
