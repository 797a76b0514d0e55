"""The ``ltx2`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/ltx2.py``. The block's glue runs on the table-modulated block body
(``patches/_table_modulated.py``): each stream a :class:`Stream` of LTX-2's row, the two streams sequenced here (the
cross-modal attentions read both streams' norms before either residual)."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from ..._core.lazy import lazy_module
from .._fused_common import (_CALL_IMPL, _MODULE_CALL, FALLBACK, declined, dropout, fusable, linear, plain_rms_norm,
                             remembered, stock)
from .._per_step import _PerSource, _versions, _with
from .._table_modulated import Stream, Table

_LTX2 = "diffusers.models.transformers.transformer_ltx2"
_rope_ops = lazy_module("torchpatches.ops._rms_norm_rope")

#: Each stream's submodules and tables: norm1, attn1, norm2, attn2, the cross-modal norm, norm3, ff, the block's
#: table, the cross-modal table, the prompt table, the cross-attention modulation flag.
_VIDEO = ("norm1", "attn1", "norm2", "attn2", "audio_to_video_norm", "norm3", "ff", "scale_shift_table",
          "video_a2v_cross_attn_scale_shift_table", "prompt_scale_shift_table", "video_cross_attn_adaln")
_AUDIO = ("audio_norm1", "audio_attn1", "audio_norm2", "audio_attn2", "video_to_audio_norm", "audio_norm3",
          "audio_ff", "audio_scale_shift_table", "audio_a2v_cross_attn_scale_shift_table",
          "audio_prompt_scale_shift_table", "audio_cross_attn_adaln")
_NORMS = (0, 2, 4, 5)  # the positions of the norms in _VIDEO / _AUDIO
_MASKS = _PerSource()


def _ltx2() -> Any:
    return sys.modules[_LTX2]


# ---- the block glue: weightless RMSNorm + table modulation, gated residuals ----------------------------------------


def _weightless(norm: Any, width: int) -> bool:
    """A stock diffusers ``RMSNorm(width, elementwise_affine=False)`` (no weight, no bias, a number for eps): what
    ``ops.modulate``'s ``rms`` form computes."""
    if not stock(norm, sys.modules["diffusers.models.normalization"].RMSNorm):
        return False
    d, params = norm.__dict__, norm._parameters
    return (params.get("weight") is None and params.get("bias") is None and d.get("weight") is None
            and d.get("bias") is None and tuple(d.get("dim", ())) == (width,) and type(d.get("eps")) in (int, float))


def _table(module: Any, name: str, rows: int, x: torch.Tensor) -> Optional[torch.Tensor]:
    t = module._parameters.get(name)
    ok = (type(t) in (torch.Tensor, torch.nn.Parameter) and tuple(t.shape) == (rows, x.shape[-1])
          and t.dtype == x.dtype and t.device == x.device)
    return t if ok else None


def _terms(temb: Any, x: torch.Tensor, rows: int) -> Optional[tuple]:
    """``temb`` ``[B, 1 or S, rows * D]`` of x's dtype and device, as ``rows`` ``[B, 1 or S, D]`` views (what
    diffusers' ``get_mod_params`` adds to the table's rows); None where it is not."""
    B, S, D = x.shape
    if not (type(temb) is torch.Tensor and temb.dim() == 3 and temb.shape[0] == B and temb.shape[1] in (1, S)
            and temb.shape[2] == rows * D and temb.dtype == x.dtype and temb.device == x.device):
        return None
    return temb.unflatten(-1, (rows, D)).unbind(-2)


#: LTX-2's glue on the table-modulated body: diffusers' rounding after each op, weightless RMSNorms (norm2 unmodulated
#: in LTX-2.0: a modulation by zero and negative zero).
LTX2 = Table(once=False, rms=True)


class _Stream(Stream):
    """One modality through the block: ``x``, its submodules' names and its modulation vectors as (temb term, table
    row) pairs, summed by the op in its kernels (diffusers' ``table[None, None] + temb``, rounded)."""

    __slots__ = ("block", "names", "mod", "ca", "ca_gate")

    def __init__(self, block: Any, names: tuple, x: torch.Tensor, mod: tuple, ca: tuple, ca_gate: tuple) -> None:
        self.row, self.x, self.fits, self.two = LTX2, x, True, True
        self.block, self.names, self.mod, self.ca, self.ca_gate = block, names, mod, ca, ca_gate

    def module(self, i: int) -> Any:
        return self.block._modules[self.names[i]]


