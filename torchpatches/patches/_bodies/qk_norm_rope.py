"""The ``qk_norm_rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/qk_norm_rope.py``."""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from ..._core.lazy import lazy_module
from .._fused_common import (FALLBACK, FLOAT_DTYPES, dropout, fusable, linear, pattern_on, plain_rms_norm,
                             remembered, stock)

_FLUX = "diffusers.models.transformers.transformer_flux"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"


def _rotary_fits(image_rotary_emb: Any, x: torch.Tensor, rows: int) -> bool:
    if not isinstance(image_rotary_emb, (tuple, list)) or len(image_rotary_emb) != 2:
        return False
    for t in image_rotary_emb:
        if type(t) is not torch.Tensor or t.dtype != torch.float32 or t.device != x.device:
            return False
        if tuple(t.shape) != (rows, x.shape[-1]) or t.stride(-1) != 1:
            return False
    return True


def _common_ok(attn: Any, hidden_states: Any, image_rotary_emb: Any,
               encoder_hidden_states: Any = None) -> bool:
    # Every tensor input counts for gradients: with a frozen model and only the prompt requiring grad
    # (prompt tuning), hidden_states needs none, but the text q/k/v do.
    rotary = tuple(image_rotary_emb) if isinstance(image_rotary_emb, (tuple, list)) else (image_rotary_emb,)
    return (
        image_rotary_emb is not None
        and fusable(hidden_states, (attn,), encoder_hidden_states, *(t for t in rotary if isinstance(t, torch.Tensor)))
        and hidden_states.dim() == 3
    )


_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def _norms_ok(attn: Any, x: torch.Tensor, joint: bool) -> bool:
    """Stock RMSNorms of x's dtype, device and width: decided once per attention module and that signature
    while the norms are the same objects in the same state (``remembered``)."""
    def check() -> bool:
        norms = (attn.norm_q, attn.norm_k) + ((attn.norm_added_q, attn.norm_added_k) if joint else ())
        return all(plain_rms_norm(norm, x) for norm in norms)

    return remembered(attn, (x.dtype, x.device, x.shape[-1], joint), check, _NORMS)


def _split_heads(attn: Any, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.unflatten(-1, (-1, attn.head_dim)) for t in tensors]


def _projections_fit(x: torch.Tensor, group: tuple) -> bool:
    """Each ``[B, S, H, D]`` projection of a group is a plain tensor of ``x``'s dtype and device, of one shape,
    with ``x``'s batch, heads and head dim, and no expanded dim (two outputs in one place): what
    ``ops.qk_norm_rope`` checks, checked here so the pattern can call its ``prechecked`` entry."""
    shape = group[0].shape
    if len(shape) != 4 or shape[0] != x.shape[0] or shape[2:] != x.shape[2:]:
        return False
    for t in group:
        if type(t) is not torch.Tensor or t.dtype != x.dtype or t.device != x.device or t.shape != shape:
            return False
        for size, stride in zip(t.shape, t.stride()):
            if stride == 0 and size > 1:
                return False
    return True


#: ``torchpatches.ops.qk_norm_rope``, imported at the first fused call (it registers torch.library ops).
_qk_ops = lazy_module("torchpatches.ops._qk_norm_rope")


