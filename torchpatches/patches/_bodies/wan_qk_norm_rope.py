"""The ``wan_qk_norm_rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/wan_qk_norm_rope.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from .._fused_common import FALLBACK, dropout, fusable, linear, plain_rms_norm, stock

_WAN = "diffusers.models.transformers.transformer_wan"


def _rotary_fits(rotary_emb: Any, x: torch.Tensor, head_dim: int) -> bool:
    """Wan's ``WanRotaryPosEmbed`` output: fp32 ``(cos, sin)`` of ``[1, S, 1, head_dim]``."""
    if not isinstance(rotary_emb, (tuple, list)) or len(rotary_emb) != 2:
        return False
    return all(type(t) is torch.Tensor and t.dtype == torch.float32 and t.device == x.device
               and tuple(t.shape) == (1, x.shape[1], 1, head_dim) for t in rotary_emb)


def _norms_stock(attn: Any) -> bool:
    return all(stock(norm, torch.nn.RMSNorm) and tuple(norm.normalized_shape) == (attn.inner_dim,)
               for norm in (attn.norm_q, attn.norm_k))


def _covered(attn: Any, hidden_states: Any, encoder_hidden_states: Any, rotary_emb: Any) -> bool:
    rotary = tuple(rotary_emb) if isinstance(rotary_emb, (tuple, list)) else (rotary_emb,)
    return (
        attn.add_k_proj is None  # I2V: the image context's extra attention runs in diffusers' code
        and fusable(hidden_states, (attn,), encoder_hidden_states, *(t for t in rotary if isinstance(t, torch.Tensor)))
        and hidden_states.dim() == 3
        and attn.inner_dim % attn.heads == 0
        and _norms_stock(attn)
        and (rotary_emb is None or _rotary_fits(rotary_emb, hidden_states, attn.inner_dim // attn.heads))
    )


def _fused_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, rotary_emb: Any):
    """(q, k) normalized (and rotated) by one launch, or None if a tensor does not fit the op."""
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and query.dim() == 3 and key.dim() == 3
            and plain_rms_norm(attn.norm_q, query) and plain_rms_norm(attn.norm_k, key)):
        return None
    cos = sin = None
    if rotary_emb is not None:
        cos, sin = (t[0, :, 0] for t in rotary_emb)  # [S, head_dim] views
    from ...ops._rms_norm_rope import rms_norm_rope  # lazily: importing an op registers torch.library ops

    try:
        return rms_norm_rope(query, key, q_weight=attn.norm_q.weight, k_weight=attn.norm_k.weight,
                             eps_q=attn.norm_q.eps, eps_k=attn.norm_k.eps, cos=cos, sin=sin)
    except ValueError:  # e.g. a projection returned another dtype or width; the op checks before it computes
        return None


def _apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor):
    # diffusers 0.42.1 WanAttnProcessor.__call__'s nested apply_rotary_emb (used when the op does not fit)
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def _diffusers_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, rotary_emb: Any):
    """diffusers 0.42.1's stretch from the projections to the rotated heads."""
    query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
    key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
    if rotary_emb is not None:
        query = _apply_rotary_emb(query, *rotary_emb)
        key = _apply_rotary_emb(key, *rotary_emb)
    return query, key


def _processor(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
    if not _covered(attn, hidden_states, encoder_hidden_states, rotary_emb):
        return FALLBACK
    module = sys.modules[_WAN]
    query, key, value = module._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
    qk: Optional[tuple] = _fused_qk(attn, query, key, rotary_emb)
    if qk is None:
        query, key = _diffusers_qk(attn, query, key, rotary_emb)
    else:
        query, key = (t.unflatten(2, (attn.heads, -1)) for t in qk)
    value = value.unflatten(2, (attn.heads, -1))
    # diffusers 0.42.1 from here on (no image context: add_k_proj is None)
    hidden_states = module.dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
        backend=self._attention_backend,
        parallel_config=(self._parallel_config if encoder_hidden_states is None else None),
    )
    hidden_states = hidden_states.flatten(2, 3)
    hidden_states = hidden_states.type_as(query)
    to_out = attn.to_out
    hidden_states = linear(to_out[0], hidden_states)
    hidden_states = dropout(to_out[1], hidden_states)
    return hidden_states
