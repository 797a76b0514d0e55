"""Triton kernel for the adaLN family: gate + residual, LayerNorm + modulate, or both in one pass.

ROWS token rows per program (``[B, S, D]`` views, last dim unit-stride, any row strides):

    h   = round(residual + round(gate * y))            (HAS_GATE; fp16: clipped to +-65504 if CLIP)
    h   = round(residual + y)                          (PLAIN: a residual add without gate, Wan's cross-attn)
    y   = round(y + y2)                                (HAS_Y2, before either: FLUX.3's attn_output + ff_output)
    out = round(round(round(LN(h)) * round(1 + scale)) + shift)   (HAS_NORM; LN without affine)
    out = round(LN(h) * weight + bias)                 (HAS_NORM and AFFINE: an affine LayerNorm, one rounding)
    out = round(round(round(h * rstd * w1) * round(1 + scale)) + shift)   (HAS_NORM and RMS: Krea 2's zero-centered
          RMSNorm in place of LN, rstd = rsqrt(mean(h^2) + eps), w1 = 1 + weight rounded to the weight's dtype)
    out = round(round(round(h * rstd) * round(1 + scale)) + shift)   (HAS_NORM, RMS, no NW: diffusers' weightless
          RMSNorm, LTX-2's)

``round`` is a rounding to the tensors' dtype at exactly the points where diffusers' eager code
rounds (each bf16/fp16 op rounds its fp32 result), so outputs match diffusers bit for bit except
where the LayerNorm statistics (fp32, another summation order) differ in their last bit. With
``MID`` = 0 (rounding once, Wan's ``.type_as``) only the stored results are rounded; the vectors may be of any float dtype.
``gate``, ``scale`` and ``shift`` are ``[B, S or 1, D]`` views (stride 0 over S when shared); with ``TWO_TERM`` each
is the sum of two such views, never materialized: fp32 with ``MID`` = 0 (Wan 2.2 TI2V's ``scale_shift_table +
temb.float()``), rounded to the dtype otherwise (Krea 2's ``temb + scale_shift_table`` in bf16). With ``SELECT`` the
vectors are ``[B + 1, D]`` rows and token ``s`` of sample ``b`` reads row ``b`` where ``select[s]``, else row ``B``
(QwenImage 2.1's ``_select_modulation_rows``: the target image's tokens their sample's timestep, the others ``t = 0``).

This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Mapping, Optional

import torch
import triton.language as tl

from ._runtime.launch import launch as launch_kernel
from ._runtime.triton_common import KINDS, _mul_rn, _round_to, _rsqrt, _sum_combine, for_devices, next_pow2


def _modulate_kernel(
    res_ptr, gate_ptr, y_ptr, scale_ptr, shift_ptr, h_ptr, out_ptr, gate2_ptr, scale2_ptr, shift2_ptr, nw_ptr,
    y2_ptr, sel_ptr,
    NROWS, S, D, eps,
    r_sb, r_ss, g_sb, g_ss, y_sb, y_ss, c_sb, c_ss, t_sb, t_ss, h_sb, h_ss, o_sb, o_ss,
    g2_sb, g2_ss, c2_sb, c2_ss, t2_sb, t2_ss, y2_sb, y2_ss, sel_ss,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr,
    HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, CLIP: tl.constexpr, LIBDEVICE: tl.constexpr,
    MID: tl.constexpr, PLAIN: tl.constexpr = False, AFFINE: tl.constexpr = False, HAS_RES: tl.constexpr = False,
    TWO_TERM: tl.constexpr = False, RMS: tl.constexpr = False, W_KIND: tl.constexpr = 0,
    HAS_Y2: tl.constexpr = False,
    SELECT: tl.constexpr = False, NW: tl.constexpr = True,
):
    # ROWS token rows per program, [ROWS, BLOCK_D] tiles. The activations' loads are issued together so
    # their latencies overlap; the modulation vectors (L2 hits shared by every row of a sample) are loaded
    # after the LayerNorm statistics: fewer live registers during the reductions (6144 wide: 48 -> 43 us on
    # an H100, benchmarks/modulate_variants.py).
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < NROWS
    b = r // S
    s = r - b * S
    bv = b  # the vectors' row
    if SELECT:  # QwenImage 2.1: row b where the token is selected, else the t = 0 row (row B)
        bv = tl.where(tl.load(sel_ptr + s * sel_ss, mask=rm, other=1) != 0, b, NROWS // S)
    d = tl.arange(0, BLOCK_D)
    m = rm[:, None] & (d < D)[None, :]
    ty = h_ptr.dtype.element_ty
    x = tl.load(res_ptr + (b * r_sb + s * r_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_GATE:
        g = tl.load(gate_ptr + (bv * g_sb + s * g_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        if TWO_TERM:  # Wan 2.2 TI2V: table + per-token temb, the fp32 add torch makes before chunking
            g = _round_to(g + tl.load(gate2_ptr + (bv * g2_sb + s * g2_ss)[:, None] + d[None, :], mask=m, other=0.0
                                      ).to(tl.float32), MID)
    if HAS_RES:
        y = tl.load(y_ptr + (b * y_sb + s * y_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_Y2:  # FLUX.3: attn_output + ff_output, a torch add in the tensors' dtype
            y = _round_to(y + tl.load(y2_ptr + (b * y2_sb + s * y2_ss)[:, None] + d[None, :], mask=m, other=0.0
                                      ).to(tl.float32), KIND)
    if HAS_GATE:
        x = _round_to(x + _round_to(_mul_rn(g, y, LIBDEVICE), MID), KIND)  # no fma: torch rounds g * y first
    if PLAIN:
        x = _round_to(x + y, KIND)
    if HAS_RES:
        if CLIP:  # diffusers' fp16 clip(-65504, 65504); NaN passes through as in torch.clip
            x = tl.where(x > 65504.0, 65504.0, tl.where(x < -65504.0, -65504.0, x))
        tl.store(h_ptr + (b * h_sb + s * h_ss)[:, None] + d[None, :], x.to(ty), mask=m)
    if HAS_NORM:
        if RMS:  # Krea 2: F.rms_norm(h.float(), weight=weight + 1.0) (fp32 statistics, no mean)
            xc = x
            rstd = _rsqrt(tl.reduce(x * x, 1, _sum_combine) / D + eps, LIBDEVICE)
        else:
            mean = tl.reduce(x, 1, _sum_combine) / D
            xc = tl.where(m, x - mean[:, None], 0.0)
            var = tl.reduce(xc * xc, 1, _sum_combine) / D
            rstd = _rsqrt(var + eps, LIBDEVICE)
        sc = tl.load(scale_ptr + (bv * c_sb + s * c_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + (bv * t_sb + s * t_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        if TWO_TERM:
            sc = _round_to(sc + tl.load(scale2_ptr + (bv * c2_sb + s * c2_ss)[:, None] + d[None, :], mask=m,
                                        other=0.0).to(tl.float32), MID)
            sh = _round_to(sh + tl.load(shift2_ptr + (bv * t2_sb + s * t2_ss)[:, None] + d[None, :], mask=m,
                                        other=0.0).to(tl.float32), MID)
        if AFFINE:  # torch's LayerNorm with weight and bias: fp32 throughout, one rounding
            o = _round_to(xc * rstd[:, None] * sc + sh, KIND)
        else:
            if RMS and NW:  # 1 + weight in the weight's dtype, the product in fp32 and rounded once (``.to(dtype)``)
                w1 = _round_to(tl.load(nw_ptr + d, mask=d < D, other=0.0).to(tl.float32) + 1.0, W_KIND)
                n = _round_to((xc * rstd[:, None]) * w1[None, :], MID)
            else:
                n = _round_to(xc * rstd[:, None], MID)
            u = _round_to(_mul_rn(n, _round_to(1.0 + sc, MID), LIBDEVICE), MID)
            o = _round_to(u + sh, KIND)
        tl.store(out_ptr + (b * o_sb + s * o_ss)[:, None] + d[None, :], o.to(ty), mask=m)


kernel_for = for_devices(_modulate_kernel)
_interpreted_kernel = kernel_for.interpreted  # the CPU interpreter's kernel (tests)


def pick_config(block_d: int, interpreted: bool) -> dict[str, int]:
    """Launch parameters. Measured on an H100 (docs/notes/fusion.md, "The LayerNorm kernels' bandwidth"; again
    with the cast rounding, docs/notes/rounding.md): one row per program with 4 warps for 4096-wide blocks and 8
    warps for 8192 are the fastest or within 1% of it.

    Read once per form (:func:`_launch_constants`). A benchmark sweeping configurations binds its own function
    here and calls ``_launch_constants.cache_clear()`` before and after (``benchmarks/_bench.launch_config``):
    nothing is read per call."""
    if interpreted:
        return dict(num_warps=1, ROWS=1)
    return dict(num_warps=4 if block_d <= 4096 else 8, ROWS=1)


def _rows(t: Optional[torch.Tensor]) -> tuple[int, int]:
    """(batch stride, token stride) of a [B, S or 1, D] view, a [B, D] vector (stride 0 over the tokens) or
    an affine LayerNorm's [D] weight or bias (stride 0 over both)."""
    if t is None:
        return 0, 0
    strides = t.stride()
    if len(strides) == 3:
        return strides[0], (strides[1] if t.shape[1] != 1 else 0)
    return (strides[0], 0) if len(strides) == 2 else (0, 0)


