"""Triton SwiGLU kernel: ``out = round(round(silu(gate)) * up)`` (SIGMOID: ``round(round(sigmoid(gate)) * up)``,
Krea 2's attention output gate), one pass.

diffusers' ``Flux2SwiGLU`` runs ``silu`` (fp32 math, rounded) and the product (rounded) as two
bf16 ops: three reads and two writes of ``[M, F]``; this reads each input once and writes ``out`` once,
rounding at the same two points. Two forms, one kernel: FLUX.2's ``x`` ``[M, 2F]`` (``gate = x[:, :F]``,
``up = x[:, F:]``: the kernel gets ``x`` twice, the second time with a column offset ``F``) and the
two-input form ``gate``, ``up`` ``[M, F]`` (Z-Image's ``F.silu(w1(x)) * w3(x)``: offset 0). All operands
have unit-stride columns and each its own row stride, so ``out`` may be a column slice of a larger buffer
(FLUX.2's single blocks write it straight into the attention-output/MLP concat) and the inputs slices of
one projection's output.

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl

from ._runtime.launch import launch as launch_kernel
from ._runtime.triton_common import KINDS, _exp, _round_to, cdiv, for_devices

def _swiglu_kernel(x_ptr, u_ptr, o_ptr, F, x_sr, u_sr, o_sr, u_off, BLOCK: tl.constexpr, KIND: tl.constexpr,
                   LIBDEVICE: tl.constexpr, SIGMOID: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < F
    a = tl.load(x_ptr + row * x_sr + c, mask=m, other=0.0).to(tl.float32)
    g = tl.load(u_ptr + row * u_sr + u_off + c, mask=m, other=0.0).to(tl.float32)
    if SIGMOID:  # torch's sigmoid: 1 / (1 + exp(-x))
        act = _round_to(1.0 / (1.0 + _exp(-a, LIBDEVICE)), KIND)
    else:
        act = _round_to(a / (1.0 + _exp(-a, LIBDEVICE)), KIND)  # torch's silu: x / (1 + exp(-x))
    out = _round_to(act * g, KIND)
    tl.store(o_ptr + row * o_sr + c, out.to(o_ptr.dtype.element_ty), mask=m)

kernel_for = for_devices(_swiglu_kernel)
_interpreted_kernel = kernel_for.interpreted  # the CPU interpreter's kernel (tests)

#: Columns per program at most.
_CAP = 1024


def launch(x: torch.Tensor, out: torch.Tensor, up: Optional[torch.Tensor] = None, sigmoid: bool = False) -> None:
    """``out`` 2-D ``[M, F]``; ``x`` 2-D ``[M, 2F]`` (the gate then the up half) or, with ``up``, ``x`` and ``up``
    2-D ``[M, F]``; all unit-stride columns, any row strides. ``sigmoid``: ``sigmoid(x) * up`` (GLU)."""
    M, N = out.shape
    if M * N == 0:
        return
    block = _CAP if N >= _CAP else max(16, 1 << (N - 1).bit_length())
    if up is None:
        args = (x, x, out, N, x.stride(0), x.stride(0), out.stride(0), N)
    else:
        args = (x, up, out, N, x.stride(0), up.stride(0), out.stride(0), 0)
    launch_kernel(kernel_for(x.device.type), (M, cdiv(N, block)), args,
                  dict(BLOCK=block, KIND=KINDS[out.dtype], LIBDEVICE=x.device.type == "cuda",
                       num_warps=4 if block >= 1024 else 2, SIGMOID=bool(sigmoid)))