def _mod_pairs(block: Any, names: tuple, x: torch.Tensor, temb: Any, temb_ca: Any, temb_gate: Any) -> Optional[tuple]:
    """The stream's vectors as (term, row) pairs: the block table's 6 or 9, the cross-modal table's 4 and its gate;
    None where a tensor does not fit."""
    adaln = bool(block.__dict__.get(names[10]))
    n = 9 if adaln else 6
    table, ca_table = _table(block, names[7], n, x), _table(block, names[8], 5, x)
    terms, ca_terms, gate_terms = _terms(temb, x, n), _terms(temb_ca, x, 4), _terms(temb_gate, x, 1)
    if table is None or ca_table is None or terms is None or ca_terms is None or gate_terms is None:
        return None
    rows = table.expand(x.shape[0], 1, n, x.shape[-1]).unbind(-2)
    ca_rows = ca_table.expand(x.shape[0], 1, 5, x.shape[-1]).unbind(-2)
    return tuple(zip(terms, rows)), tuple(zip(ca_terms, ca_rows[:4])), (gate_terms[0], ca_rows[4])


def _norms_fit(block: Any, x: torch.Tensor, names: tuple) -> bool:
    children = tuple(names[i] for i in _NORMS)

    def check() -> bool:
        modules = block._modules
        return all(_weightless(modules.get(name), x.shape[-1]) for name in children)

    if remembered(block, ("ltx2", x.shape[-1]), check, children):
        return True
    declined("a block norm is not a stock weightless diffusers RMSNorm of the stream's width")
    return False


def _attend(attn: Any, y: torch.Tensor, context: Any, mask: Any, q_rope: Any, k_rope: Any) -> Any:
    """``attn(y, encoder_hidden_states=context, attention_mask=mask, query_rotary_emb=q_rope,
    key_rotary_emb=k_rope)``; for a stock ``LTX2Attention`` (no hooks, torch's own call path) what its ``forward``
    does without extra keyword arguments, without its per-call ``inspect.signature`` of the processor (nothing to
    filter). The block's target assumes ``LTX2Attention.forward`` (checked per call)."""
    cls = _ltx2().LTX2Attention
    if stock(attn, cls) and cls.__call__ is _MODULE_CALL and cls._call_impl is _CALL_IMPL:
        return attn.processor(attn, y, context, mask, q_rope, k_rope)
    return attn(y, encoder_hidden_states=context, attention_mask=mask, query_rotary_emb=q_rope,
                key_rotary_emb=k_rope)


def _self_attend(block: Any, attn: Any, y: torch.Tensor, mask: Any, rope: Any, perturbation_mask: Any,
                 all_perturbed: Any) -> Any:
    """A self-attention call as diffusers makes it: with the perturbation arguments in a perturbed-attention (STG)
    block (a module call: its processor is diffusers' ``LTX2PerturbedAttnProcessor``), else :func:`_attend`."""
    if not block.perturbed_attn:
        return _attend(attn, y, None, mask, rope, None)
    return attn(hidden_states=y, encoder_hidden_states=None, query_rotary_emb=rope, attention_mask=mask,
                perturbation_mask=perturbation_mask, all_perturbed=all_perturbed)


def _prompt(block: Any, table_name: str, temb_prompt: Any, context: Any, like: torch.Tensor) -> Any:
    """LTX-2.3's text modulation (``encoder_hidden_states * (1 + scale_text_kv) + shift_text_kv``), diffusers'
    code."""
    table = getattr(block, table_name)
    if temb_prompt is not None:
        shift, scale = block.get_mod_params(table, temb_prompt, like.size(0))
    else:
        shift, scale = table[None, None].to(device=like.device, dtype=like.dtype).unbind(dim=2)
    return context * (1 + scale) + shift


