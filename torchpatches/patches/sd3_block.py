"""sd3_block: SD3's ``JointTransformerBlock`` with each ``residual + gate * out`` (and the LayerNorm + modulate
after it) as one kernel (eager).

What goes wrong upstream
    ``JointTransformerBlock.forward`` (SD3 / SD3.5, ``diffusers/models/attention.py``) ends its attention
    half with ``hidden_states + gate_msa.unsqueeze(1) * attn_output`` and feeds the result straight into
    ``norm2`` and ``* (1 + scale_mlp[:, None]) + shift_mlp[:, None]``: six eager ops, each a full pass over
    ``[B, S, D]``; the feed-forward half ends with another gate + residual (two ops); the context stream does
    the same (eight more). ``torch.compile`` fuses each stretch into one kernel; eager users pay 16 launches
    per block for it.

What the patch changes
    The block's forward keeps every module call of diffusers' code (norm1, norm1_context, attention, attn2,
    feed-forwards: LoRA layers and hooks on them keep working) and replaces the tensor glue, as the
    ``gate_residual`` patch does for FLUX's blocks:

    - ``h + gate_msa * attn`` then ``norm2(h) * (1 + scale_mlp) + shift_mlp`` by
      ``ops.gate_residual_layer_norm_modulate`` (one pass, two outputs) while ``adaln`` is applied
      (else ``ops.gate_residual`` and diffusers' LayerNorm + modulate); the same for the context
      stream with ``norm2_context``;
    - ``h + gate_mlp * ff`` (both streams) by ``ops.gate_residual``;
    - the last, ``context_pre_only`` block: no context tail (diffusers returns None for it);
    - SD3.5-medium's dual-attention blocks (MMDiT-X): ``SD35AdaLayerNormZeroX`` (one LayerNorm, two
      modulations) as two ``layer_norm_modulate`` launches while ``adaln`` is applied (its SiLU a module
      call, its Linear too unless a stock ``nn.Linear``: ``_fused_common.linear``), the first gate + residual
      alone, ``attn2`` as a module call, then the second
      gate + residual fused with norm2 + modulate.

    diffusers' forward runs for: ``torch.compile``, ``torch.jit.trace``, feed-forward chunking
    (``set_chunk_feed_forward``), gradients (also forward AD and functorch transforms), autocast, a replaced
    global of the block or of ``F.layer_norm`` / ``LayerNorm.forward``, tensor subclasses, CPU tensors.

Tolerance
    The same kernels as ``gate_residual`` (FLUX), the same rounding points: gate + residual bit-identical,
    norm2 + modulate within one ulp (an fp32 LayerNorm statistic in another summation order).

Versions
    diffusers 0.42.x, fingerprint of ``JointTransformerBlock.forward`` verified on 0.42.1; torch >= 2.4.

When to delete
    When diffusers' SD3 block fuses its residual glue in eager mode (or ships such kernels).
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from .._core.declare import Patch
from ._fused_common import (FALLBACK, FUSED_REQUIRES, LAYER_NORM, LINEAR, fusable, fused_target, linear, pattern_on,
                            plain_layer_norm, stock)
from ._modulate_calls import modulated, residual, residual_modulated

__all__ = ["PATCH"]

_ATTENTION = "diffusers.models.attention"
_NORMALIZATION = "diffusers.models.normalization"
_NORM_X = f"{_NORMALIZATION}:SD35AdaLayerNormZeroX.forward"


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


PATCH = Patch(
    name="sd3_block", summary="SD3 blocks: gate + residual (+ next LayerNorm/modulate) in one kernel (eager)",
    targets=(fused_target("sd3_block", f"{_ATTENTION}:JointTransformerBlock.forward", _joint_block, "e64d8fc0e57ee1fa",
                          LAYER_NORM + LINEAR + (_NORM_X,)),),  # the fingerprints: diffusers 0.42.1
    verifies={_NORM_X: frozenset({"0d6e640065ac6bf5"})},  # rewritten by _norm1_dual
    requires=FUSED_REQUIRES)
