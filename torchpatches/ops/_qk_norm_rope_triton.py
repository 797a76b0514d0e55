"""Triton kernel: per-head RMSNorm of q and k, RoPE (interleaved or half-split), and the text+image concat, in
one launch.

Grid: axis 0 walks the ``B * (S_txt + S_img)`` output tokens, axis 1 walks head blocks of q, then
of k, then (joint attention) of v. A token below ``S_txt`` reads the text tensors (and the text norm
weights / eps), the others the image tensors, and every program writes its rows of the contiguous
``[B, S_txt + S_img, H, D]`` outputs: the concat costs no pass of its own. v blocks are a plain copy.

Per q/k head (fp32 math, rounding where diffusers rounds):

    n   = round(x * rsqrt(mean(x^2) + eps) * w)          torch.nn.RMSNorm (torch's fused kernel)
    n   = round(round(x * rsqrt(mean(x^2) + eps)) * w)   EACH: diffusers' RMSNorm (SD3's q/k norms)
    w   = round_w(1 + w)                                  ZERO_CENTERED: Krea 2's RMSNorm (``1 + weight`` in the
                                                          weight's dtype, W_KIND), then the first form
    n   = x * rsqrt(mean(x^2) + eps) * w                  CHAIN: FLUX.3, fp32 until after RoPE (w: any float)
    out = round(n * cos + rotate(n) * sin)               diffusers apply_rotary_emb, interleaved pairs
                                                         (ROPE false: out = n)
    out = round(round(n * cos) + round(rotate_half(n) * sin))
                                                         HALF_SPLIT: Ideogram 4's, pairs (j, j + D/2),
                                                         tables of the output dtype, each op rounded

Half-split pairs are not split out of the padded ``2 * HALF`` block (``D / 2`` need not be a power of two): each
program loads its row a second time at the partner column ``j +- D/2`` and normalizes it with the same ``rstd``,
bit for bit the partner's ``n``.

The "text" group is whichever group comes first in the output (the caller swaps the groups for SD3's
image-first order).

Inputs are 4-D ``[B, S, H, D]`` views with a unit-stride head dim; the image tensors share one set of
strides and the text tensors another (``ops/_qk_norm_rope.py`` guarantees both). The ``cos``/``sin``
tables (fp32, or the output dtype with HALF_SPLIT) are read at ``b * c_sb + s * c_sr + j`` (output row ``s`` of
sample ``b``, element ``j``): ``[S_tot, D]`` tables (and ``[1, S_tot, D]`` ones) get a batch stride of 0,
per-sample ``[B, S_tot, D]`` ones their own (0 too where expanded); unit-stride last dim.

GQA (``REP`` > 1, no text group): k has ``H / REP`` heads; output head ``h`` of k reads k's head ``h // REP``
(``repeat_interleave(REP, dim=2)`` after the rotation, as Krea 2's processor does it), so k's output has q's heads.
k is read with strides of its own (``k_sb, k_ss, k_sh``).

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl

from ._runtime.launch import launch as launch_kernel
from ._runtime.triton_common import KINDS, _mul_rn, _round_to, _rsqrt, _sum_combine, cdiv, for_devices, next_pow2


def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qt_ptr, kt_ptr, vt_ptr,
    wq_ptr, wk_ptr, wqt_ptr, wkt_ptr, cos_ptr, sin_ptr,
    qo_ptr, ko_ptr, vo_ptr,
    S_TXT, S_TOT, H, NHB, eps_q, eps_k, eps_qt, eps_kt,
    i_sb, i_ss, i_sh, t_sb, t_ss, t_sh, o_sb, o_ss, o_sh, c_sb, c_sr, s_sb, s_sr, k_sb, k_ss, k_sh, ko_sb,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, KIND: tl.constexpr, LIBDEVICE: tl.constexpr,
    ROPE: tl.constexpr, EACH: tl.constexpr, HALF_SPLIT: tl.constexpr, ZERO_CENTERED: tl.constexpr = False,
    W_KIND: tl.constexpr = 0, REP: tl.constexpr = 1, CHAIN: tl.constexpr = False,
):
    tok = tl.program_id(0).to(tl.int64)
    b = tok // S_TOT
    s = tok - b * S_TOT
    p = tl.program_id(1)
    which = p // NHB  # 0: q, 1: k, 2: v
    h = (p - which * NHB) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    h = h.to(tl.int64)
    j = tl.arange(0, 2 * HALF)
    m = hm[:, None] & (j < D)[None, :]
    ty = qo_ptr.dtype.element_ty
    # Source of this token: the first group's rows (text, as torch.cat([txt, img], dim=1)), then the second's.
    if s < S_TXT:
        row = b * t_sb + s * t_ss + h * t_sh
        if which == 0:
            x_ptr = qt_ptr
            w_ptr = wqt_ptr
            eps = eps_qt
        elif which == 1:
            x_ptr = kt_ptr
            w_ptr = wkt_ptr
            eps = eps_kt
        else:
            x_ptr = vt_ptr
            w_ptr = wqt_ptr
            eps = eps_qt
    else:
        row = b * i_sb + (s - S_TXT) * i_ss + h * i_sh
        if which == 0:
            x_ptr = q_ptr
            w_ptr = wq_ptr
            eps = eps_q
        elif which == 1:
            x_ptr = k_ptr
            w_ptr = wk_ptr
            eps = eps_k
            row = b * k_sb + (s - S_TXT) * k_ss + (h // REP) * k_sh  # GQA: k's head h // REP
        else:
            x_ptr = v_ptr
            w_ptr = wq_ptr
            eps = eps_q
    src = row[:, None] + j[None, :]
    # k's output may be the rows of a longer buffer behind a prefix (its own batch stride; others as q's)
    dst = b * tl.where(which == 1, ko_sb, o_sb) + s * o_ss + h[:, None] * o_sh + j[None, :]
    if which == 2:
        xv = tl.load(x_ptr + src, mask=m, other=0.0)
        tl.store(vo_ptr + dst, xv, mask=m)
    else:
        x = tl.load(x_ptr + src, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + j, mask=j < D, other=0.0).to(tl.float32)
        if ZERO_CENTERED:  # Krea 2: weight + 1.0, in the weight's dtype
            w = _round_to(w + 1.0, W_KIND)
        rstd = _rsqrt(tl.reduce(x * x, 1, _sum_combine) / D + eps, LIBDEVICE)
        if EACH:
            n = _round_to(_round_to(x * rstd[:, None], KIND) * w[None, :], KIND)
        elif CHAIN:  # FLUX.3: the fp32 norm goes into RoPE unrounded (diffusers casts after RoPE)
            n = (x * rstd[:, None]) * w[None, :]
        else:
            n = _round_to((x * rstd[:, None]) * w[None, :], KIND)
        if ROPE and HALF_SPLIT:
            # Ideogram 4: rotate_half(n)[j] = -n[j + D/2] (j < D/2), n[j - D/2] (j >= D/2); the partner's n from
            # a second load of the row (same rstd, same roundings). Tables of the output dtype: exact in fp32.
            # Each product and the sum rounded on its own, as torch's ops in that dtype; _mul_rn keeps fp32
            # (KIND 0, no rounding between) from contracting a product and the add into a fused multiply-add.
            lo = j < D // 2
            pj = tl.where(lo, j + D // 2, j - D // 2)
            xp = tl.load(x_ptr + row[:, None] + pj[None, :], mask=m, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + pj, mask=j < D, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                wp = _round_to(wp + 1.0, W_KIND)
            if EACH:
                npart = _round_to(_round_to(xp * rstd[:, None], KIND) * wp[None, :], KIND)
            else:
                npart = _round_to((xp * rstd[:, None]) * wp[None, :], KIND)
            rot = tl.where(lo[None, :], -npart, npart)
            cs = tl.load(cos_ptr + b * c_sb + s * c_sr + j, mask=j < D, other=0.0).to(tl.float32)
            sn = tl.load(sin_ptr + b * s_sb + s * s_sr + j, mask=j < D, other=0.0).to(tl.float32)
            out = _round_to(_round_to(_mul_rn(n, cs[None, :], LIBDEVICE), KIND)
                            + _round_to(_mul_rn(rot, sn[None, :], LIBDEVICE), KIND), KIND)
        elif ROPE:
            # Interleaved pairs (a, b) = (n[2i], n[2i+1]); rotate(n) = (-b, a); per-element cos/sin rows
            # (batch stride 0: one table for every sample).
            cs = tl.load(cos_ptr + b * c_sb + s * c_sr + j, mask=j < D, other=0.0).to(tl.float32)
            sn = tl.load(sin_ptr + b * s_sb + s * s_sr + j, mask=j < D, other=0.0).to(tl.float32)
            ca, cb = tl.split(tl.reshape(cs, [HALF, 2]))
            sa, sb = tl.split(tl.reshape(sn, [HALF, 2]))
            a, bb = tl.split(tl.reshape(n, [BLOCK_H, HALF, 2]))
            oa = a * ca[None, :] - bb * sa[None, :]
            ob = bb * cb[None, :] + a * sb[None, :]
            out = _round_to(tl.reshape(tl.join(oa, ob), [BLOCK_H, 2 * HALF]), KIND)
        else:
            out = n
        if which == 0:
            tl.store(qo_ptr + dst, out.to(ty), mask=m)
        else:
            tl.store(ko_ptr + dst, out.to(ty), mask=m)


kernel_for = for_devices(_qk_norm_rope_kernel)
_interpreted_kernel = kernel_for.interpreted  # the CPU interpreter's kernel (tests)


def _table_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch stride, row stride) of a ``[S, D]`` or ``[B or 1, S, D]`` table: 0 for the batch of a shared one."""
    if t.dim() == 2:
        return 0, t.stride(0)
    return (t.stride(0) if t.shape[0] != 1 else 0), t.stride(1)


