"""Triton row kernel: ``out[m, :] = act(x[m, :])`` for 2-D views with unit-stride columns and any row strides.

Used to write into a column slice of a larger buffer (the input of FLUX's single-block output
projection) without the concat's extra pass, where torch's own elementwise kernels fall back to their
slow strided path (measured on an H100: 46% of the copy rate for GELU into a slice, 177 us where
76 us is the floor). ACT 0 copies, ACT 1 is torch's tanh GELU in fp32, rounded once:

    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))

in torch's operation order with CUDA's ``tanhf`` (libdevice), so on the GPU it computes what torch
computes; the CPU interpreter has no libdevice and uses ``1 - 2 / (exp(2z) + 1)`` (absolute error
~1e-7, which the output sees through ``1 + tanh``).

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

import torch
import triton.language as tl
from triton.language.extra import libdevice

from ._runtime.triton_common import _round_to, for_devices, launch_rows

def _rows_kernel(x_ptr, o_ptr, N, x_sr, o_sr, BLOCK: tl.constexpr, ACT: tl.constexpr, KIND: tl.constexpr,
                 LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + row * x_sr + c, mask=m, other=0.0)
    if ACT == 1:
        xf = x.to(tl.float32)
        inner = 0.7978845608028654 * (xf + 0.044715 * (xf * xf * xf))
        if LIBDEVICE:  # CUDA: the same tanhf torch's GELU kernel calls
            t = libdevice.tanh(inner)
        else:  # the interpreter has no libdevice
            t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        y = _round_to(0.5 * xf * (1.0 + t), KIND)
        tl.store(o_ptr + row * o_sr + c, y.to(o_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(o_ptr + row * o_sr + c, x, mask=m)

kernel_for = for_devices(_rows_kernel)
_interpreted_kernel = kernel_for.interpreted  # the CPU interpreter's kernel (tests)

def launch(x: torch.Tensor, out: torch.Tensor, act: int) -> None:
    """``x``, ``out``: 2-D ``[M, N]`` with unit-stride columns; ``act`` 0 (copy) or 1 (tanh GELU)."""
    launch_rows(kernel_for, x, out, 2048, ACT=act)
