"""The ``qwenimage_block`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/qwenimage_block.py``."""
from __future__ import annotations

import sys
from typing import Any

import torch

from .._fused_common import FALLBACK, fusable, plain_layer_norm, remembered
from .._double_stream import Double, Stream, double_stream

_QWEN = "diffusers.models.transformers.transformer_qwenimage"
#: Plain LayerNorms modulated by img_mod / txt_mod (shift, scale, gate twice), all through the modulate op; the fp16
#: clip after each feed-forward.
_QWEN_BLOCK = Double(Stream("img_norm1", "img_norm2", "img_mlp", mod="img_mod", clip=True),
                     Stream("txt_norm1", "txt_norm2", "txt_mlp", mod="txt_mod", clip=True), fuse=True)


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
    return double_stream(_QWEN_BLOCK, self, hidden_states, encoder_hidden_states, temb,
                         {"encoder_hidden_states_mask": encoder_hidden_states_mask,
                          "image_rotary_emb": image_rotary_emb}, joint_attention_kwargs)
