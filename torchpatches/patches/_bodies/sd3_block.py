"""The ``sd3_block`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/sd3_block.py``."""
from __future__ import annotations

import sys
from typing import Any

import torch

from .._fused_common import FALLBACK, fusable, linear, pattern_on, plain_layer_norm, stock
from .._modulate_calls import modulated, residual, residual_modulated

_NORMALIZATION = "diffusers.models.normalization"


def _block_ok(self: Any, hidden_states: Any, encoder_hidden_states: Any, temb: Any) -> bool:
    return (
        self._chunk_size is None
        and fusable(hidden_states, (self,), encoder_hidden_states, temb)
        and hidden_states.dim() == 3
        and type(encoder_hidden_states) is torch.Tensor
        and encoder_hidden_states.dim() == 3
    )


def _norm1_dual(self: Any, hidden_states: torch.Tensor, temb: torch.Tensor) -> tuple:
    """``self.norm1(hidden_states, emb=temb)`` for an ``SD35AdaLayerNormZeroX``: diffusers 0.42.1's forward
    with its LayerNorm computed by each of the two modulations (the same values) while adaln is on."""
    norm1 = self.norm1
    if not (pattern_on("adaln") and stock(norm1, sys.modules[_NORMALIZATION].SD35AdaLayerNormZeroX)
            and plain_layer_norm(norm1.norm, hidden_states.shape[-1])):
        return norm1(hidden_states, emb=temb)
    emb = linear(norm1.linear, norm1.silu(temb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = emb.chunk(
        9, dim=1
    )
    out = modulated(norm1.norm, hidden_states, scale_msa, shift_msa, fuse=True)
    out2 = modulated(norm1.norm, hidden_states, scale_msa2, shift_msa2, fuse=True)
    return out, gate_msa, shift_mlp, scale_mlp, gate_mlp, out2, gate_msa2


def _joint_block(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
    if not _block_ok(self, hidden_states, encoder_hidden_states, temb):
        return FALLBACK
    # diffusers 0.42.1 JointTransformerBlock.forward with the gate/residual/norm2 glue fused.
    joint_attention_kwargs = joint_attention_kwargs or {}
    if self.use_dual_attention:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2 = _norm1_dual(
            self, hidden_states, temb
        )
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    if self.context_pre_only:
        norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb
        )
    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states, **joint_attention_kwargs
    )
    if self.use_dual_attention:
        hidden_states = residual(hidden_states, gate_msa, attn_output, clip=False)
        attn_output = self.attn2(hidden_states=norm_hidden_states2, **joint_attention_kwargs)
        gate_msa = gate_msa2
    hidden_states, norm_hidden_states = residual_modulated(
        self.norm2, hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp
    )
    hidden_states = residual(hidden_states, gate_mlp, self.ff(norm_hidden_states), clip=False)
    if self.context_pre_only:
        return None, hidden_states
    encoder_hidden_states, norm_encoder_hidden_states = residual_modulated(
        self.norm2_context, encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp
    )
    context_ff_output = self.ff_context(norm_encoder_hidden_states)
    encoder_hidden_states = residual(encoder_hidden_states, c_gate_mlp, context_ff_output, clip=False)
    return encoder_hidden_states, hidden_states
