"""The ``wan_qk_norm_rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/wan_qk_norm_rope.py``."""
from __future__ import annotations

from typing import Any

import torch

from .._fused_common import FALLBACK, fusable, stock
from .._joint_attention import Joint, attend

#: WanAttnProcessor: q/k norms across heads, Wan's rows in self-attention, the text as k and v in cross-attention.
_WAN_ATTENTION = Joint("diffusers.models.transformers.transformer_wan", rope="wan_rows", norm_span="inner",
                       kv_from_context=True)


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


def _processor(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
    if not _covered(attn, hidden_states, encoder_hidden_states, rotary_emb):
        return FALLBACK
    return attend(_WAN_ATTENTION, self, attn, hidden_states, encoder_hidden_states, rotary_emb,
                  lambda rows, dtype: attention_mask)
