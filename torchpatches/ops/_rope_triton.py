"""Triton RoPE kernel: q and k rotated in one launch, fp32 math, cos/sin loaded once per token.

Grid: axis 0 walks the B*S tokens, axis 1 walks head blocks of q followed by head blocks of k, so
one launch covers both tensors (GQA: different head counts) and every program reuses the cos/sin
row it loaded for BLOCK_H heads. Tensors arrive as 4-D ``[B, S, H, D]`` views (any strides, but
the last dim must be unit-stride so the loads vectorize; ``_rope_library.run_triton`` guarantees that).

Two cos/sin forms, one kernel (constexpr ``COS_HALF``):
- full form (diffusers): cos/sin rows hold ``rotary_dim`` values, one per element; an element and
  its partner may use different values, exactly as diffusers' ``x * cos + rotate(x) * sin``.
- half form (vLLM/FlashInfer ``cos_sin_cache``): rows hold ``rotary_dim // 2`` values, one per pair.

This module imports triton: import it only when the Triton tier is actually used.
"""
from __future__ import annotations

import functools
import math
import types
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from ._runtime.launch import launch as launch_kernel


def _rotate_heads(
    x_ptr, o_ptr, x_sh, o_sh, h0, H,
    ca, sa, cb, sb,
    R: tl.constexpr, D: tl.constexpr, HALF_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, COPY_TAIL: tl.constexpr, TAIL_BLOCK: tl.constexpr,
):
    # x_ptr / o_ptr already point at (b, s, head 0, dim 0) of this token.
    h = h0 + tl.arange(0, BLOCK_H)
    hmask = h < H
    h = h.to(tl.int64)  # h * head_stride can pass 2**31 for [B, H, S, D] inputs with long S
    ty = o_ptr.dtype.element_ty
    if INTERLEAVED:
        # Load the whole rotary span contiguously (vector loads), then split pairs in registers.
        j = tl.arange(0, 2 * HALF_BLOCK)
        m = hmask[:, None] & (j < R)[None, :]
        x = tl.load(x_ptr + h[:, None] * x_sh + j[None, :], mask=m, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(x, [BLOCK_H, HALF_BLOCK, 2]))
        oa = a * ca[None, :] - b * sa[None, :]
        ob = b * cb[None, :] + a * sb[None, :]
        out = tl.reshape(tl.join(oa, ob), [BLOCK_H, 2 * HALF_BLOCK])
        tl.store(o_ptr + h[:, None] * o_sh + j[None, :], out.to(ty), mask=m)
    else:
        # NeoX: the two halves are each contiguous.
        i = tl.arange(0, HALF_BLOCK)
        m = hmask[:, None] & (i < R // 2)[None, :]
        pa = x_ptr + h[:, None] * x_sh + i[None, :]
        a = tl.load(pa, mask=m, other=0.0).to(tl.float32)
        b = tl.load(pa + R // 2, mask=m, other=0.0).to(tl.float32)
        oa = a * ca[None, :] - b * sa[None, :]
        ob = b * cb[None, :] + a * sb[None, :]
        po = o_ptr + h[:, None] * o_sh + i[None, :]
        tl.store(po, oa.to(ty), mask=m)
        tl.store(po + R // 2, ob.to(ty), mask=m)
    if COPY_TAIL:
        # Out-of-place with rotary_dim < head_dim: the tail passes through unchanged.
        t = R + tl.arange(0, TAIL_BLOCK)
        mt = hmask[:, None] & (t < D)[None, :]
        xt = tl.load(x_ptr + h[:, None] * x_sh + t[None, :], mask=mt, other=0.0)
        tl.store(o_ptr + h[:, None] * o_sh + t[None, :], xt.to(ty), mask=mt)


def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
    S, HQ, HK, NHB_Q, NHB, HP,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,
    qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh,
    c_sr, c_sd, s_sr, s_sd, p_sb, p_ss, NROWS,
    R: tl.constexpr, D: tl.constexpr, HALF_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, COS_HALF: tl.constexpr,
    HAS_POS: tl.constexpr, COPY_TAIL: tl.constexpr, TAIL_BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    b = tok // S
    s = tok - b * S
    if HAS_POS:
        row = tl.load(pos_ptr + b * p_sb + s * p_ss).to(tl.int64)
        # A position outside the cache reads row 0 and rotates with NaN: never a read out of bounds.
        row_ok = (row >= 0) & (row < NROWS)
        row = tl.where(row_ok, row, 0)
    else:
        row = s
    # cos/sin for this token, loaded once and reused for every head this program handles.
    crow = cos_ptr + row * c_sr
    srow = sin_ptr + row * s_sr
    if COS_HALF:
        i = tl.arange(0, HALF_BLOCK)
        im = i < R // 2
        ca = tl.load(crow + i * c_sd, mask=im, other=0.0).to(tl.float32)
        sa = tl.load(srow + i * s_sd, mask=im, other=0.0).to(tl.float32)
        cb = ca
        sb = sa
    elif INTERLEAVED:
        j = tl.arange(0, 2 * HALF_BLOCK)
        jm = j < R
        cf = tl.load(crow + j * c_sd, mask=jm, other=0.0).to(tl.float32)
        sf = tl.load(srow + j * s_sd, mask=jm, other=0.0).to(tl.float32)
        ca, cb = tl.split(tl.reshape(cf, [HALF_BLOCK, 2]))
        sa, sb = tl.split(tl.reshape(sf, [HALF_BLOCK, 2]))
    else:
        i = tl.arange(0, HALF_BLOCK)
        im = i < R // 2
        ca = tl.load(crow + i * c_sd, mask=im, other=0.0).to(tl.float32)
        sa = tl.load(srow + i * s_sd, mask=im, other=0.0).to(tl.float32)
        cb = tl.load(crow + (i + R // 2) * c_sd, mask=im, other=0.0).to(tl.float32)
        sb = tl.load(srow + (i + R // 2) * s_sd, mask=im, other=0.0).to(tl.float32)
    if HAS_POS:
        ca = tl.where(row_ok, ca, float("nan"))
        sa = tl.where(row_ok, sa, float("nan"))
        cb = tl.where(row_ok, cb, float("nan"))
        sb = tl.where(row_ok, sb, float("nan"))
    # Head blocks of q then of k; program (tok, p) takes blocks p, p + HP, p + 2 HP, ...
    # (a constexpr trip count: the interpreter cannot loop over a program-id-valued range).
    hb0 = tl.program_id(1)
    for it in range(0, ITERS):
        hb = hb0 + it * HP
        if hb < NHB_Q:
            _rotate_heads(
                q_ptr + b * q_sb + s * q_ss, qo_ptr + b * qo_sb + s * qo_ss, q_sh, qo_sh,
                hb * BLOCK_H, HQ, ca, sa, cb, sb,
                R, D, HALF_BLOCK, BLOCK_H, INTERLEAVED, COPY_TAIL, TAIL_BLOCK,
            )
        elif hb < NHB:
            _rotate_heads(
                k_ptr + b * k_sb + s * k_ss, ko_ptr + b * ko_sb + s * ko_ss, k_sh, ko_sh,
                (hb - NHB_Q) * BLOCK_H, HK, ca, sa, cb, sb,
                R, D, HALF_BLOCK, BLOCK_H, INTERLEAVED, COPY_TAIL, TAIL_BLOCK,
            )


# Plain Python versions, kept for the interpreter.
_ROTATE_HEADS_PY = _rotate_heads
_ROPE_KERNEL_PY = _rope_kernel
# Compiled (GPU) versions. The kernel finds its helper by the global name ``_rotate_heads``, and
# Inductor (triton_op) re-emits the helper's source under that name: def name and global must agree.
_rotate_heads = triton.jit(_ROTATE_HEADS_PY)
_rope_kernel = triton.jit(_ROPE_KERNEL_PY)
rope_kernel = _rope_kernel


@functools.cache
def interpreted_kernel() -> Any:
    """The same kernel run by Triton's CPU interpreter, whatever TRITON_INTERPRET said at import.

    The interpreter cannot call a compiled ``@triton.jit`` helper, so the kernel is re-bound to a
    globals dict whose ``_rotate_heads`` is the interpreted helper.
    """
    from triton.runtime.interpreter import InterpretedFunction

    g = dict(_ROPE_KERNEL_PY.__globals__)
    g["_rotate_heads"] = InterpretedFunction(_ROTATE_HEADS_PY)
    fn = types.FunctionType(_ROPE_KERNEL_PY.__code__, g, _ROPE_KERNEL_PY.__name__)
    return InterpretedFunction(fn)


def kernel_for(device_type: str) -> Any:
    """The compiled kernel for CUDA, the interpreted one for CPU tensors."""
    return rope_kernel if device_type == "cuda" else interpreted_kernel()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: that is a @jit function, slow to call from Python


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pick_config(hq: int, hk: int, rotary_dim: int, interpreted: bool = False) -> dict[str, Any]:
    """Launch parameters ``{"BLOCK_H", "num_warps", "HEAD_PROGS"}``. BLOCK_H divides both head counts
    where possible, so no lanes idle."""
    if interpreted:
        # The interpreter pays Python overhead per program: one program per token is fastest.
        cfg = dict(BLOCK_H=_next_pow2(max(hq, hk)), num_warps=1, HEAD_PROGS=1)
    else:
        # Measured on an H200 (benchmarks/NOTES-rope.md): blocks of ~1024 elements (8 heads of
        # 128) with 2 warps, one program per head block, were fastest for FLUX and the LLM shape;
        # 4 or 8 warps on the same block were 15-35% slower.
        half_block = _next_pow2(rotary_dim // 2)
        g = math.gcd(hq, hk) if hk else hq
        block_h = g & -g  # largest power of two dividing both head counts: no idle lanes
        block_h = max(1, min(block_h, max(1, 1024 // (2 * half_block))))
        num_warps = 2 if block_h * 2 * half_block >= 512 else 1
        cfg = dict(BLOCK_H=block_h, num_warps=num_warps, HEAD_PROGS=0)
    return cfg


def launch(
    kernel: Any,
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    q_out: torch.Tensor,
    k_out: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor],
    *,
    interleaved: bool,
    cos_half: bool,
    rotary_dim: int,
    config: Optional[dict[str, Any]] = None,
) -> None:
    """Launch ``kernel`` (compiled, interpreted or ``wrap_triton``-wrapped) on 4-D [B,S,H,D] views.

    ``cos``/``sin`` are 2-D ``[rows, width]``; ``positions`` (if given) is 2-D ``[B or 1, S]``
    with stride 0 on a broadcast batch dim. ``q_out is q`` means in place. ``config``: launch
    parameters as :func:`pick_config` returns them (benchmarks sweep them); None picks them.
    """
    B, S, HQ, D = q.shape
    HK = k.shape[2] if k is not None else 0
    cfg = config if config is not None else pick_config(HQ, HK, rotary_dim, interpreted=q.device.type != "cuda")
    block_h = cfg["BLOCK_H"]
    nhb_q = _cdiv(HQ, block_h)
    nhb = nhb_q + (_cdiv(HK, block_h) if k is not None else 0)
    # HEAD_PROGS programs per token share its head blocks (0: one program per head block).
    head_progs = min(nhb, cfg["HEAD_PROGS"]) if cfg["HEAD_PROGS"] > 0 else nhb
    kk = k if k is not None else q  # unused pointer when there is no k: no program reads it
    ko = k_out if k_out is not None else q_out
    pos = positions if positions is not None else cos
    p_sb, p_ss = positions.stride() if positions is not None else (0, 0)
    q_st, k_st, qo_st, ko_st = q.stride(), kk.stride(), q_out.stride(), ko.stride()
    c_st, s_st = cos.stride(), sin.stride()
    copy_tail = (q_out is not q) and rotary_dim < D
    launch_kernel(kernel, (B * S, head_progs), (
        q, kk, q_out, ko, cos, sin, pos,
        S, HQ, HK, nhb_q, nhb, head_progs,
        q_st[0], q_st[1], q_st[2], k_st[0], k_st[1], k_st[2],
        qo_st[0], qo_st[1], qo_st[2], ko_st[0], ko_st[1], ko_st[2],
        c_st[0], c_st[1], s_st[0], s_st[1], p_sb, p_ss, cos.shape[0],
    ), dict(
        R=rotary_dim, D=D, HALF_BLOCK=_next_pow2(rotary_dim // 2), BLOCK_H=block_h,
        INTERLEAVED=interleaved, COS_HALF=cos_half, HAS_POS=positions is not None,
        COPY_TAIL=copy_tail, TAIL_BLOCK=_next_pow2(max(1, D - rotary_dim)),
        ITERS=_cdiv(nhb, head_progs), num_warps=cfg["num_warps"],
    ))