def block(self, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states, temb,
          temb_audio, temb_ca_scale_shift, temb_ca_audio_scale_shift, temb_ca_gate, temb_ca_audio_gate,
          temb_prompt=None, temb_prompt_audio=None, video_rotary_emb=None, audio_rotary_emb=None,
          ca_video_rotary_emb=None, ca_audio_rotary_emb=None, encoder_attention_mask=None,
          audio_encoder_attention_mask=None, self_attention_mask=None, audio_self_attention_mask=None,
          a2v_cross_attention_mask=None, v2a_cross_attention_mask=None, use_a2v_cross_attention=True,
          use_v2a_cross_attention=True, perturbation_mask=None, all_perturbed=None):
    x, xa = hidden_states, audio_hidden_states
    if not (type(xa) is torch.Tensor and x.dim() == 3 and xa.dim() == 3
            and fusable(x, (self,), xa, encoder_hidden_states, audio_encoder_hidden_states)
            and xa.dtype == x.dtype and xa.device == x.device and xa.shape[0] == x.shape[0]
            and _norms_fit(self, x, _VIDEO) and _norms_fit(self, xa, _AUDIO)):
        return FALLBACK
    video = _mod_pairs(self, _VIDEO, x, temb, temb_ca_scale_shift, temb_ca_gate)
    audio = _mod_pairs(self, _AUDIO, xa, temb_audio, temb_ca_audio_scale_shift, temb_ca_audio_gate)
    if video is None or audio is None:
        declined("a modulation table or temb is not of the activations' dtype and form")
        return FALLBACK
    # diffusers 0.42.1 LTX2VideoTransformerBlock.forward, every module called in its order; the glue between them
    # (weightless RMSNorm + modulation, gated residuals: shift, scale, gate = rows 0, 1, 2 of the block's table,
    # 3, 4, 5 for the feed-forward, 6, 7, 8 for LTX-2.3's text query) in ops.modulate's rms form, each residual
    # fused with the norm that follows it.
    v, a = _Stream(self, _VIDEO, x, *video), _Stream(self, _AUDIO, xa, *audio)
    # 1. self-attention
    y = v.step(None, None, v.mod[1], v.mod[0], v.module(0))
    v_out = _self_attend(self, self.attn1, y, self_attention_mask, video_rotary_emb, perturbation_mask, all_perturbed)
    y = a.step(None, None, a.mod[1], a.mod[0], a.module(0))
    a_out = _self_attend(self, self.audio_attn1, y, audio_self_attention_mask, audio_rotary_emb, perturbation_mask,
                         all_perturbed)
    # 2. text cross-attention (LTX-2.3: the query modulated, the text too)
    context, audio_context = encoder_hidden_states, audio_encoder_hidden_states
    if self.cross_attn_adaln:
        context = _prompt(self, "prompt_scale_shift_table", temb_prompt, context, x)
        audio_context = _prompt(self, "audio_prompt_scale_shift_table", temb_prompt_audio, audio_context, xa)
    outs = []
    for s, out, attn, ctx, mask in ((v, v_out, self.attn2, context, encoder_attention_mask),
                                    (a, a_out, self.audio_attn2, audio_context, audio_encoder_attention_mask)):
        q_mod = len(s.mod) == 9
        y = s.step(s.mod[2], out, s.mod[7] if q_mod else None, s.mod[6] if q_mod else None, s.module(2))
        outs.append(_attend(attn, y, ctx, mask, None, None))
    # 3. audio-to-video and video-to-audio cross-attention: per stream rows 0, 1 of the cross-modal table modulate
    # the a2v inputs, rows 2, 3 the v2a inputs; each text residual fused with the cross-modal norm
    cross = use_a2v_cross_attention or use_v2a_cross_attention
    mods = []
    for s, out in ((v, outs[0]), (a, outs[1])):
        gate = s.mod[8] if len(s.mod) == 9 else None
        if not cross:
            s.step(gate, out)
            mods.append((None, None))
            continue
        first = (0, 1) if use_a2v_cross_attention else (2, 3)
        m1 = s.step(gate, out, s.ca[first[0]], s.ca[first[1]], s.module(4))
        both = use_a2v_cross_attention and use_v2a_cross_attention
        m2 = s.step(None, None, s.ca[2], s.ca[3], s.module(4)) if both else None
        mods.append((m1, m2) if use_a2v_cross_attention else (None, m1))
    (v_a2v, v_v2a), (a_a2v, a_v2a) = mods
    v_cross = a_cross = None
    if use_a2v_cross_attention:
        v_cross = _attend(self.audio_to_video_attn, v_a2v, a_a2v, a2v_cross_attention_mask, ca_video_rotary_emb,
                          ca_audio_rotary_emb)
    if use_v2a_cross_attention:
        a_cross = _attend(self.video_to_audio_attn, a_v2a, v_v2a, v2a_cross_attention_mask, ca_audio_rotary_emb,
                          ca_video_rotary_emb)
    # 4. feed-forward: the cross-modal residual fused with norm3 + modulation, then the last gated residual
    for s, out in ((v, v_cross), (a, a_cross)):
        y = s.step(s.ca_gate if out is not None else None, out, s.mod[4], s.mod[3], s.module(5))
        s.step(s.mod[5], s.module(6)(y))
    return v.x, a.x


# ---- the attention processor: q/k RMSNorm across heads + split RoPE in one launch ----------------------------------


def _tables(rope: Any, x: torch.Tensor) -> Optional[tuple]:
    """LTX-2's split ``(cos, sin)``: fp32 ``[B, H, S, D/2]`` for x's rows, ``H * D`` its width; None otherwise."""
    if not (isinstance(rope, tuple) and len(rope) == 2):
        return None
    cos, sin = rope
    if not (type(cos) is torch.Tensor and type(sin) is torch.Tensor and cos.dim() == 4
            and cos.dtype == sin.dtype == torch.float32 and cos.device == sin.device == x.device
            and cos.shape == sin.shape):
        return None
    B, H, S, R = cos.shape
    return rope if B == x.shape[0] and S == x.shape[1] and R > 0 and H * 2 * R == x.shape[2] else None


