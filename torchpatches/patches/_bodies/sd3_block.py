"""The ``sd3_block`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/sd3_block.py``."""
from __future__ import annotations

import sys
from typing import Any

import torch

from .._fused_common import FALLBACK, fusable, linear, pattern_on, plain_layer_norm, stock
from .._double_stream import Double, double_stream
from .._modulate_calls import modulated

_NORMALIZATION = "diffusers.models.normalization"
#: norm1 / norm1_context adaLN modules, norm2 / norm2_context through the modulate op while adaln is on, no clip.
_SD3 = Double()


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
    return out, gate_msa, shift_mlp, scale_mlp, gate_mlp, out2, gate_msa2  # double_stream's dual-attention tuple


def _joint_block(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
    if not _block_ok(self, hidden_states, encoder_hidden_states, temb):
        return FALLBACK
    # diffusers 0.42.1 JointTransformerBlock.forward with the gate/residual/norm2 glue fused.
    modules = self._modules  # the attribute lookup is nn.Module.__getattr__ in Python: host time
    image = _norm1_dual(self, hidden_states, temb) if self.use_dual_attention \
        else modules["norm1"](hidden_states, emb=temb)
    text = (modules["norm1_context"](encoder_hidden_states, temb),) if self.context_pre_only else None
    return double_stream(_SD3, self, hidden_states, encoder_hidden_states, temb, {}, joint_attention_kwargs,
                         image, text)
