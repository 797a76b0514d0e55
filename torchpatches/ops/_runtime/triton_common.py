"""Helpers shared by the fused ops' Triton kernels: exact rounding and CPU-interpreter binding.

``_round_to(x, KIND)`` rounds an fp32 value to bf16 (KIND 1) or fp16 (KIND 2) and returns it as
fp32, so a kernel can round exactly where diffusers' eager code rounds (after every bf16 op) and go
on computing. Two implementations, one rounding (to nearest, ties to even): compiled kernels cast
(``cvt.rn.bf16.f32``, one instruction); the CPU interpreter's kernels round bf16 by integer
arithmetic, because the interpreter casts fp32 -> bf16 by truncation, which would make CI disagree
with the GPU. The integer form costs ~8 integer instructions per rounding; with four roundings per
element it made the LayerNorm + modulate kernel compute-bound on an H100.

``interpreted(kernel_py, helpers)`` builds the interpreter version of a kernel whatever
``TRITON_INTERPRET`` said when triton was imported: the interpreter cannot call a compiled
``@triton.jit`` helper, so the kernel is re-bound to globals whose helpers are interpreted too.

This module imports triton.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Dict

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.jit import JITFunction

from .launch import launch as launch_kernel

#: KIND codes of the output dtype (a constexpr of every kernel).
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _round_to(x, KIND: tl.constexpr):  # the interpreter's: bf16 by integer arithmetic
    if KIND == 1:
        u = x.to(tl.uint32, bitcast=True)
        r = u + 0x7FFF + ((u >> 16) & 1)  # round half to even on the 16 bits that bf16 drops
        r = (r >> 16) << 16
        return tl.where(x != x, x, r.to(tl.float32, bitcast=True))  # NaN stays NaN
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


ROUND_TO_PY = _round_to


def _round_to(x, KIND: tl.constexpr):  # compiled kernels': a cast rounds to nearest even (triton's default)
    if KIND == 1:
        return x.to(tl.bfloat16).to(tl.float32)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


ROUND_TO_COMPILED = _round_to


def _rsqrt(x, LIBDEVICE: tl.constexpr):
    # CUDA: the rsqrtf torch's LayerNorm / RMSNorm kernels call; the interpreter has no libdevice.
    if LIBDEVICE:
        return libdevice.rsqrt(x)
    else:
        return 1.0 / tl.sqrt(x)


def _exp(x, LIBDEVICE: tl.constexpr):
    # CUDA: expf, as torch's silu kernel (tl.exp is the faster, less exact ex2.approx).
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


def _mul_rn(x, y, LIBDEVICE: tl.constexpr):
    # CUDA: __fmul_rn, a product rounded to fp32 that the compiler never contracts with a following add into a
    # fused multiply-add: where torch rounds ``a * b`` before ``+ c`` (Wan's fp32 modulation, residuals, RoPE).
    if LIBDEVICE:
        return libdevice.mul_rn(x, y)
    else:
        return x * y


def _div_rn(x, y, LIBDEVICE: tl.constexpr):
    # CUDA: __fdiv_rn, the IEEE quotient torch's kernels compute with ``/`` (triton's own fp32 ``/`` is
    # div.full.f32, within 2 ulp).
    if LIBDEVICE:
        return libdevice.div_rn(x, y)
    else:
        return x / y


def _log1p(x, LIBDEVICE: tl.constexpr):
    # CUDA: log1pf, as torch's logsigmoid kernel; the interpreter has no libdevice.
    if LIBDEVICE:
        return libdevice.log1p(x)
    else:
        return tl.log(1.0 + x)


RSQRT_PY = _rsqrt
EXP_PY = _exp
MUL_RN_PY = _mul_rn
DIV_RN_PY = _div_rn
LOG1P_PY = _log1p
#: Every helper by its global name, for ``interpreted`` (the interpreter's own rounding).
HELPERS_PY = {"_round_to": ROUND_TO_PY, "_rsqrt": _rsqrt, "_exp": _exp, "_mul_rn": _mul_rn, "_div_rn": _div_rn,
              "_log1p": _log1p}

#: The combine function of ``tl.sum``. Kernels reduce with ``tl.reduce(x, axis, _sum_combine)``: the
#: interpreter recognises it (a numpy sum), whereas ``tl.sum`` itself is a compiled ``@jit`` function
#: that the interpreter cannot call unless TRITON_INTERPRET=1 was set before triton was imported.
_sum_combine = tl.standard._sum_combine
# Kernels call the helper by the global name ``_round_to``: def name and global must agree.
_round_to = triton.jit(ROUND_TO_COMPILED)
_rsqrt = triton.jit(RSQRT_PY)
_exp = triton.jit(EXP_PY)
_mul_rn = triton.jit(MUL_RN_PY)
_div_rn = triton.jit(DIV_RN_PY)
_log1p = triton.jit(LOG1P_PY)


def interpreted(kernel_py: Any, helpers: Dict[str, Any]) -> Any:
    """The interpreter version of ``kernel_py`` with each global ``name`` in ``helpers`` interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    g = dict(kernel_py.__globals__)
    for name, helper_py in helpers.items():
        g[name] = InterpretedFunction(helper_py)
    fn = types.FunctionType(kernel_py.__code__, g, kernel_py.__name__)
    return InterpretedFunction(fn)


def for_devices(kernel_py: Any) -> Callable[[str], Any]:
    """``kernel_for(device_type)``: ``kernel_py`` compiled by Triton on CUDA, interpreted elsewhere (built on
    first use, with the helpers interpreted too)."""
    compiled = triton.jit(kernel_py)
    interpreter = functools.lru_cache(maxsize=None)(lambda: interpreted(kernel_py, HELPERS_PY))
    # TRITON_INTERPRET=1 at triton's import makes triton.jit interpret: CUDA tensors then take the
    # interpreter's helpers too (its casts truncate).
    interpret_all = not isinstance(compiled, JITFunction)

    def kernel_for(device_type: str) -> Any:
        return compiled if device_type == "cuda" and not interpret_all else interpreter()

    kernel_for.interpreted = interpreter  # type: ignore[attr-defined]
    return kernel_for


def launch_rows(kernel_for: Callable[[str], Any], x: torch.Tensor, out: torch.Tensor, cap: int, **meta: Any) -> None:
    """Launch a row kernel ``(x, out, N, x_row_stride, out_row_stride, BLOCK, KIND, LIBDEVICE, **meta)`` over a
    2-D ``out`` ``[M, N]``: one program per row and block of at most ``cap`` columns."""
    M, N = out.shape
    if M * N == 0:
        return
    block = cap if N >= cap else max(16, 1 << (N - 1).bit_length())
    kernel = kernel_for(x.device.type)
    launch_kernel(kernel, (M, cdiv(N, block)), (x, out, N, x.stride(0), out.stride(0)),
                  dict(BLOCK=block, KIND=KINDS[out.dtype], LIBDEVICE=x.device.type == "cuda",
                       num_warps=4 if block >= 1024 else 2, **meta))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: that is a @jit function, slow to call from Python
