"""The ``kandinsky6`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/kandinsky6.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

import torch

from ..._core.lazy import lazy_module
from .._diffusers_norms import norms_fit
from .._fused_common import FALLBACK, declined, fusable, linear, plain_layer_norm, stock
from .._modulate_calls import _rows_fit, _vectors_fit, modulate_ops
from .._per_step import _PerSource, _versions

_K6 = "diffusers.models.transformers.transformer_kandinsky6"
_qk_ops = lazy_module("torchpatches.ops._qk_norm_rope")
#: ``torch.nn.RMSNorm(eps=None)``: torch's kernels then add the epsilon of the compute type, fp32's for bf16, fp16 and
#: fp32 inputs (seen on the CPU, torch 2.13, and on an H200, torch 2.11), not ``torch.finfo(x.dtype).eps`` as the
#: docs say (0.0078125 in bf16).
_DEFAULT_EPS = torch.finfo(torch.float32).eps
_TABLES = _PerSource()


def _k6() -> Any:
    return sys.modules[_K6]


# ---- the block glue: fp32 LayerNorm + modulation and gated residuals, each rounded once -----------------------------


def _modulated(norm: Any, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_scale_shift(norm(x.float()), x, scale, shift)``: one pass when everything fits."""
    if _vectors_fit(x, scale, shift, rounding="once") and plain_layer_norm(norm, x.shape[-1]):
        return modulate_ops().prechecked(x, None, None, scale, shift, norm.eps, once=True)[0]
    return _k6().apply_scale_shift(norm(x.float()), x, scale, shift)


