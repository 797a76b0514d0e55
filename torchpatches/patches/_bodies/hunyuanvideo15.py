"""The ``hunyuanvideo15`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/hunyuanvideo15.py``."""
from __future__ import annotations

import sys
from typing import Any

import torch

from ..._core.lazy import lazy_module
from .._fused_common import FALLBACK, fusable
from .._joint_attention import Joint, attend
from .._modulate_calls import residual, residual_modulated

_per_step = lazy_module("torchpatches.patches._per_step")
#: HunyuanVideo15AttnProcessor2_0: [image; text], FLUX's RoPE on the image rows only, to_out / to_add_out where
#: present.
_HUNYUAN15 = Joint("diffusers.models.transformers.transformer_hunyuan_video15", rope="image_rows",
                   optional_out=True)


def _native(processor: Any) -> bool:
    """The call goes to diffusers' native backend (``torch.nn.functional.scaled_dot_product_attention``, which turns a
    boolean mask into an additive one in every call) without context parallelism."""
    if processor._parallel_config is not None:
        return False
    backend = processor._attention_backend
    if backend is None:
        registry = sys.modules["diffusers.models.attention_dispatch"]._AttentionBackendRegistry
        backend = registry.get_active_backend()[0]
    return getattr(backend, "value", backend) == "native"


def processor(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
    if not (encoder_hidden_states is not None and type(attention_mask) is torch.Tensor and attention_mask.dim() == 2
            and fusable(hidden_states, (attn,), encoder_hidden_states) and hidden_states.dim() == 3):
        return FALLBACK
    native = _native(self)
    return attend(_HUNYUAN15, self, attn, hidden_states, encoder_hidden_states, image_rotary_emb,
                  lambda rows, dtype: _per_step().square_mask(attention_mask, rows, dtype if native else None))


def block(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None, *args, **kwargs):
    if args or kwargs or not (fusable(hidden_states, (self,), encoder_hidden_states, temb)
                              and hidden_states.dim() == 3 and type(encoder_hidden_states) is torch.Tensor):
        return FALLBACK
    # diffusers 0.42.1 HunyuanVideo15TransformerBlock.forward, the glue through the modulate op where it fits.
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb
    )
    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        attention_mask=attention_mask,
        image_rotary_emb=freqs_cis,
    )
    hidden_states, norm_hidden_states = residual_modulated(self.norm2, hidden_states, gate_msa, attn_output, scale_mlp,
                                                           shift_mlp, fuse=True)
    encoder_hidden_states, norm_encoder_hidden_states = residual_modulated(
        self.norm2_context, encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp, fuse=True)
    ff_output = self.ff(norm_hidden_states)
    context_ff_output = self.ff_context(norm_encoder_hidden_states)
    hidden_states = residual(hidden_states, gate_mlp, ff_output, clip=False)
    encoder_hidden_states = residual(encoder_hidden_states, c_gate_mlp, context_ff_output, clip=False)
    return hidden_states, encoder_hidden_states
