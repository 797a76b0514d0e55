"""The ``rms_sandwich_qk_norm_rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/rms_sandwich_qk_norm_rope.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from ..._core.lazy import lazy_module
from .._diffusers_norms import diffusers_rms_norms_fit
from .._fused_common import FALLBACK, declined, dropout, fusable, linear

_ZIMAGE = "diffusers.models.transformers.transformer_z_image"
_tables = lazy_module("torchpatches.patches._per_step")


def _rotate(x_in: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``ZSingleStreamAttnProcessor``'s nested ``apply_rotary_emb`` (autocast is off here)."""
    x = torch.view_as_complex(x_in.float().reshape(*x_in.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(2)
    x_out = torch.view_as_real(x * freqs_cis).flatten(3)
    return x_out.type_as(x_in)


_QK_NORMS = ("norm_q", "norm_k")


def _fused_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, freqs_cis: Any) -> Optional[tuple]:
    """(q, k) normalized and rotated by the op, or None where a tensor does not fit it. The PyTorch tier (CPU with a
    forced tier) has the op normalize only, then rotates with diffusers' complex multiply (its bits: see
    ``patches/_joint_attention._fused_qkv``)."""
    if type(key) is not torch.Tensor or key.shape != query.shape or key.dtype != query.dtype \
            or query.shape[-1] % 2 or not diffusers_rms_norms_fit(attn, query, _QK_NORMS):
        return None
    tables = _tables().complex_tables(freqs_cis, query.shape[1], query.shape[-1], query.device)
    if tables is None:
        declined("freqs_cis is not complex64 [B, S, D/2] of the sequence's length")
        return None
    from ...ops._qk_norm_rope import qk_norm_rope  # lazily: importing an op registers torch.library ops
    from ...ops._runtime.tiers import choose_tier

    norm_q, norm_k = attn.norm_q, attn.norm_k
    try:
        tier = choose_tier(query.device.type, None)  # never under autograd: fusable() leaves such calls to diffusers
        q, k, _ = qk_norm_rope(query, key, *(tables if tier != "torch" else (None, None)), q_weight=norm_q.weight,
                               k_weight=norm_k.weight, eps_q=norm_q.eps, eps_k=norm_k.eps, rounding="each",
                               tier=tier)
    except ValueError:  # a batch the tables do not have, a forced tier that cannot run: checked before computing
        return None
    if tier == "torch":
        q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
    return q, k


def zimage(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
    if freqs_cis is None or not (fusable(hidden_states, (attn,), freqs_cis) and hidden_states.dim() == 3):
        return FALLBACK
    module = sys.modules[_ZIMAGE]
    # diffusers 0.42.1 ZSingleStreamAttnProcessor.__call__, with the q/k stretch fused.
    query = linear(attn.to_q, hidden_states)
    key = linear(attn.to_k, hidden_states)
    value = linear(attn.to_v, hidden_states)

    query = query.unflatten(-1, (attn.heads, -1))
    key = key.unflatten(-1, (attn.heads, -1))
    value = value.unflatten(-1, (attn.heads, -1))

    qk = _fused_qk(attn, query, key, freqs_cis)
    if qk is None:
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query, key = _rotate(query, freqs_cis), _rotate(key, freqs_cis)
    else:
        query, key = qk

    dtype = query.dtype
    query, key = query.to(dtype), key.to(dtype)
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask[:, None, None, :]
    hidden_states = module.dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
        backend=self._attention_backend, parallel_config=self._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    hidden_states = hidden_states.to(dtype)
    to_out = attn.to_out
    output = linear(to_out[0], hidden_states)
    if len(to_out) > 1:
        output = dropout(to_out[1], output)
    return output


_IDEOGRAM4 = "diffusers.models.transformers.transformer_ideogram4"


def _tables_fit(q: torch.Tensor, image_rotary_emb: Any) -> bool:
    """Ideogram 4's ``(cos, sin)``: plain ``[B, L, D]`` tensors of q's dtype and device (the model casts them)."""
    if not isinstance(image_rotary_emb, tuple) or len(image_rotary_emb) != 2:
        return False
    shape = (q.shape[0], q.shape[1], q.shape[3])
    return all(type(t) is torch.Tensor and t.dtype == q.dtype and t.device == q.device and tuple(t.shape) == shape
               for t in image_rotary_emb)


def _fused_half(attn: Any, query: torch.Tensor, key: torch.Tensor, image_rotary_emb: Any) -> Optional[tuple]:
    """(q, k) normalized and rotated (half-split pairs, each op rounding, as Ideogram 4's processor) by the op, or
    None where a tensor does not fit it."""
    if type(key) is not torch.Tensor or key.shape != query.shape or key.dtype != query.dtype \
            or query.shape[-1] % 2 or not diffusers_rms_norms_fit(attn, query, _QK_NORMS):
        return None
    if not _tables_fit(query, image_rotary_emb):
        declined("image_rotary_emb is not (cos, sin) [B, L, D] of the activations' dtype")
        return None
    from ...ops._qk_norm_rope import qk_norm_rope  # lazily: importing an op registers torch.library ops

    norm_q, norm_k = attn.norm_q, attn.norm_k
    cos, sin = image_rotary_emb
    try:
        q, k, _ = qk_norm_rope(query, key, cos, sin, q_weight=norm_q.weight, k_weight=norm_k.weight, eps_q=norm_q.eps,
                               eps_k=norm_k.eps, rounding="each", rope="half_each")
    except ValueError:  # a forced tier that cannot run: checked before computing
        return None
    return q, k


def ideogram4(self, attn, hidden_states, attention_mask, image_rotary_emb):
    if not (fusable(hidden_states, (attn,)) and hidden_states.dim() == 3):
        return FALLBACK
    module = sys.modules[_IDEOGRAM4]
    # diffusers 0.42.1 Ideogram4AttnProcessor.__call__, with the q/k stretch fused.
    query = linear(attn.to_q, hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
    key = linear(attn.to_k, hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
    value = linear(attn.to_v, hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))

    qk = _fused_half(attn, query, key, image_rotary_emb)
    if qk is None:
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        cos, sin = image_rotary_emb
        cos = cos.unsqueeze(2)
        sin = sin.unsqueeze(2)
        query = (query * cos) + (module._rotate_half(query) * sin)
        key = (key * cos) + (module._rotate_half(key) * sin)
    else:
        query, key = qk

    hidden_states = module.dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
        parallel_config=self._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    return linear(attn.to_out[0], hidden_states)
