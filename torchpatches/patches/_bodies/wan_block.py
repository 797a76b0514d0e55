"""The ``wan_block`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/wan_block.py``."""
from __future__ import annotations

from typing import Any, Optional

import torch

from .._fused_common import FALLBACK, fusable, stock
from .._modulate_calls import _rows_fit, _vectors_fit, modulated_once, modulate_ops
from ...ops._runtime.tiers import FLOAT_DTYPES


def _fp32_layer_norm() -> type:
    from diffusers.models.normalization import FP32LayerNorm  # loaded with the target's module

    return FP32LayerNorm


def _plain(norm: Any, width: int, cls: type) -> bool:
    return stock(norm, cls) and norm.weight is None and norm.bias is None and tuple(norm.normalized_shape) == (width,)


def _affine(norm: Any, x: torch.Tensor) -> bool:
    """A stock affine ``FP32LayerNorm(D)`` (Wan's ``cross_attn_norm``) with plain weight and bias on x's device."""
    if not stock(norm, _fp32_layer_norm()) or tuple(norm.normalized_shape) != (x.shape[-1],):
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in (torch.float32, torch.bfloat16,
                                                                             torch.float16)
               and t.shape == (x.shape[-1],) and t.device == x.device for t in (norm.weight, norm.bias))


def _gated(h: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, y_float: bool) -> torch.Tensor:
    """Wan's ``(h.float() + y * gate).type_as(h)`` (``y.float() * gate`` after the feed-forward: ``y_float``).
    Fused only where ``y`` has h's dtype and the gate a float dtype: ``y * gate`` then promotes like
    ``y.float() * gate.float()``, exactly."""
    if _rows_fit(h, y) and _vectors_fit(h, gate, rounding="once"):
        return modulate_ops().prechecked(h, gate, y, None, None, None, once=True)[0]
    return (h.float() + (y.float() if y_float else y) * gate).type_as(h)


def _gated_norm2(norm2: Any, h: torch.Tensor, gate: torch.Tensor, y: torch.Tensor):
    """``h = (h.float() + y * gate).type_as(h)`` and ``norm2(h.float()).type_as(h)``: one pass when norm2 is
    the affine FP32LayerNorm; otherwise the residual fused and norm2 called as diffusers calls it."""
    if _affine(norm2, h) and _rows_fit(h, y) and _vectors_fit(h, gate, rounding="once"):
        from ...ops import _modulate as ops

        return ops.gate_residual_layer_norm(h, gate, y, norm2.weight, norm2.bias, eps=norm2.eps, rounding="once")
    h = _gated(h, gate, y, y_float=False)
    return h, norm2(h.float()).type_as(h)


def _added_norm3(norm3: Any, h: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor):
    """``h = h + y`` and ``(norm3(h.float()) * (1 + scale) + shift).type_as(h)`` in one pass when they fit."""
    if _rows_fit(h, y) and _plain(norm3, h.shape[-1], _fp32_layer_norm()) and _vectors_fit(h, scale, shift,
                                                                                           rounding="once"):
        h, out = modulate_ops().prechecked(h, None, y, scale, shift, norm3.eps, once=True)
        return h, out
    h = h + y
    return h, modulated_once(norm3, _fp32_layer_norm(), h, scale, shift)