def _normed(attn: Any, query: Any, key: Any, q_rope: Any, k_rope: Any) -> Optional[list]:
    """q and k normalized across heads (``torch.nn.RMSNorm``) and, with tables, rotated (split RoPE), in one
    launch of ``ops.rms_norm_rope``; None where something does not fit."""
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and query.dim() == 3 and key.dim() == 3
            and key.dtype == query.dtype and key.shape[0] == query.shape[0] and key.shape[2] == query.shape[2]):
        return None
    modules = attn._modules
    norm_q, norm_k = modules["norm_q"], modules["norm_k"]
    if not (plain_rms_norm(norm_q, query) and plain_rms_norm(norm_k, key)):
        return None
    q_tables = k_tables = None
    if q_rope is not None:
        q_tables = _tables(q_rope, query) if attn.rope_type == "split" else None
        k_tables = _tables(k_rope if k_rope is not None else q_rope, key) if q_tables is not None else None
        if k_tables is None or k_tables[0].shape[1] != q_tables[0].shape[1] \
                or k_tables[0].shape[3] != q_tables[0].shape[3]:
            declined("RoPE that is not LTX-2's split fp32 [B, H, S, D/2] tables of the tokens' length")
            return None
    return _rope_ops().prechecked_split(query, key, norm_q.weight, norm_k.weight, (norm_q.eps, norm_k.eps),
                                        q_tables, k_tables)


def _mask(attn: Any, mask: torch.Tensor, length: int, batch: int) -> torch.Tensor:
    """diffusers' ``attn.prepare_attention_mask(mask, length, batch)`` viewed as ``[B, H, -1, L]``, made once per
    mask tensor (the forward's per-step text bias) and head count instead of in every text cross-attention call, for
    a stock ``LTX2Attention`` (whose ``prepare_attention_mask`` reads nothing else of it)."""
    key = None
    if type(attn) is _ltx2().LTX2Attention and type(mask) is torch.Tensor:
        key = _with(_versions(mask), length, batch, attn.heads)
        cached = _MASKS.get(mask, key)
        if cached is not None:
            return cached
    prepared = attn.prepare_attention_mask(mask, length, batch)
    prepared = prepared.view(batch, attn.heads, -1, prepared.shape[-1])
    return prepared if key is None else _MASKS.put(mask, key, prepared)


def processor(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
              key_rotary_emb=None):
    source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    if not (type(source) is torch.Tensor and hidden_states.dim() == 3 and source.dim() == 3
            and fusable(hidden_states, (attn,), source)):
        return FALLBACK
    module = _ltx2()
    # diffusers 0.42.1 LTX2AudioVideoAttnProcessor.__call__; the q/k norms and the split RoPE through
    # ops.rms_norm_rope, the mask prepared once per step.
    batch_size, sequence_length, _ = source.shape
    if attention_mask is not None:
        attention_mask = _mask(attn, attention_mask, sequence_length, batch_size)
    if attn.to_gate_logits is not None:
        gate_logits = linear(attn.to_gate_logits, hidden_states)
    query = linear(attn.to_q, hidden_states)
    key = linear(attn.to_k, source)
    value = linear(attn.to_v, source)

    qk = _normed(attn, query, key, query_rotary_emb, key_rotary_emb)
    if qk is None:  # diffusers' code for this stretch
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if query_rotary_emb is not None:
            rope = (module.apply_interleaved_rotary_emb if attn.rope_type == "interleaved"
                    else module.apply_split_rotary_emb if attn.rope_type == "split" else None)
            if rope is not None:
                query = rope(query, query_rotary_emb)
                key = rope(key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
    else:
        query, key = qk

    query = query.unflatten(2, (attn.heads, -1))
    key = key.unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    hidden_states = module.dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
        backend=self._attention_backend, parallel_config=self._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    hidden_states = hidden_states.to(query.dtype)

    if attn.to_gate_logits is not None:
        hidden_states = hidden_states.unflatten(2, (attn.heads, -1))  # [B, T, H, D]
        gates = 2.0 * torch.sigmoid(gate_logits)  # [B, T, H]
        hidden_states = hidden_states * gates.unsqueeze(-1)
        hidden_states = hidden_states.flatten(2, 3)

    hidden_states = linear(attn.to_out[0], hidden_states)
    return dropout(attn.to_out[1], hidden_states)