def launch(
    q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
    qt: Optional[torch.Tensor], kt: Optional[torch.Tensor], vt: Optional[torch.Tensor],
    wq: torch.Tensor, wk: Optional[torch.Tensor], wqt: Optional[torch.Tensor], wkt: Optional[torch.Tensor],
    eps: tuple[float, float, float, float],
    cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
    q_out: torch.Tensor, k_out: Optional[torch.Tensor], v_out: Optional[torch.Tensor], each: bool = False,
    half_split: bool = False, zero_centered: bool = False, k_repeat: int = 1, chain: bool = False,
) -> None:
    """Image tensors ``[B, S_img, H, D]``, text ``[B, S_txt, H, D]`` (or None), outputs contiguous ``[B, S, H, D]``
    (k's may be the last rows of a longer contiguous buffer: its batch stride is read).
    ``cos``/``sin``: ``[S, D]`` or ``[B or 1, S, D]`` (unit-stride last dim), or None: no RoPE; ``each``: diffusers'
    RMSNorm rounding, ``half_split``: Ideogram 4's half-split RoPE, tables of the output dtype (see the module
    docstring); ``zero_centered``: Krea 2's ``1 + weight``; ``k_repeat``: GQA, k with ``H / k_repeat`` heads (no
    text tensors), written repeated; ``chain``: FLUX.3's fp32 chain. ``k`` None (with ``wk`` and ``k_out``): q
    alone, axis 1 walks its head blocks only."""
    B, S_img, H, D = q.shape
    S_txt = qt.shape[1] if qt is not None else 0
    S_tot = S_txt + S_img
    if B * S_tot == 0:
        return
    half = next_pow2(D) // 2  # = next_pow2(D // 2) for even D; an odd D (no RoPE) fits in 2 * half
    rope = cos is not None
    # ~1024 elements per program with 2 warps: the RoPE kernel's measured best (benchmarks/NOTES-rope.md).
    block_h = max(1, min(next_pow2(H), 1024 // (2 * half)))
    nhb = cdiv(H, block_h)
    tensors = 3 if v_out is not None else (2 if k is not None else 1)  # k None: q alone (axis 1 walks q's heads)
    k, wk, k_out = (k, wk, k_out) if k is not None else (q, wq, q_out)
    txt = qt if qt is not None else q
    kernel = kernel_for(q.device.type)
    launch_kernel(kernel, (B * S_tot, tensors * nhb), (
        q, k, v if v is not None else q, txt, kt if kt is not None else k, vt if vt is not None else txt,
        wq, wk, wqt if wqt is not None else wq, wkt if wkt is not None else wk,
        cos if rope else wq, sin if rope else wq,
        q_out, k_out, v_out if v_out is not None else q_out,
        S_txt, S_tot, H, nhb, *[float(e) for e in eps],
        q.stride(0), q.stride(1), q.stride(2), txt.stride(0), txt.stride(1), txt.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        *(_table_strides(cos) if rope else (0, 0)), *(_table_strides(sin) if rope else (0, 0)),
        k.stride(0), k.stride(1), k.stride(2), (k_out if k_out is not None else q_out).stride(0),
    ), dict(
        D=D, HALF=half, BLOCK_H=block_h, KIND=KINDS[q.dtype], LIBDEVICE=q.device.type == "cuda",
        ROPE=rope, EACH=bool(each), HALF_SPLIT=bool(half_split) and rope, ZERO_CENTERED=bool(zero_centered),
        W_KIND=KINDS[wq.dtype] if zero_centered else 0, REP=int(k_repeat), CHAIN=bool(chain),
        num_warps=2 if block_h * 2 * half >= 512 else 1,
    ))
