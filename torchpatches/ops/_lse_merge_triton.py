"""Triton kernel: merge two partial attention results by their log-sum-exps, one pass.

Rows are the ``R`` positions of ``lse`` (``[B, S, H]`` flattened), each with a ``D``-wide output row. A program
takes ``BLOCK_R`` rows as a ``[BLOCK_R, BLOCK_D]`` tile and computes, in fp32 as diffusers' ring attention
does with ``convert_to_fp32`` (each step one torch op there, rounded to fp32 before the next):

    s   = 1 / (1 + exp(-(lse_b - lse_a)))                         torch's sigmoid kernel
    out = out_a - round(s * (out_a - out_b))                       no fused multiply-add: torch rounds the product
    x   = lse_a - lse_b
    lse = lse_a - (min(0, x) - log1p(exp(-|x|)))                   torch's logsigmoid kernel

``out`` is rounded once to the output dtype (a cast, as ``out.to(query.dtype)``). On CUDA the quotient,
``exp`` and ``log1p`` are libdevice's ``__fdiv_rn``, ``expf`` and ``log1pf``, the functions torch's kernels call,
so the result is torch's bit for bit where no fp32 intermediate is subnormal (Triton links libdevice with
subnormals flushed to zero; ``lse_merge.py`` says where that shows); the CPU interpreter has numpy's (tests compare
it within a tolerance).

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._runtime.launch import launch as launch_kernel
from ._runtime.triton_common import KINDS, _div_rn, _exp, _log1p, _mul_rn, _round_to, cdiv, for_devices, next_pow2

#: Elements per program: 16 rows of a 128-wide head.
_TILE = 2048


def _lse_merge_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr, R, D,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr, LIBDEVICE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mr = r < R
    m = mr[:, None] & (d < D)[None, :]
    la = tl.load(la_ptr + r, mask=mr, other=0.0).to(tl.float32)
    lb = tl.load(lb_ptr + r, mask=mr, other=0.0).to(tl.float32)
    s = _div_rn(1.0, 1.0 + _exp(-(lb - la), LIBDEVICE), LIBDEVICE)
    x = la - lb
    log_sig = tl.minimum(x, 0.0) - _log1p(_exp(-tl.abs(x), LIBDEVICE), LIBDEVICE)
    tl.store(lse_ptr + r, la - log_sig, mask=mr)
    at = r[:, None] * D + d[None, :]
    oa = tl.load(oa_ptr + at, mask=m, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + at, mask=m, other=0.0).to(tl.float32)
    merged = oa - _mul_rn(tl.broadcast_to(s[:, None], (BLOCK_R, BLOCK_D)), oa - ob, LIBDEVICE)
    tl.store(out_ptr + at, _round_to(merged, KIND).to(out_ptr.dtype.element_ty), mask=m)


kernel_for = for_devices(_lse_merge_kernel)


def launch(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
           out: torch.Tensor, lse: torch.Tensor) -> None:
    """All contiguous; the outputs ``[R, D]`` / ``[R]`` flattened, ``lse`` fp32."""
    R, D = lse.numel(), out.shape[-1]
    if R == 0:  # with D == 0 the log-sum-exps are still merged
        return
    block_d = max(16, next_pow2(D))
    block_r = max(1, _TILE // block_d)
    launch_kernel(kernel_for(out.device.type), (cdiv(R, block_r),),
                  (out_a, lse_a, out_b, lse_b, out, lse, R, D),
                  dict(BLOCK_R=block_r, BLOCK_D=block_d, KIND=KINDS[out.dtype], LIBDEVICE=out.device.type == "cuda",
                       num_warps=4))
