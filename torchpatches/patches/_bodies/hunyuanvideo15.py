"""The ``hunyuanvideo15`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/hunyuanvideo15.py``."""
from __future__ import annotations

import torch

from ..._core.lazy import lazy_module
from .._fused_common import FALLBACK, fusable
from .._joint_attention import Joint, attend, native_backend
from .._double_stream import Double, double_stream

_per_step = lazy_module("torchpatches.patches._per_step")
#: HunyuanVideo15AttnProcessor2_0: [image; text], FLUX's RoPE on the image rows only, to_out / to_add_out where
#: present.
_HUNYUAN15 = Joint("diffusers.models.transformers.transformer_hunyuan_video15", rope="image_rows",
                   optional_out=True)
#: adaLN-Zero norm1 modules, affine-free norm2 LayerNorms always through the modulate op, (image, text) returned.
_BLOCK = Double(fuse=True, image_first=True)


def processor(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
    if not (encoder_hidden_states is not None and type(attention_mask) is torch.Tensor and attention_mask.dim() == 2
            and fusable(hidden_states, (attn,), encoder_hidden_states) and hidden_states.dim() == 3):
        return FALLBACK
    native = native_backend(self)
    return attend(_HUNYUAN15, self, attn, hidden_states, encoder_hidden_states, image_rotary_emb,
                  lambda rows, dtype: _per_step().square_mask(attention_mask, rows, dtype if native else None))


def block(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None, *args, **kwargs):
    if args or kwargs or not (fusable(hidden_states, (self,), encoder_hidden_states, temb)
                              and hidden_states.dim() == 3 and type(encoder_hidden_states) is torch.Tensor):
        return FALLBACK
    # diffusers 0.42.1 HunyuanVideo15TransformerBlock.forward, the glue through the modulate op where it fits.
    return double_stream(_BLOCK, self, hidden_states, encoder_hidden_states, temb,
                         {"attention_mask": attention_mask, "image_rotary_emb": freqs_cis})