def _modulation(table: torch.Tensor, temb: torch.Tensor):
    """diffusers 0.42.1's six modulation vectors, computed as it computes them."""
    if temb.ndim == 4:  # Wan 2.2 TI2V: [B, S, 6, D], per-token vectors
        chunks = (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return tuple(c.squeeze(2) for c in chunks)
    return (table + temb.float()).chunk(6, dim=1)


def _two_terms(table: Any, temb: torch.Tensor, x: torch.Tensor) -> Optional[tuple]:
    """Wan 2.2 TI2V's six per-token vectors as ``(table row, temb chunk)`` pairs, the kernel adding each pair in fp32
    as diffusers' ``scale_shift_table.unsqueeze(0) + temb.float()`` does, without its ``[B, S, 6, D]`` fp32 tensor;
    None where the terms do not fit (then diffusers' expression)."""
    B, S, D = x.shape
    if not (type(table) in (torch.Tensor, torch.nn.Parameter) and tuple(table.shape) == (1, 6, D)
            and tuple(temb.shape) == (B, S, 6, D) and temb.stride(-1) == 1 and table.stride(-1) == 1
            and table.dtype in FLOAT_DTYPES and temb.dtype in FLOAT_DTYPES and table.device == x.device
            and temb.device == x.device):
        return None
    return tuple((table[0, k].expand(B, D), temb[:, :, k]) for k in range(6))


def _sum(pair: tuple) -> torch.Tensor:
    """One two-term vector materialized as diffusers computes it (``[B, S, D]`` fp32)."""
    return pair[0][:, None] + pair[1].float()


def _per_token(self, x, encoder_hidden_states, pairs, rotary_emb):
    """diffusers 0.42.1's block with Wan 2.2 TI2V's per-token vectors given as two-term pairs (``_two_terms``)."""
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = pairs
    ops = modulate_ops()
    # 1. Self-attention (norm1 checked plain by _block)
    norm_hidden_states = ops.prechecked(x, None, None, scale_msa[0], shift_msa[0], self.norm1.eps, once=True,
                                        addends=(None, scale_msa[1], shift_msa[1]))[0]
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
    # 2. Cross-attention (the affine norm2 form takes one-term vectors: the gate is materialized, one [B, S, D])
    x, norm_hidden_states = _gated_norm2(self.norm2, x, _sum(gate_msa), attn_output)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    # 3. Feed-forward
    if _rows_fit(x, attn_output) and _plain(self.norm3, x.shape[-1], _fp32_layer_norm()):
        x, norm_hidden_states = ops.prechecked(x, None, attn_output, c_scale_msa[0], c_shift_msa[0], self.norm3.eps,
                                               once=True, addends=(None, c_scale_msa[1], c_shift_msa[1]))
    else:
        x, norm_hidden_states = _added_norm3(self.norm3, x, attn_output, _sum(c_scale_msa), _sum(c_shift_msa))
    ff_output = self.ffn(norm_hidden_states)
    if _rows_fit(x, ff_output):
        return ops.prechecked(x, c_gate_msa[0], ff_output, None, None, None, once=True,
                              addends=(c_gate_msa[1], None, None))[0]
    return _gated(x, _sum(c_gate_msa), ff_output, y_float=True)


def _block(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
    x = hidden_states
    rotary = tuple(t for t in (rotary_emb if isinstance(rotary_emb, (tuple, list)) else (rotary_emb,))
                   if isinstance(t, torch.Tensor))
    if not (fusable(x, (self,), encoder_hidden_states, temb, *rotary) and x.dim() == 3
            and type(temb) is torch.Tensor and _plain(self.norm1, x.shape[-1], _fp32_layer_norm())):
        return FALLBACK
    if temb.ndim == 4:
        pairs = _two_terms(self.scale_shift_table, temb, x)
        if pairs is not None:
            return _per_token(self, x, encoder_hidden_states, pairs, rotary_emb)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = _modulation(self.scale_shift_table, temb)
    # 1. Self-attention
    norm_hidden_states = modulated_once(self.norm1, _fp32_layer_norm(), x, scale_msa, shift_msa)
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
    # 2. Cross-attention (the gated residual and norm2 in one pass)
    x, norm_hidden_states = _gated_norm2(self.norm2, x, gate_msa, attn_output)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    # 3. Feed-forward (the residual, norm3 and the modulation in one pass)
    x, norm_hidden_states = _added_norm3(self.norm3, x, attn_output, c_scale_msa, c_shift_msa)
    ff_output = self.ffn(norm_hidden_states)
    return _gated(x, c_gate_msa, ff_output, y_float=True)