def _fused_qkv(attn: Any, query, key, value, encoder_query, encoder_key, encoder_value, image_rotary_emb, joint):
    """None if a tensor does not fit (the caller then finishes with diffusers' code), else (q, k, v)."""
    if any(type(t) is not torch.Tensor for t in (query, key, value)):
        return None
    query, key, value = _split_heads(attn, query, key, value)
    if joint:
        if any(type(t) is not torch.Tensor for t in (encoder_query, encoder_key, encoder_value)):
            return None
        encoder_query, encoder_key, encoder_value = _split_heads(attn, encoder_query, encoder_key, encoder_value)
    x = query
    if x.dtype not in FLOAT_DTYPES or x.shape[-1] % 2 or not _projections_fit(x, (query, key, value)):
        return None  # the head dim must be even for interleaved RoPE
    if joint and not _projections_fit(x, (encoder_query, encoder_key, encoder_value)):
        return None
    rows = query.shape[1] + (encoder_query.shape[1] if joint else 0)
    if not (_rotary_fits(image_rotary_emb, query, rows) and _norms_ok(attn, query, joint)):
        return None
    cos, sin = image_rotary_emb
    modules = attn._modules  # the norms, read from the dict (Module.__getattr__ costs a microsecond a lookup)
    norm_q, norm_k = modules["norm_q"], modules["norm_k"]
    weights = dict(q_weight=norm_q._parameters["weight"], k_weight=norm_k._parameters["weight"])
    try:  # eps is not in the remembered state: set to None (RMSNorm's default) after the verdict, diffusers' code
        eps = (float(norm_q.eps), float(norm_k.eps))
        if joint:
            norm_qt, norm_kt = modules["norm_added_q"], modules["norm_added_k"]
            weights.update(q_txt_weight=norm_qt._parameters["weight"], k_txt_weight=norm_kt._parameters["weight"],
                           v=value, q_txt=encoder_query, k_txt=encoder_key, v_txt=encoder_value)
            eps += (float(norm_qt.eps), float(norm_kt.eps))
        else:
            eps += eps
    except TypeError:
        return None
    q, k, v = _qk_ops().prechecked(query, key, cos, sin, eps=eps, **weights)
    return q, k, (v if joint else value)


def _diffusers_qkv(attn: Any, query, key, value, encoder_query, encoder_key, encoder_value, image_rotary_emb, joint,
                   apply_rotary_emb: Callable[..., Any]):
    """The original processors' code for the same stretch (used when a tensor does not fit the op)."""
    query, key, value = _split_heads(attn, query, key, value)
    query = attn.norm_q(query)
    key = attn.norm_k(key)
    if joint:
        encoder_query, encoder_key, encoder_value = _split_heads(attn, encoder_query, encoder_key, encoder_value)
        encoder_query = attn.norm_added_q(encoder_query)
        encoder_key = attn.norm_added_k(encoder_key)
        query = torch.cat([encoder_query, query], dim=1)
        key = torch.cat([encoder_key, key], dim=1)
        value = torch.cat([encoder_value, value], dim=1)
    if image_rotary_emb is not None:
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    return query, key, value


def _projections(module: Any, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor]):
    """diffusers 0.42.1's ``_get_qkv_projections`` of the processor's module (FLUX.1 and FLUX.2 have the same; both
    verified) with each projection called by :func:`linear`; after ``fuse_qkv_projections()``, diffusers' own."""
    if attn.fused_projections:
        return module._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
    query = linear(attn.to_q, hidden_states)
    key = linear(attn.to_k, hidden_states)
    value = linear(attn.to_v, hidden_states)
    encoder_query = encoder_key = encoder_value = None
    if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
        encoder_query = linear(attn.add_q_proj, encoder_hidden_states)
        encoder_key = linear(attn.add_k_proj, encoder_hidden_states)
        encoder_value = linear(attn.add_v_proj, encoder_hidden_states)
    return query, key, value, encoder_query, encoder_key, encoder_value


def _qkv(module: Any, attn: Any, hidden_states, encoder_hidden_states, image_rotary_emb, joint: bool):
    projections = _projections(module, attn, hidden_states, encoder_hidden_states)
    fused = _fused_qkv(attn, *projections, image_rotary_emb, joint)
    if fused is not None:
        return fused
    return _diffusers_qkv(attn, *projections, image_rotary_emb, joint, module.apply_rotary_emb)


def _joint_ok(attn: Any, encoder_hidden_states: Optional[torch.Tensor]) -> Optional[bool]:
    """True (joint), False (self-attention only) or None (a form the original handles differently)."""
    if attn.added_kv_proj_dim is None:
        return False
    if encoder_hidden_states is None:
        return None  # the original would fail on None text projections: let it say so
    return True


def _attend(processor: Any, query, key, value, attention_mask, module: Any) -> torch.Tensor:
    """diffusers 0.42.1's attention call of the FLUX processors, through the module's own global."""
    hidden_states = module.dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    return hidden_states.flatten(2, 3).to(query.dtype)


def _split_text(hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor):
    text = encoder_hidden_states.shape[1]
    return hidden_states.split_with_sizes([text, hidden_states.shape[1] - text], dim=1)


