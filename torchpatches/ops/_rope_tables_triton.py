"""Triton kernel of ``ops.rope_tables``: FLUX's rotary cos / sin tables in one launch.

For row ``s`` and half-column ``j`` (axis ``axis_of[j]``, frequency ``freqs[j]``, both precomputed by
``ops/_rope_tables.py`` with diffusers' own ops), the kernel computes what ``get_1d_rotary_pos_embed`` does with
``torch.outer`` and ``repeat_interleave``: ``angle = float64(float32(ids[s, axis])) * freqs[j]`` (one fp64
rounding), ``cos(angle)`` and ``sin(angle)`` in fp64, each rounded once to fp32 and written to columns ``2j`` and
``2j + 1``. Compiled kernels call libdevice's ``cos`` / ``sin`` (the CUDA math library torch's fp64 kernels
use); the CPU interpreter has no libdevice and takes numpy's.

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

import torch
import triton.language as tl
from triton.language.extra import libdevice

from ._runtime.triton_common import for_devices, launch_kernel, next_pow2


def _rope_tables_kernel(ids_ptr, freqs_ptr, axis_ptr, cos_ptr, sin_ptr, S, HALF, ids_ss, ids_sa,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    s = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK)
    rm = s < S
    cm = j < HALF
    m = rm[:, None] & cm[None, :]
    freq = tl.load(freqs_ptr + j, mask=cm, other=0.0)
    axis = tl.load(axis_ptr + j, mask=cm, other=0)
    pos = tl.load(ids_ptr + s.to(tl.int64)[:, None] * ids_ss + axis[None, :] * ids_sa, mask=m, other=0.0)
    angle = pos.to(tl.float32).to(tl.float64) * freq[None, :]  # diffusers: ids.float(), then torch.outer in fp64
    if LIBDEVICE:
        c = libdevice.cos(angle).to(tl.float32)
        sn = libdevice.sin(angle).to(tl.float32)
    else:
        c = tl.cos(angle).to(tl.float32)
        sn = tl.sin(angle).to(tl.float32)
    base = s.to(tl.int64)[:, None] * (2 * HALF) + 2 * j[None, :]
    tl.store(cos_ptr + base, c, mask=m)
    tl.store(cos_ptr + base + 1, c, mask=m)
    tl.store(sin_ptr + base, sn, mask=m)
    tl.store(sin_ptr + base + 1, sn, mask=m)


kernel_for = for_devices(_rope_tables_kernel)
_interpreted_kernel = kernel_for.interpreted  # the CPU interpreter's kernel (tests)


def launch(ids: torch.Tensor, freqs: torch.Tensor, axis_of: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> None:
    """``ids`` ``[S, A]`` (any float dtype and strides), ``freqs`` fp64 ``[HALF]`` and ``axis_of`` int32
    ``[HALF]`` contiguous on ids' device, ``cos`` / ``sin`` fp32 contiguous ``[S, 2 * HALF]``."""
    S, half = ids.shape[0], freqs.shape[0]
    if S == 0 or half == 0:
        return
    block = next_pow2(half)
    cuda = ids.device.type == "cuda"
    rows = max(1, min(64, 4096 // block))  # the interpreter too: numpy runs a program's block at once
    launch_kernel(kernel_for(ids.device.type), (-(-S // rows),),
                  (ids, freqs, axis_of, cos, sin, S, half, ids.stride(0), ids.stride(1)),
                  dict(ROWS=rows, BLOCK=block, LIBDEVICE=cuda, num_warps=4))
