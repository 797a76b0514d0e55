"""The ``qwenimage_block`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/qwenimage_block.py``."""
from __future__ import annotations

import sys
from typing import Any

import torch

from .._fused_common import FALLBACK, fusable, plain_layer_norm, remembered
from .._modulate_calls import modulated, residual, residual_modulated

_QWEN = "diffusers.models.transformers.transformer_qwenimage"


def _covered(self: Any, hidden_states: Any, encoder_hidden_states: Any, temb: Any, modulate_index: Any) -> bool:
    width = hidden_states.shape[-1] if isinstance(hidden_states, torch.Tensor) else None
    return (
        type(self)._modulate is sys.modules[_QWEN].QwenImageTransformerBlock._modulate  # the fused path skips it
        and not self.zero_cond_t  # the edit models: temb of 2B rows and per-token modulation (modulate_index)
        and modulate_index is None
        and fusable(hidden_states, (self,), encoder_hidden_states, temb)
        and type(encoder_hidden_states) is torch.Tensor
        and type(temb) is torch.Tensor
        and hidden_states.dim() == 3
        and encoder_hidden_states.dim() == 3
        and _norms_fit(self, width)
    )


_NORMS = ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2")


def _norms_fit(block: Any, width: int) -> bool:
    """Stock affine-free LayerNorms of this width: decided once per block and width while the norms are the
    same objects in the same state (``remembered``)."""
    return remembered(block, width, lambda: all(plain_layer_norm(getattr(block, n), width) for n in _NORMS), _NORMS)


def _block(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb=None,
           joint_attention_kwargs=None, modulate_index=None):
    if not _covered(self, hidden_states, encoder_hidden_states, temb, modulate_index):
        return FALLBACK
    # diffusers 0.42.1 QwenImageTransformerBlock.forward with the glue fused (zero_cond_t is False here).
    img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
    img_shift1, img_scale1, img_gate1 = img_mod1.chunk(3, dim=-1)
    txt_shift1, txt_scale1, txt_gate1 = txt_mod1.chunk(3, dim=-1)
    img_modulated = modulated(self.img_norm1, hidden_states, img_scale1, img_shift1, fuse=True)
    txt_modulated = modulated(self.txt_norm1, encoder_hidden_states, txt_scale1, txt_shift1, fuse=True)
    img_attn_output, txt_attn_output = self.attn(
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    img_shift2, img_scale2, img_gate2 = img_mod2.chunk(3, dim=-1)
    txt_shift2, txt_scale2, txt_gate2 = txt_mod2.chunk(3, dim=-1)
    hidden_states, img_modulated2 = residual_modulated(self.img_norm2, hidden_states, img_gate1, img_attn_output,
                                                       img_scale2, img_shift2, fuse=True)
    hidden_states = residual(hidden_states, img_gate2, self.img_mlp(img_modulated2), clip=True)
    encoder_hidden_states, txt_modulated2 = residual_modulated(
        self.txt_norm2, encoder_hidden_states, txt_gate1, txt_attn_output, txt_scale2, txt_shift2, fuse=True
    )
    encoder_hidden_states = residual(encoder_hidden_states, txt_gate2, self.txt_mlp(txt_modulated2), clip=True)
    return encoder_hidden_states, hidden_states