def _gated(x: torch.Tensor, out: Any, gate: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_gate_sum(x, out, gate)`` (``(x.float() + gate.float() * out.float()).to(x.dtype)``)."""
    if _rows_fit(x, out) and _vectors_fit(x, gate, rounding="once"):
        return modulate_ops().prechecked(x, gate, out, None, None, None, once=True)[0]
    return _k6().apply_gate_sum(x, out, gate).type_as(x)


def _gated_modulated(x: torch.Tensor, out: Any, gate: torch.Tensor, norm: Any, scale: torch.Tensor,
                     shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated residual and the next norm's modulation (:func:`_gated`, then :func:`_modulated`) in one pass."""
    if _rows_fit(x, out) and _vectors_fit(x, gate, scale, shift, rounding="once") \
            and plain_layer_norm(norm, x.shape[-1]):
        h, normed = modulate_ops().prechecked(x, gate, out, scale, shift, norm.eps, once=True)
        return h, normed
    x = _gated(x, out, gate)
    return x, _modulated(norm, x, scale, shift)


def _rows(x: Any) -> bool:
    return type(x) is torch.Tensor and x.dim() == 3


def _attentions(dec: Any, x: torch.Tensor, t: torch.Tensor, rope: Any, text: Any, attn_mask: Any) -> tuple:
    """One stream's self-attention and text cross-attention, as diffusers runs them (the self-attention's gated
    residual fused with the cross-attention's LayerNorm + modulation): ``(x, pre_ca, out_t, gate, ff_p)``."""
    sa_p, ca_p, ff_p = torch.chunk(dec.visual_modulation(t), 3, dim=-1)
    shift, scale, gate = torch.chunk(sa_p, 3, dim=-1)
    out = dec.self_attention(_modulated(dec.self_attention_norm, x, scale, shift), rotary_emb=rope)
    shift, scale, gate_ca = torch.chunk(ca_p, 3, dim=-1)
    x, pre_ca = _gated_modulated(x, out, gate, dec.cross_attention_norm, scale, shift)
    return x, pre_ca, dec.cross_attention(pre_ca, encoder_hidden_states=text, attn_mask=attn_mask), gate_ca, ff_p


def decoder_block(self, vis, aud, text_v, text_a, time_embed, vis_rope, aud_rope, attn_mask=None):
    if not (_rows(vis) and (aud is None or _rows(aud)) and isinstance(time_embed, tuple) and len(time_embed) == 2
            and fusable(vis, (self,), aud, text_v, text_a, *time_embed)):
        return FALLBACK
    # diffusers 0.42.1 Kandinsky6FusedTransformerDecoderBlock.forward (both streams: video, video + audio), every
    # module called as there; each gated residual fused with the LayerNorm + modulation that follows it.
    video, audio = self.video_dec_block, self.audio_dec_block
    t_v, t_a = time_embed
    vis, vis_pre_ca, vis_out_t, gate_v, ff_p = _attentions(video, vis, t_v, vis_rope, text_v, attn_mask)

    if aud is not None:
        aud, aud_pre_ca, aud_out_t, gate_a, ff_p_a = _attentions(audio, aud, t_a, aud_rope, text_a, attn_mask)
        t_va_mod = t_a if not self.fix_modulation else t_v
        t_av_mod = t_v if not self.fix_modulation else t_a
        va_params = self.va_modulation(t_va_mod)
        av_params = self.av_modulation(t_av_mod)
        if self.cross_gates:
            va_shift, va_scale, va_gate = torch.split(va_params, [self.model_dim, self.model_dim, self.model_dim_a],
                                                      dim=-1)
            av_shift, av_scale, av_gate = torch.split(av_params, [self.model_dim_a, self.model_dim_a, self.model_dim],
                                                      dim=-1)
        else:
            va_shift, va_scale, va_gate = torch.chunk(va_params, 3, dim=-1)
            av_shift, av_scale, av_gate = torch.chunk(av_params, 3, dim=-1)
        aud, aud_for_av = _gated_modulated(aud, aud_out_t, gate_a, self.av_normalization, av_scale, av_shift)
        vis, vis_for_va = _gated_modulated(vis, vis_out_t, gate_v, self.va_normalization, va_scale, va_shift)
        rq_v = vis_rope if self.ca_rope else None
        rk_a = aud_rope if self.ca_rope else None
        vis_from_aud = self.va_cross_attention(vis_for_va, encoder_hidden_states=aud_pre_ca, rope_q=rq_v, rope_kv=rk_a)
        aud_from_vis = self.av_cross_attention(aud_for_av, encoder_hidden_states=vis_pre_ca, rope_q=rk_a, rope_kv=rq_v)
        vis_gate = va_gate if not self.cross_gates else av_gate
        aud_gate = av_gate if not self.cross_gates else va_gate
        shift, scale, gate = torch.chunk(ff_p_a, 3, dim=-1)
        aud, aud_ff_in = _gated_modulated(aud, aud_from_vis, aud_gate, audio.feed_forward_norm, scale, shift)
        last_out, last_gate = vis_from_aud, vis_gate
    else:
        last_out, last_gate = vis_out_t, gate_v

    shift, scale, gate = torch.chunk(ff_p, 3, dim=-1)
    vis, vis_ff_in = _gated_modulated(vis, last_out, last_gate, video.feed_forward_norm, scale, shift)
    vis = _gated(vis, video.feed_forward(vis_ff_in), gate)
    if aud is not None:
        shift, scale, gate = torch.chunk(ff_p_a, 3, dim=-1)
        aud = _gated(aud, audio.feed_forward(aud_ff_in), gate)
    return vis, aud


def encoder_block(self, x, time_embed, rope, attn_mask=None):
    if not (_rows(x) and fusable(x, (self,), time_embed)):
        return FALLBACK
    # diffusers 0.42.1 Kandinsky6TransformerEncoderBlock.forward, the glue through the modulate op where it fits.
    sa_params, ff_params = torch.chunk(self.text_modulation(time_embed), 2, dim=-1)
    shift, scale, gate = torch.chunk(sa_params, 3, dim=-1)
    out = self.attn(_modulated(self.attn_norm, x, scale, shift), rotary_emb=rope, attn_mask=attn_mask)
    shift, scale, gate_ff = torch.chunk(ff_params, 3, dim=-1)
    x, normed = _gated_modulated(x, out, gate, self.feed_forward_norm, scale, shift)
    return _gated(x, self.feed_forward(normed), gate_ff)


# ---- the attention processor: q/k RMSNorm + the 2x2-matrix RoPE in one launch --------------------------------------


def matrix_tables(rope: Any, rows: int, head_dim: int, device: torch.device
                  ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Kandinsky's fp32 rotation matrices ``[S, 1, D/2, 2, 2]`` as ``ops.qk_norm_rope``'s interleaved fp32 ``cos`` /
    ``sin`` tables ``[S, D]``: pair ``i`` of a row is ``(m00 * x0 + m01 * x1, m10 * x0 + m11 * x1)`` in diffusers
    (``(rope * x).sum(-1)``), ``(x0 * cos[2i] - x1 * sin[2i], x1 * cos[2i+1] + x0 * sin[2i+1])`` in the op, so
    ``cos = (m00, m11)`` and ``sin = (-m01, m10)`` per pair: the same products and sums, exactly, for any matrix (no
    assumption that it is a rotation). Cached per source tensor as ``_per_step``'s tables (one build per step and
    table instead of one per block); None where ``rope`` is not such a tensor of ``rows`` rows on ``device``."""
    if not (type(rope) is torch.Tensor and rope.dtype == torch.float32 and rope.device == device
            and tuple(rope.shape) == (rows, 1, head_dim // 2, 2, 2)):
        return None
    key = _versions(rope)
    tables = _TABLES.get(rope, key)
    if tables is None:
        m = rope[:, 0]
        tables = _TABLES.put(rope, key, torch.stack([torch.stack([m[..., 0, 0], m[..., 1, 1]], dim=-1),
                                                     torch.stack([-m[..., 0, 1], m[..., 1, 0]], dim=-1)])
                             .reshape(2, rows, head_dim))
    return tables[0], tables[1]


def _weight_fits(norm: Any, x: torch.Tensor) -> bool:
    """A stock ``torch.nn.RMSNorm(head_dim)`` with a weight of x's dtype and device (torch's one-rounding kernel)."""
    if not stock(norm, torch.nn.RMSNorm):
        return False
    weight = norm._parameters.get("weight")
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and tuple(norm.normalized_shape) == (x.shape[-1],)
            and weight.shape == (x.shape[-1],) and weight.dtype == x.dtype and weight.device == x.device)


def _eps(norm: Any) -> float:
    return _DEFAULT_EPS if norm.eps is None else float(norm.eps)


def _tables_for(rope: Any, x: torch.Tensor) -> Any:
    """(cos, sin) for ``x``'s rows, (None, None) without RoPE, or None where ``rope`` does not fit."""
    if rope is None:
        return None, None
    return matrix_tables(rope, x.shape[1], x.shape[-1], x.device)