def _flux_out(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor]):
    """The rest of diffusers 0.42.1 FluxAttnProcessor.__call__ (single blocks have no to_out)."""
    if encoder_hidden_states is None:
        return hidden_states
    encoder_hidden_states, hidden_states = _split_text(hidden_states, encoder_hidden_states)
    to_out = attn.to_out
    hidden_states = dropout(to_out[1], linear(to_out[0], hidden_states.contiguous()))
    return hidden_states, linear(attn.to_add_out, encoder_hidden_states.contiguous())


def _flux2_out(attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor]):
    """The rest of diffusers 0.42.1 Flux2AttnProcessor.__call__."""
    if encoder_hidden_states is not None:
        encoder_hidden_states, hidden_states = _split_text(hidden_states, encoder_hidden_states)
        encoder_hidden_states = linear(attn.to_add_out, encoder_hidden_states)
    to_out = attn.to_out
    hidden_states = dropout(to_out[1], linear(to_out[0], hidden_states))
    return hidden_states if encoder_hidden_states is None else (hidden_states, encoder_hidden_states)


def _processor(module_name: str, finish: Callable[..., Any]) -> Callable[..., Any]:
    """The body of a FLUX joint-attention processor: projections, the fused stretch, attention, ``finish``."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        joint = _joint_ok(attn, encoder_hidden_states)
        if joint is None or not _common_ok(attn, hidden_states, image_rotary_emb, encoder_hidden_states):
            return FALLBACK
        module = sys.modules[module_name]
        query, key, value = _qkv(module, attn, hidden_states, encoder_hidden_states, image_rotary_emb, joint)
        return finish(attn, _attend(self, query, key, value, attention_mask, module), encoder_hidden_states)

    return __call__


def _swiglu_into(module: Any, attn: Any, mlp_hidden_states: torch.Tensor, attn_output: torch.Tensor
                 ) -> Optional[torch.Tensor]:
    """``torch.cat([attn_output, mlp_act_fn(mlp)], -1)`` without the cat's pass, or None if it does not fit."""
    act = attn.mlp_act_fn
    if not (pattern_on("swiglu") and stock(act, module.Flux2SwiGLU)
            and stock(act.gate_fn, torch.nn.SiLU) and attn_output.dim() == 3
            and attn_output.dtype == mlp_hidden_states.dtype and type(attn_output) is torch.Tensor
            and attn_output.shape[:2] == mlp_hidden_states.shape[:2] and mlp_hidden_states.shape[-1] % 2 == 0):
        return None
    from ...ops._slices import copy_into
    from ...ops._swiglu import swiglu

    width = attn_output.shape[-1]
    buf = attn_output.new_empty((*attn_output.shape[:2], width + mlp_hidden_states.shape[-1] // 2))
    copy_into(attn_output, buf[..., :width])
    swiglu(mlp_hidden_states, out=buf[..., width:])
    return buf


def _flux2_parallel(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
    if not _common_ok(attn, hidden_states, image_rotary_emb):
        return FALLBACK
    module = sys.modules[_FLUX2]
    # diffusers 0.42.1 Flux2ParallelSelfAttnProcessor.__call__, with the q/k stretch fused.
    hidden_states = linear(attn.to_qkv_mlp_proj, hidden_states)
    qkv_dim = 3 * attn.inner_dim
    mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
    local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
    qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
    query, key, value = qkv.chunk(3, dim=-1)
    fused_qkv = _fused_qkv(attn, query, key, value, None, None, None, image_rotary_emb, False)
    if fused_qkv is None:
        query, key, value = _diffusers_qkv(attn, query, key, value, None, None, None, image_rotary_emb, False,
                                           module.apply_rotary_emb)
    else:
        query, key, value = fused_qkv
    hidden_states = _attend(self, query, key, value, attention_mask, module)
    joined = _swiglu_into(module, attn, mlp_hidden_states, hidden_states)
    if joined is None:
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        joined = torch.cat([hidden_states, mlp_hidden_states], dim=-1)
    return linear(attn.to_out, joined)


flux = _processor(_FLUX, _flux_out)
flux2 = _processor(_FLUX2, _flux2_out)
flux2_parallel = _flux2_parallel
