"""The ``hunyuanvideo15`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/hunyuanvideo15.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from ..._core.lazy import lazy_module
from .._diffusers_norms import diffusers_rms_norms_fit
from .._fused_common import FALLBACK, declined, dropout, fusable, linear
from .._modulate_calls import residual, residual_modulated

_HUNYUAN = "diffusers.models.transformers.transformer_hunyuan_video15"
_per_step = lazy_module("torchpatches.patches._per_step")
_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


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


def _fused_qkv(attn: Any, image: tuple, text: tuple, image_rotary_emb: Any) -> Optional[tuple]:
    """The joint ``[image; text]`` q, k, v normalized (diffusers' RMSNorm rounding) and the image rows rotated, in one
    launch of ``ops.qk_norm_rope`` (the text rows get identity RoPE rows), or None where a tensor does not fit."""
    q = image[0]
    if any(type(t) is not torch.Tensor or t.dtype != q.dtype or t.dim() != 4 for t in image + text) \
            or q.shape[-1] % 2 or not isinstance(image_rotary_emb, (tuple, list)) or len(image_rotary_emb) != 2 \
            or not diffusers_rms_norms_fit(attn, q, _NORMS):
        return None
    tables = _per_step().image_rows_tables(*image_rotary_emb, text[0].shape[1], q.device)
    if tables is None or tables[0].shape != (q.shape[1] + text[0].shape[1], q.shape[-1]):
        declined("image_rotary_emb is not fp32 (cos, sin) [S, D] of the image's rows")
        return None
    from ...ops._qk_norm_rope import qk_norm_rope  # lazily: importing an op registers torch.library ops

    modules = attn._modules
    norm_q, norm_k, norm_added_q, norm_added_k = (modules[name] for name in _NORMS)
    try:
        return qk_norm_rope(image[0], image[1], *tables, q_weight=norm_q.weight, k_weight=norm_k.weight,
                            eps_q=norm_q.eps, eps_k=norm_k.eps, v=image[2], q_txt=text[0], k_txt=text[1],
                            v_txt=text[2], q_txt_weight=norm_added_q.weight, k_txt_weight=norm_added_k.weight,
                            eps_q_txt=norm_added_q.eps, eps_k_txt=norm_added_k.eps, text_first=False,
                            rounding="each")
    except ValueError:  # a forced tier that cannot run, shapes the op refuses: checked before computing
        return None


def _diffusers_qkv(attn: Any, image: tuple, text: tuple, image_rotary_emb: Any) -> tuple:
    """diffusers 0.42.1's code for the same stretch."""
    query, key, value = image
    encoder_query, encoder_key, encoder_value = text
    query = attn.norm_q(query)
    key = attn.norm_k(key)
    if image_rotary_emb is not None:
        from diffusers.models.embeddings import apply_rotary_emb  # as diffusers imports it, per call

        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    if attn.norm_added_q is not None:
        encoder_query = attn.norm_added_q(encoder_query)
    if attn.norm_added_k is not None:
        encoder_key = attn.norm_added_k(encoder_key)
    return (torch.cat([query, encoder_query], dim=1), torch.cat([key, encoder_key], dim=1),
            torch.cat([value, encoder_value], dim=1))


def processor(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
    if not (encoder_hidden_states is not None and type(attention_mask) is torch.Tensor and attention_mask.dim() == 2
            and fusable(hidden_states, (attn,), encoder_hidden_states) and hidden_states.dim() == 3):
        return FALLBACK
    module = sys.modules[_HUNYUAN]
    # diffusers 0.42.1 HunyuanVideo15AttnProcessor2_0.__call__, the mask from the per-step cache.
    query = linear(attn.to_q, hidden_states)
    key = linear(attn.to_k, hidden_states)
    value = linear(attn.to_v, hidden_states)

    query = query.unflatten(2, (attn.heads, -1))
    key = key.unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))

    encoder_query = linear(attn.add_q_proj, encoder_hidden_states)
    encoder_key = linear(attn.add_k_proj, encoder_hidden_states)
    encoder_value = linear(attn.add_v_proj, encoder_hidden_states)

    encoder_query = encoder_query.unflatten(2, (attn.heads, -1))
    encoder_key = encoder_key.unflatten(2, (attn.heads, -1))
    encoder_value = encoder_value.unflatten(2, (attn.heads, -1))

    qkv = _fused_qkv(attn, (query, key, value), (encoder_query, encoder_key, encoder_value), image_rotary_emb)
    if qkv is None:
        query, key, value = _diffusers_qkv(attn, (query, key, value), (encoder_query, encoder_key, encoder_value),
                                           image_rotary_emb)
    else:
        query, key, value = qkv

    seq_len = query.shape[1]
    attention_mask = _per_step().square_mask(attention_mask, seq_len, query.dtype if _native(self) else None)

    hidden_states = module.dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
        backend=self._attention_backend, parallel_config=self._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    hidden_states = hidden_states.to(query.dtype)

    hidden_states, encoder_hidden_states = (
        hidden_states[:, : -encoder_hidden_states.shape[1]],
        hidden_states[:, -encoder_hidden_states.shape[1]:],
    )
    if getattr(attn, "to_out", None) is not None:
        hidden_states = linear(attn.to_out[0], hidden_states)
        hidden_states = dropout(attn.to_out[1], hidden_states)
    if getattr(attn, "to_add_out", None) is not None:
        encoder_hidden_states = linear(attn.to_add_out, encoder_hidden_states)
    return hidden_states, encoder_hidden_states


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