@functools.lru_cache(maxsize=256)
def _launch_constants(block_d: int, dtype: torch.dtype, cuda: bool, has_gate: bool, has_res: bool, has_norm: bool,
                      clip: bool, once: bool, affine: bool, two_term: bool = False,
                      w_kind: Optional[int] = None, has_y2: bool = False,
                      select: bool = False, rms: bool = False) -> Mapping[str, Any]:
    """The kernel's constexprs and launch options (``ROWS``: rows per program) of one form: built once, not per
    call."""
    cfg = pick_config(block_d, not cuda)
    return types.MappingProxyType(dict(
        BLOCK_D=block_d, ROWS=int(cfg["ROWS"]), KIND=KINDS[dtype], HAS_GATE=has_gate, HAS_NORM=has_norm,
        CLIP=bool(clip and dtype == torch.float16), LIBDEVICE=cuda, MID=0 if once else KINDS[dtype],
        num_warps=int(cfg["num_warps"]), PLAIN=has_res and not has_gate, AFFINE=affine, HAS_RES=has_res,
        TWO_TERM=two_term, RMS=rms or w_kind is not None, W_KIND=w_kind or 0, HAS_Y2=has_y2, SELECT=select,
        NW=w_kind is not None,
    ))


def launch(
    residual: torch.Tensor,
    gate: Optional[torch.Tensor],
    y: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    shift: Optional[torch.Tensor],
    h_out: Optional[torch.Tensor],
    n_out: Optional[torch.Tensor],
    *,
    eps: float,
    clip: bool,
    once: bool = False,
    affine: bool = False,
    addends: Optional[tuple] = None,
    norm_weight: Optional[torch.Tensor] = None,
    y2: Optional[torch.Tensor] = None,
    select: Optional[torch.Tensor] = None,
    rms: bool = False,
) -> None:
    """``residual``, ``y`` and the outputs ``[B, S, D]``, the vectors ``[B, D]`` or ``[B, S or 1, D]``, all
    with a unit-stride last dim (checked by ``ops/_modulate.py``); ``affine``: ``scale``/``shift`` are the
    LayerNorm's ``[D]`` weight and bias; ``addends``: ``(gate2, scale2, shift2)`` added to the vectors in fp32
    (every vector given as two terms: Wan 2.2 TI2V's ``scale_shift_table`` and per-token temb, Krea 2's temb and
    table); ``norm_weight``: the ``[D]`` weight of a zero-centered RMSNorm (Krea 2's) in place of the LayerNorm;
    ``y2``: added to ``y`` (rounded) before the gate; ``select``: a bool ``[S]`` token mask, the vectors ``[B + 1, D]``
    rows (see the module docstring); ``rms`` without ``norm_weight``: diffusers' weightless RMSNorm there (LTX-2's)."""
    B, S, D = residual.shape
    if B * S == 0:
        return
    has_gate = gate is not None
    has_res = y is not None
    has_norm = n_out is not None
    cuda = residual.device.type == "cuda"
    two_term = addends is not None
    key = (next_pow2(D), residual.dtype, cuda, has_gate, has_res, has_norm, bool(clip), bool(once), bool(affine),
           two_term, None if norm_weight is None else KINDS[norm_weight.dtype], y2 is not None, select is not None,
           bool(rms))
    constexprs = _launch_constants(*key)
    dummy = residual
    h = h_out if h_out is not None else n_out
    o = n_out if n_out is not None else h_out
    r_sb, r_ss = residual.stride()[:2]
    h_sb, h_ss = h.stride()[:2]
    o_sb, o_ss = o.stride()[:2]
    launch_kernel(kernel_for(residual.device.type), (-(-(B * S) // constexprs["ROWS"]),), (
        residual, gate if has_gate else dummy, y if has_res else dummy,
        scale if has_norm else dummy, shift if has_norm else dummy, h, o,
        *((t if t is not None else dummy) for t in (addends or (None, None, None))),
        norm_weight if norm_weight is not None else dummy, y2 if y2 is not None else dummy,
        select.view(torch.uint8) if select is not None else dummy, B * S, S, D, float(eps),
        r_sb, r_ss, *_rows(gate), *_rows(y), *_rows(scale), *_rows(shift), h_sb, h_ss, o_sb, o_ss,
        *(stride for t in (addends or (None, None, None)) for stride in _rows(t)), *_rows(y2),
        select.stride(0) if select is not None else 0,
    ), constexprs)
