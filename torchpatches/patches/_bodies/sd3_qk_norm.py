"""The ``sd3_qk_norm`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/sd3_qk_norm.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .._diffusers_norms import plain_diffusers_rms_norm
from .._fused_common import FALLBACK, declined, dropout, fusable, linear

_PROCESSOR = "diffusers.models.attention_processor"


def _norms_fit(attn: Any, x: torch.Tensor, joint: bool) -> bool:
    norms = (attn.norm_q, attn.norm_k) + ((attn.norm_added_q, attn.norm_added_k) if joint else ())
    return all(plain_diffusers_rms_norm(n, x) for n in norms)


def _call_ok(processor: Any, attn: Any, hidden_states: Any, encoder_hidden_states: Any) -> bool:
    # Every tensor input counts for gradients: with a frozen model and only the prompt requiring grad,
    # hidden_states needs none but the text q/k/v do.
    module = sys.modules[_PROCESSOR]
    return (
        type(attn) is module.Attention
        and getattr(processor, "_parallel_config", None) is None
        and fusable(hidden_states, (attn,), encoder_hidden_states)
        and hidden_states.dim() == 3
        and (encoder_hidden_states is None or (
            type(encoder_hidden_states) is torch.Tensor and encoder_hidden_states.dim() == 3
            and encoder_hidden_states.shape[0] == hidden_states.shape[0]))
        and _has_qk_norm(attn, encoder_hidden_states)
    )


def _has_qk_norm(attn: Any, encoder_hidden_states: Any) -> bool:
    if attn.norm_q is not None and (encoder_hidden_states is None or attn.norm_added_q is not None):
        return True
    declined("the attention has no q/k RMSNorm (qk_norm=None): nothing to fuse before attention")
    return False


def _heads(t: torch.Tensor, batch_size: int, heads: int, head_dim: int) -> torch.Tensor:
    return t.view(batch_size, -1, heads, head_dim)  # [B, S, H, D]; diffusers then transposes to [B, H, S, D]


def _fused_qkv(attn: Any, q, k, v, eq, ek, ev) -> Optional[tuple]:
    """(q, k, v) as ``[B, S_img + S_txt, H, D]`` from the op, or None if a tensor does not fit it."""
    joint = eq is not None
    if any(type(t) is not torch.Tensor or t.dtype != q.dtype for t in (q, k, v, eq, ek, ev) if t is not None):
        return None
    if not _norms_fit(attn, q, joint):
        return None
    from ...ops._qk_norm_rope import qk_norm_rope  # lazily: importing an op registers torch.library ops

    extra = dict(v=v)  # without text rows the op hands v back as given
    if joint:
        extra = dict(v=v, q_txt=eq, k_txt=ek, v_txt=ev, q_txt_weight=attn.norm_added_q.weight,
                     k_txt_weight=attn.norm_added_k.weight, eps_q_txt=attn.norm_added_q.eps,
                     eps_k_txt=attn.norm_added_k.eps)
    try:
        return qk_norm_rope(q, k, q_weight=attn.norm_q.weight, k_weight=attn.norm_k.weight, eps_q=attn.norm_q.eps,
                            eps_k=attn.norm_k.eps, text_first=False, rounding="each", **extra)
    except ValueError:  # e.g. a projection returned an odd shape; the op checks before it computes
        return None


def _diffusers_qkv(attn: Any, q, k, v, eq, ek, ev) -> tuple:
    """diffusers 0.42.1's stretch on ``[B, H, S, D]`` (used when a tensor does not fit the op)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    if eq is not None:
        eq, ek, ev = (t.transpose(1, 2) for t in (eq, ek, ev))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        q, k, v = torch.cat([q, eq], dim=2), torch.cat([k, ek], dim=2), torch.cat([v, ev], dim=2)
    return q, k, v


def _joint_attn(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
    if args or kwargs or attention_mask is not None:
        return declined("an attention mask or extra arguments to the processor")
    if not _call_ok(self, attn, hidden_states, encoder_hidden_states):
        return FALLBACK
    # diffusers 0.42.1 JointAttnProcessor2_0.__call__ with the norm/concat stretch fused.
    batch_size, image_rows = hidden_states.shape[0], hidden_states.shape[1]
    query, key, value = (linear(p, hidden_states) for p in (attn.to_q, attn.to_k, attn.to_v))
    head_dim = key.shape[-1] // attn.heads
    split = lambda t: _heads(t, batch_size, attn.heads, head_dim)  # noqa: E731
    query, key, value = split(query), split(key), split(value)
    eq = ek = ev = None
    if encoder_hidden_states is not None:
        eq = split(linear(attn.add_q_proj, encoder_hidden_states))
        ek = split(linear(attn.add_k_proj, encoder_hidden_states))
        ev = split(linear(attn.add_v_proj, encoder_hidden_states))
    qkv = _fused_qkv(attn, query, key, value, eq, ek, ev)
    if qkv is None:
        query, key, value = _diffusers_qkv(attn, query, key, value, eq, ek, ev)
    else:
        query, key, value = (t.transpose(1, 2) for t in qkv)
    hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
    hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
    hidden_states = hidden_states.to(query.dtype)
    if encoder_hidden_states is not None:
        hidden_states, encoder_hidden_states = hidden_states[:, :image_rows], hidden_states[:, image_rows:]
        if not attn.context_pre_only:
            encoder_hidden_states = linear(attn.to_add_out, encoder_hidden_states)
    to_out = attn.to_out
    hidden_states = dropout(to_out[1], linear(to_out[0], hidden_states))
    if encoder_hidden_states is not None:
        return hidden_states, encoder_hidden_states
    return hidden_states
