"""The ``qwenimage_qk_norm_rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/qwenimage_qk_norm_rope.py``."""
from __future__ import annotations

from typing import Any

import torch

from ..._core.lazy import lazy_module
from .._fused_common import FALLBACK, fusable
from .._joint_attention import Joint, attend

# imported at the first fused call: the tables' module is not needed to declare the patch (import cost)
_tables = lazy_module("torchpatches.patches._per_step")
#: QwenDoubleStreamAttnProcessor2_0: [text; image], complex RoPE per stream, heads of inner_dim / heads, the output
#: slices made contiguous before their projections.
_QWENIMAGE = Joint("diffusers.models.transformers.transformer_qwenimage", text_first=True, rope="complex",
                   head_split="inner_dim", contiguous_out=True)


def _mask_fits(mask: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> bool:
    if mask is None:
        return True
    return (
        type(mask) is torch.Tensor
        and mask.device == hidden_states.device
        and tuple(mask.shape) == tuple(encoder_hidden_states.shape[:2])
        and not mask.requires_grad
    )


def _covered(attn: Any, hidden_states: Any, encoder_hidden_states: Any, mask: Any,
             attention_mask: Any, image_rotary_emb: Any) -> bool:
    return (
        encoder_hidden_states is not None
        and attention_mask is None  # diffusers raises for an external mask: let it
        and isinstance(image_rotary_emb, (tuple, list))
        and len(image_rotary_emb) == 2
        and fusable(hidden_states, (attn,), encoder_hidden_states)
        and type(encoder_hidden_states) is torch.Tensor
        and hidden_states.dim() == 3
        and encoder_hidden_states.dim() == 3
        and _mask_fits(mask, hidden_states, encoder_hidden_states)
    )


def _processor(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
               attention_mask=None, image_rotary_emb=None):
    if not _covered(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask,
                    image_rotary_emb):
        return FALLBACK
    if encoder_hidden_states_mask is None:
        return attend(_QWENIMAGE, self, attn, hidden_states, encoder_hidden_states, image_rotary_emb)
    mask = _tables().joint_mask(encoder_hidden_states_mask, hidden_states)
    return attend(_QWENIMAGE, self, attn, hidden_states, encoder_hidden_states, image_rotary_emb,
                  lambda rows, dtype: mask)
