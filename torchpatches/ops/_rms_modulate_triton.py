"""Triton kernel of the RMSNorm adaLN family (``ops/_rms_modulate.py``): gated post-norm residual, RMSNorm + scale,
or both in one pass.

ROWS token rows per program (``[B, S, D]`` views, last dim unit-stride, any row strides):

    n   = round(round(y * rsqrt(mean(y^2) + eps_y)) * w_y)      (HAS_RES: diffusers' RMSNorm of y)
    h   = round(residual + round(gate * n))                     (HAS_RES)
    out = round(round(round(h * rsqrt(mean(h^2) + eps)) * w) * scale)   (HAS_NORM; h = residual without HAS_RES)

``round`` rounds to the tensors' dtype where diffusers' eager code rounds: its ``RMSNorm`` computes
``x * rstd`` in fp32 and casts to the weight's dtype, then multiplies by the weight; the modulation and the
residual are bf16/fp16 ops that each round. ``gate``, ``scale`` are ``[B, S or 1, D]`` views (stride 0 over S when
shared). This module imports triton: import it only when the Triton tier is used.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Mapping, Optional

import torch
import triton.language as tl

from ._runtime.launch import launch as launch_kernel
from ._runtime.triton_common import KINDS, _mul_rn, _round_to, _rsqrt, _sum_combine, for_devices, next_pow2


def _rms_modulate_kernel(
    res_ptr, gate_ptr, y_ptr, wy_ptr, w_ptr, scale_ptr, h_ptr, out_ptr,
    NROWS, S, D, eps_y, eps,
    r_sb, r_ss, g_sb, g_ss, y_sb, y_ss, c_sb, c_ss, h_sb, h_ss, o_sb, o_ss,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < NROWS
    b = r // S
    s = r - b * S
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    m = rm[:, None] & dm[None, :]
    ty = out_ptr.dtype.element_ty
    x = tl.load(res_ptr + (b * r_sb + s * r_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        y = tl.load(y_ptr + (b * y_sb + s * y_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        rstd_y = _rsqrt(tl.reduce(y * y, 1, _sum_combine) / D + eps_y, LIBDEVICE)
        wy = tl.load(wy_ptr + d, mask=dm, other=0.0).to(tl.float32)
        n = _round_to(_round_to(y * rstd_y[:, None], KIND) * wy[None, :], KIND)
        g = tl.load(gate_ptr + (b * g_sb + s * g_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        x = _round_to(x + _round_to(_mul_rn(g, n, LIBDEVICE), KIND), KIND)  # no fma: torch rounds g * n first
        tl.store(h_ptr + (b * h_sb + s * h_ss)[:, None] + d[None, :], x.to(ty), mask=m)
    if HAS_NORM:
        rstd = _rsqrt(tl.reduce(x * x, 1, _sum_combine) / D + eps, LIBDEVICE)
        w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        c = tl.load(scale_ptr + (b * c_sb + s * c_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        o = _round_to(_round_to(_round_to(x * rstd[:, None], KIND) * w[None, :], KIND) * c, KIND)
        tl.store(out_ptr + (b * o_sb + s * o_ss)[:, None] + d[None, :], o.to(ty), mask=m)


kernel_for = for_devices(_rms_modulate_kernel)
_interpreted_kernel = kernel_for.interpreted  # the CPU interpreter's kernel (tests)


def _rows(t: Optional[torch.Tensor]) -> tuple[int, int]:
    """(batch stride, token stride) of a [B, S or 1, D] view or a [B, D] vector (stride 0 over the tokens)."""
    if t is None:
        return 0, 0
    strides = t.stride()
    if len(strides) == 3:
        return strides[0], (strides[1] if t.shape[1] != 1 else 0)
    return strides[0], 0


@functools.lru_cache(maxsize=64)
def _launch_constants(block_d: int, dtype: torch.dtype, cuda: bool, has_res: bool, has_norm: bool
                      ) -> Mapping[str, Any]:
    """One row per program, 4 warps up to 4096 wide, 8 above: the LayerNorm kernel's measured choice
    (``_modulate_triton.pick_config``), the same row-reduction shape."""
    return types.MappingProxyType(dict(
        BLOCK_D=block_d, ROWS=1, KIND=KINDS[dtype], HAS_RES=has_res, HAS_NORM=has_norm, LIBDEVICE=cuda,
        num_warps=(4 if block_d <= 4096 else 8) if cuda else 1,
    ))


def launch(residual: torch.Tensor, gate: Optional[torch.Tensor], y: Optional[torch.Tensor],
           y_weight: Optional[torch.Tensor], weight: Optional[torch.Tensor], scale: Optional[torch.Tensor],
           h_out: Optional[torch.Tensor], n_out: Optional[torch.Tensor], *, eps_y: float, eps: float) -> None:
    """``residual``, ``y`` and the outputs ``[B, S, D]``; ``gate``, ``scale`` ``[B, D]`` or ``[B, S or 1, D]``;
    the weights ``[D]``; all with a unit-stride last dim (checked by ``ops/_rms_modulate.py``)."""
    B, S, D = residual.shape
    if B * S == 0:
        return
    has_res = y is not None
    has_norm = n_out is not None
    cuda = residual.device.type == "cuda"
    constexprs = _launch_constants(next_pow2(D), residual.dtype, cuda, has_res, has_norm)
    dummy = residual
    h = h_out if h_out is not None else n_out
    o = n_out if n_out is not None else h_out
    launch_kernel(kernel_for(residual.device.type), (-(-(B * S) // constexprs["ROWS"]),), (
        residual, gate if has_res else dummy, y if has_res else dummy, y_weight if has_res else dummy,
        weight if has_norm else dummy, scale if has_norm else dummy, h, o,
        B * S, S, D, float(eps_y), float(eps),
        *residual.stride()[:2], *_rows(gate), *_rows(y), *_rows(scale), *h.stride()[:2], *o.stride()[:2],
    ), constexprs)
