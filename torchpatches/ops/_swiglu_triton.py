"""Triton SwiGLU kernel: ``out = round(round(silu(x[:, :F])) * x[:, F:])``, one pass.

diffusers' ``Flux2SwiGLU`` runs ``silu`` (fp32 math, rounded) and the product (rounded) as two
bf16 ops: three reads and two writes of ``[M, F]``; this reads ``x`` once and writes ``out`` once,
rounding at the same two points. ``x`` is ``[M, 2F]`` and ``out`` ``[M, F]``, both with unit-stride
columns and any row stride, so ``out`` may be a column slice of a larger buffer (FLUX.2's single
blocks write it straight into the attention-output/MLP concat).

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._runtime.triton_common import _exp, _round_to, for_devices, launch_rows

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

kernel_for = for_devices(_swiglu_kernel)
_interpreted_kernel = kernel_for.interpreted  # the CPU interpreter's kernel (tests)

def launch(x: torch.Tensor, out: torch.Tensor) -> None:
    """``x`` is 2-D ``[M, 2F]``, ``out`` 2-D ``[M, F]``; both unit-stride columns."""
    launch_rows(kernel_for, x, out, 1024)
