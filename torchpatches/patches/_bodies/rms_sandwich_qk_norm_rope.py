"""The ``rms_sandwich_qk_norm_rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/rms_sandwich_qk_norm_rope.py``."""
from __future__ import annotations

import torch

from ..._core.lazy import lazy_module
from .._fused_common import FALLBACK, fusable
from .._joint_attention import Joint, attend, native_backend

_per_step = lazy_module("torchpatches.patches._per_step")

#: ZSingleStreamAttnProcessor: one stream, diffusers' RMSNorm per head, complex64 RoPE per sample [B, S, D/2].
_ZIMAGE = Joint("diffusers.models.transformers.transformer_z_image", rope="complex_batch")
#: Ideogram4AttnProcessor: one stream, heads of head_dim, half-split RoPE in the activations' dtype, to_out[0] only.
_IDEOGRAM4 = Joint("diffusers.models.transformers.transformer_ideogram4", rope="half_each", head_split="num_heads",
                   out_dropout=False)


def zimage(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
    if freqs_cis is None or not (fusable(hidden_states, (attn,), freqs_cis) and hidden_states.dim() == 3):
        return FALLBACK
    if attention_mask is not None and attention_mask.ndim == 2:  # diffusers 0.42.1's broadcast of a [B, S] mask
        attention_mask = attention_mask[:, None, None, :]
    return attend(_ZIMAGE, self, attn, hidden_states, None, freqs_cis, lambda rows, dtype: attention_mask)


def ideogram4(self, attn, hidden_states, attention_mask, image_rotary_emb):
    if not (fusable(hidden_states, (attn,)) and hidden_states.dim() == 3):
        return FALLBACK
    mask = attention_mask
    if type(mask) is torch.Tensor and mask.dtype == torch.bool and native_backend(self):
        # the block-diagonal [B, 1, S, S] mask of the step, made additive once rather than by SDPA in every block
        return attend(_IDEOGRAM4, self, attn, hidden_states, None, image_rotary_emb,
                      lambda rows, dtype: _per_step().additive_mask(mask, dtype))
    return attend(_IDEOGRAM4, self, attn, hidden_states, None, image_rotary_emb, lambda rows, dtype: mask)
