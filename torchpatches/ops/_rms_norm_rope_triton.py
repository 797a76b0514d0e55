"""Triton kernel: RMSNorm over the full width of q and k rows (across heads), then Wan's RoPE per head.

Grid: one program per token row, q's ``B * S_q`` rows first, then k's ``B * S_k``. A row is read once as a
``[BLOCK_H, BLOCK_D]`` tile (heads x head dim; without RoPE one "head" of the full width), normalized and
rotated in registers, and written to the contiguous output:

    n   = round(x * rsqrt(mean(x^2 over W) + eps) * w)          torch.nn.RMSNorm(W) (torch's fused kernel)
    out = round(a * cos[2i] - b * sin[2i+1]), round(a * sin[2i+1] + b * cos[2i])   Wan's RoPE, (a, b) = n[2i:2i+2]

``launch_split``: LTX-2's split RoPE, per-head fp32 tables ``[B, H, S, D/2]``, q's and k's of their own; a row is
read as two ``[BLOCK_H, BLOCK_R]`` tiles (each head's halves ``a = n[j]``, ``b = n[j + D/2]``):

    out = round(a * cos[j] - b * sin[j]), round(b * cos[j] + a * sin[j])

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl

from ._runtime.launch import launch as launch_kernel
from ._runtime.triton_common import KINDS, _mul_rn, _round_to, _rsqrt, _sum_combine, for_devices, next_pow2


def _rms_norm_rope_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    MQ, SQ, SK, H, eps_q, eps_k, q_sb, q_ss, k_sb, k_ss, c_ss, c_sd, s_ss, s_sd,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr, KIND: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (hh < H)[:, None] & (d < D)[None, :]
    col = hh[:, None] * D + d[None, :]
    ty = qo_ptr.dtype.element_ty
    # q rows first, then k rows; each with its own tokens per sample, strides, weight and eps.
    if p < MQ:
        b = p // SQ
        s = p - b * SQ
        src = q_ptr + b * q_sb + s * q_ss
        w_ptr = wq_ptr
        eps = eps_q
        dst = qo_ptr + p * H * D
    else:
        r = p - MQ
        b = r // SK
        s = r - b * SK
        src = k_ptr + b * k_sb + s * k_ss
        w_ptr = wk_ptr
        eps = eps_k
        dst = ko_ptr + r * H * D
    x = tl.load(src + col, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + col, mask=m, other=0.0).to(tl.float32)
    ss = tl.reduce(tl.reduce(x * x, 1, _sum_combine), 0, _sum_combine)
    rstd = _rsqrt(ss / (H * D) + eps, LIBDEVICE)
    n = _round_to(x * rstd * w, KIND)
    if ROPE:
        dm = d < D
        cs = tl.load(cos_ptr + s * c_ss + d * c_sd, mask=dm, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + s * s_ss + d * s_sd, mask=dm, other=0.0).to(tl.float32)
        ce, co = tl.split(tl.reshape(cs, [BLOCK_D // 2, 2]))  # Wan reads cos[2i] ...
        se, so = tl.split(tl.reshape(sn, [BLOCK_D // 2, 2]))  # ... and sin[2i + 1]
        a, bb = tl.split(tl.reshape(n, [BLOCK_H, BLOCK_D // 2, 2]))
        # Products rounded before the add, as Wan's fp32 ops (no fused multiply-add).
        oa = _mul_rn(a, ce[None, :], LIBDEVICE) - _mul_rn(bb, so[None, :], LIBDEVICE)
        ob = _mul_rn(a, so[None, :], LIBDEVICE) + _mul_rn(bb, ce[None, :], LIBDEVICE)
        n = _round_to(tl.reshape(tl.join(oa, ob), [BLOCK_H, BLOCK_D]), KIND)
    tl.store(dst + col, n.to(ty), mask=m)


kernel_for = for_devices(_rms_norm_rope_kernel)
_interpreted_kernel = kernel_for.interpreted  # the CPU interpreter's kernel (tests)


def _rms_norm_split_rope_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, qc_ptr, qs_ptr, kc_ptr, ks_ptr, qo_ptr, ko_ptr,
    MQ, SQ, SK, H, R, eps_q, eps_k, q_sb, q_ss, k_sb, k_ss,
    qc_sb, qc_sh, qc_ss, qs_sb, qs_sh, qs_ss, kc_sb, kc_sh, kc_ss, ks_sb, ks_sh, ks_ss,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, KIND: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    m = (hh < H)[:, None] & (j < R)[None, :]
    first = hh[:, None] * (2 * R) + j[None, :]  # a = n[h, j]; b = n[h, j + R]
    ty = qo_ptr.dtype.element_ty
    if p < MQ:  # q rows first, then k rows; each with its own tokens, strides, weight, eps and tables
        b = p // SQ
        s = p - b * SQ
        src = q_ptr + b * q_sb + s * q_ss
        w_ptr = wq_ptr
        eps = eps_q
        dst = qo_ptr + p * H * 2 * R
        c_ptr = qc_ptr + b * qc_sb + s * qc_ss + hh[:, None] * qc_sh + j[None, :]
        n_ptr = qs_ptr + b * qs_sb + s * qs_ss + hh[:, None] * qs_sh + j[None, :]
    else:
        r = p - MQ
        b = r // SK
        s = r - b * SK
        src = k_ptr + b * k_sb + s * k_ss
        w_ptr = wk_ptr
        eps = eps_k
        dst = ko_ptr + r * H * 2 * R
        c_ptr = kc_ptr + b * kc_sb + s * kc_ss + hh[:, None] * kc_sh + j[None, :]
        n_ptr = ks_ptr + b * ks_sb + s * ks_ss + hh[:, None] * ks_sh + j[None, :]
    xa = tl.load(src + first, mask=m, other=0.0).to(tl.float32)
    xb = tl.load(src + first + R, mask=m, other=0.0).to(tl.float32)
    wa = tl.load(w_ptr + first, mask=m, other=0.0).to(tl.float32)
    wb = tl.load(w_ptr + first + R, mask=m, other=0.0).to(tl.float32)
    ss = tl.reduce(tl.reduce(xa * xa + xb * xb, 1, _sum_combine), 0, _sum_combine)
    rstd = _rsqrt(ss / (H * 2 * R) + eps, LIBDEVICE)
    a = _round_to(xa * rstd * wa, KIND)  # torch.nn.RMSNorm(W): one rounding
    bb = _round_to(xb * rstd * wb, KIND)
    cs = tl.load(c_ptr, mask=m, other=0.0)
    sn = tl.load(n_ptr, mask=m, other=0.0)
    # diffusers: out = x * cos; out[:r].addcmul_(-sin, x[r:]); out[r:].addcmul_(sin, x[:r]): products rounded first
    oa = _mul_rn(a, cs, LIBDEVICE) - _mul_rn(sn, bb, LIBDEVICE)
    ob = _mul_rn(bb, cs, LIBDEVICE) + _mul_rn(sn, a, LIBDEVICE)
    tl.store(dst + first, _round_to(oa, KIND).to(ty), mask=m)
    tl.store(dst + first + R, _round_to(ob, KIND).to(ty), mask=m)


split_kernel_for = for_devices(_rms_norm_split_rope_kernel)

def pick_num_warps(elements: int, interpreted: bool) -> int:
    """One warp per 1024 elements of the row tile (8 for Wan2.1-14B's 5120-wide rows), at most 16. Looked up per
    launch: a benchmark sweeping it binds its own function here (``benchmarks/_bench.launch_config``)."""
    if interpreted:
        return 1
    return max(1, min(16, elements // 1024))


def launch(
    q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: tuple[float, float],
    cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], q_out: torch.Tensor, k_out: torch.Tensor,
) -> None:
    """``q`` ``[B, S_q, W]``, ``k`` ``[B, S_k, W]`` with unit-stride rows; outputs contiguous, same shapes."""
    B, SQ, W = q.shape
    SK = k.shape[1]
    rows = B * (SQ + SK)
    if rows == 0 or W == 0:
        return
    rope = cos is not None
    D = cos.shape[-1] if rope else W
    H = W // D
    block_d = max(2, next_pow2(D))
    block_h = next_pow2(H)
    elements = block_h * block_d
    interpreted = q.device.type != "cuda"
    kernel = kernel_for(q.device.type)
    launch_kernel(kernel, (rows,), (
        q, k, wq, wk, cos if rope else wq, sin if rope else wq, q_out, k_out,
        B * SQ, max(SQ, 1), max(SK, 1), H, float(eps[0]), float(eps[1]),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0) if rope else 0, cos.stride(1) if rope else 0,
        sin.stride(0) if rope else 0, sin.stride(1) if rope else 0,
    ), dict(
        D=D, BLOCK_H=block_h, BLOCK_D=block_d, ROPE=rope, KIND=KINDS[q.dtype], LIBDEVICE=not interpreted,
        num_warps=pick_num_warps(elements, interpreted),
    ))


def launch_split(
    q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: tuple[float, float],
    q_tables: tuple, k_tables: tuple, q_out: torch.Tensor, k_out: torch.Tensor,
) -> None:
    """``q`` ``[B, S_q, W]``, ``k`` ``[B, S_k, W]`` with unit-stride rows; ``q_tables``/``k_tables`` fp32
    ``(cos, sin)`` ``[B, H, S, D/2]`` with unit-stride last dims; outputs contiguous, same shapes."""
    B, SQ, W = q.shape
    SK = k.shape[1]
    rows = B * (SQ + SK)
    if rows == 0 or W == 0:
        return
    H, R = q_tables[0].shape[1], q_tables[0].shape[3]
    block_h, block_r = next_pow2(H), next_pow2(R)
    interpreted = q.device.type != "cuda"
    strides = [st for t in (*q_tables, *k_tables) for st in (t.stride(0), t.stride(1), t.stride(2))]
    launch_kernel(split_kernel_for(q.device.type), (rows,), (
        q, k, wq, wk, *q_tables, *k_tables, q_out, k_out,
        B * SQ, max(SQ, 1), max(SK, 1), H, R, float(eps[0]), float(eps[1]),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *strides,
    ), dict(
        BLOCK_H=block_h, BLOCK_R=block_r, KIND=KINDS[q.dtype], LIBDEVICE=not interpreted,
        num_warps=pick_num_warps(2 * block_h * block_r, interpreted),
    ))