def _normed(attn: Any, query: torch.Tensor, key: torch.Tensor, rope_q: Any, rope_k: Any) -> Optional[tuple]:
    """q and k normalized (``torch.nn.RMSNorm``) and rotated, through ``ops.qk_norm_rope``: one launch where they
    share length and table (self-attention), one each otherwise; None where something does not fit."""
    D = query.shape[-1]
    if not (query.dim() == 4 and key.dim() == 4 and key.dtype == query.dtype and key.shape[-1] == D
            and key.shape[0] == query.shape[0] and (D % 2 == 0 or (rope_q is None and rope_k is None))):
        return None
    if not norms_fit(attn, query, ("query_norm", "key_norm"), _weight_fits):
        return None
    tq, tk = _tables_for(rope_q, query), _tables_for(rope_k, key)
    if tq is None or tk is None:
        declined("a rotary table that is not fp32 [S, 1, D/2, 2, 2] of the tokens' length")
        return None
    modules = attn._modules
    norm_q, norm_k = modules["query_norm"], modules["key_norm"]
    ops = _qk_ops()
    eps_q, eps_k = _eps(norm_q), _eps(norm_k)
    if rope_q is rope_k and query.shape == key.shape:
        q, k, _ = ops.prechecked(query, key, *tq, norm_q.weight, norm_k.weight, (eps_q, eps_k, eps_q, eps_k))
        return q, k
    q = ops.prechecked(query, None, *tq, norm_q.weight, None, (eps_q,) * 4)[0]
    k = ops.prechecked(key, None, *tk, norm_k.weight, None, (eps_k,) * 4)[0]
    return q, k


def processor(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, rotary_emb_kv=None,
              attn_mask=None):
    source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    if not (_rows(hidden_states) and _rows(source) and fusable(hidden_states, (attn,), source)):
        return FALLBACK
    module = _k6()
    # diffusers 0.42.1 Kandinsky6AttnProcessor.__call__; the norms and RoPE through ops.qk_norm_rope.
    query = linear(attn.to_query, hidden_states)
    key = linear(attn.to_key, source)
    value = linear(attn.to_value, source)

    query = query.reshape(*query.shape[:-1], attn.num_heads, -1)
    key = key.reshape(*key.shape[:-1], attn.num_heads, -1)
    value = value.reshape(*value.shape[:-1], attn.num_heads, -1)
    normed = _normed(attn, query, key, rotary_emb, rotary_emb_kv)
    if normed is None:  # diffusers' code for this stretch
        query = attn.query_norm(query)
        key = attn.key_norm(key)
        if rotary_emb is not None:
            query = module.apply_rotary(query, rotary_emb).to(dtype=query.dtype)
        if rotary_emb_kv is not None:
            key = module.apply_rotary(key, rotary_emb_kv).to(dtype=key.dtype)
    else:
        query, key = normed

    output = module.dispatch_attention_fn(query, key, value, attn_mask=attn_mask, backend=self._attention_backend,
                                          parallel_config=self._parallel_config)
    return linear(attn.out_layer, output.flatten(-2, -1))
