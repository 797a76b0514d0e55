"""The ``flux3`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/flux3.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from ..._core.lazy import lazy_module
from .._diffusers_norms import norms_fit
from .._fused_common import FALLBACK, FLOAT_DTYPES, declined, dropout, fusable, linear, plain_layer_norm, stock
from .._joint_attention import Joint, attention, group_fits, joint_rows_fit
from .._modulate_calls import _vectors_fit, modulate_ops, modulated
from .._single_stream import Single, gated_sum, single_stream
from .swiglu import _swiglu

#: ``Flux3SwiGLU.forward`` is FLUX.2's (copied; the same fingerprint): the swiglu pattern's body.
swiglu = _swiglu

_FLUX3 = "diffusers.models.transformers.transformer_flux3"
_NORMS = ("norm_q", "norm_k")
#: The mode block: ``h + gate * (attn + ff)`` of one modulated sequence, the attention called as a module.
_MODE = Single(None, mlp=None, ff="ff")
#: Flux3AttnProcessor's attention call: FLUX's (``dispatch_attention_fn`` of its module, flatten, q's dtype).
_ATTENTION = Joint(_FLUX3)
#: ``torchpatches.ops.qk_norm_rope``, imported at the first fused call (it registers torch.library ops).
_qk_ops = lazy_module("torchpatches.ops._qk_norm_rope")


def _fp32_chain_norm(norm: Any, x: torch.Tensor) -> bool:
    """A stock ``torch.nn.RMSNorm(head_dim)`` with a number for eps and a plain float weight on x's device (any
    float dtype: the chain normalizes ``x.float()``, where the weight converts exactly)."""
    if not stock(norm, torch.nn.RMSNorm):
        return False
    weight = norm._parameters.get("weight")  # exactly RMSNorm: its weight lives there
    return (type(norm.__dict__.get("eps")) in (int, float) and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and tuple(norm.normalized_shape) == (x.shape[-1],) and weight.shape == (x.shape[-1],)
            and weight.dtype in FLOAT_DTYPES and weight.device == x.device)


def _norms_fit(attn: Any, x: torch.Tensor) -> bool:
    """Both q/k norms fit the chain: decided once per attention module and x's signature (``norms_fit``)."""
    return norms_fit(attn, x, _NORMS, _fp32_chain_norm,
                     "a q/k norm is not a stock torch.nn.RMSNorm with a float weight of the head's width")


def _fused_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              image_rotary_emb: Any) -> Optional[tuple]:
    """``(q, k)`` normalized in fp32, rotated and rounded once (``ops.qk_norm_rope``, ``rounding="fp32"``), or None
    where a tensor does not fit (the caller then runs diffusers' code)."""
    if any(type(t) is not torch.Tensor for t in (query, key, value)) or query.dtype not in FLOAT_DTYPES \
            or query.shape[-1] % 2 or not group_fits(query, (query, key, value)):
        return None
    if not joint_rows_fit(image_rotary_emb, query, query.shape[1]):
        declined("image_rotary_emb is not fp32 (cos, sin) [S, D] on the input's device")
        return None
    if not _norms_fit(attn, query):
        return None
    modules = attn._modules
    norm_q, norm_k = modules["norm_q"], modules["norm_k"]
    try:  # eps is not in the remembered state: set to None (RMSNorm's default) after the verdict, diffusers' code
        eps = (float(norm_q.eps), float(norm_k.eps))
    except TypeError:
        return None
    q, k, _ = _qk_ops().prechecked(query, key, *image_rotary_emb, norm_q._parameters["weight"],
                                   norm_k._parameters["weight"], eps + eps, rounding="fp32")
    return q, k


def processor(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
    rotary = tuple(image_rotary_emb) if isinstance(image_rotary_emb, (tuple, list)) else (image_rotary_emb,)
    if not (image_rotary_emb is not None and hidden_states.dim() == 3
            and fusable(hidden_states, (attn,), *(t for t in rotary if isinstance(t, torch.Tensor)))):
        return FALLBACK
    module = sys.modules[_FLUX3]
    # diffusers 0.42.1 Flux3AttnProcessor.__call__, the q/k stretch in one kernel.
    if attn.fused_projections:
        query, key, value = module._get_qkv_projections(attn, hidden_states)
    else:  # _get_projections, each projection through linear()
        query, key, value = linear(attn.to_q, hidden_states), linear(attn.to_k, hidden_states), \
            linear(attn.to_v, hidden_states)

    query = query.unflatten(-1, (attn.heads, -1))
    key = key.unflatten(-1, (attn.heads, -1))
    value = value.unflatten(-1, (attn.heads, -1))

    qk = _fused_qk(attn, query, key, value, image_rotary_emb)
    if qk is None:
        query = attn.norm_q(query.float())
        key = attn.norm_k(key.float())
        query = module.apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = module.apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        query, key = query.to(value.dtype), key.to(value.dtype)
    else:
        query, key = qk

    hidden_states = attention(_ATTENTION, self, query, key, value, attention_mask)
    return dropout(attn.to_out[1], linear(attn.to_out[0], hidden_states))


def _blocks_fit(self: Any, hidden_states: Any, *tensors: Any) -> bool:
    """Plain ``[B, S, D]`` activations and ``[B, S, 3D]`` modulation tensors, nothing requiring grad (the vectors'
    own fit, dtype and shape, is checked where each is used: ``_modulate_calls``)."""
    return (fusable(hidden_states, (self,), *tensors) and hidden_states.dim() == 3
            and all(type(t) is torch.Tensor and t.dim() == 3 for t in tensors))


def _joint_modulated(norm: Any, text: torch.Tensor, image: torch.Tensor, vectors: tuple) -> Optional[torch.Tensor]:
    """``torch.cat([norm(text) * (1 + c_scale) + c_shift, norm(image) * (1 + scale) + shift], dim=1)``, each
    stream's kernel writing its rows of the joint buffer (no cat pass), or None where a tensor does not fit."""
    c_scale, c_shift, scale, shift = vectors
    B, S, D = image.shape
    if not (type(text) is torch.Tensor and text.dim() == 3 and text.shape[0] == B and text.shape[2] == D
            and text.dtype == image.dtype and text.device == image.device and _vectors_fit(image, scale, shift)
            and _vectors_fit(text, c_scale, c_shift) and plain_layer_norm(norm, D)):
        return None
    T = text.shape[1]
    joint = image.new_empty((B, T + S, D))
    ops = modulate_ops()
    ops.prechecked(text, None, None, c_scale, c_shift, norm.eps, norm_out=joint[:, :T])
    ops.prechecked(image, None, None, scale, shift, norm.eps, norm_out=joint[:, T:])
    return joint


def mode_block(self, hidden_states, temb_mod, image_rotary_emb, *args, **kwargs):
    if args or kwargs or not _blocks_fit(self, hidden_states, temb_mod):
        return FALLBACK
    # diffusers 0.42.1 Flux3ModeTransformerBlock.forward, the glue through the modulate op where it fits.
    mod_shift, mod_scale, mod_gate = torch.chunk(temb_mod, 3, dim=-1)
    norm_hidden_states = modulated(self.norm, hidden_states, mod_scale, mod_shift, fuse=True)
    return single_stream(_MODE, self, hidden_states, None, {"image_rotary_emb": image_rotary_emb},
                         modulation=(norm_hidden_states, mod_gate))


def single_block(self, hidden_states, encoder_hidden_states, temb_mod, temb_mod_context, image_rotary_emb, *args,
                 **kwargs):
    if args or kwargs or not _blocks_fit(self, hidden_states, encoder_hidden_states, temb_mod, temb_mod_context):
        return FALLBACK
    # diffusers 0.42.1 Flux3SingleTransformerBlock.forward, the glue through the modulate op where it fits.
    mod_shift, mod_scale, mod_gate = torch.chunk(temb_mod, 3, dim=-1)
    c_mod_shift, c_mod_scale, c_mod_gate = torch.chunk(temb_mod_context, 3, dim=-1)
    combined = _joint_modulated(self.norm, encoder_hidden_states, hidden_states,
                                (c_mod_scale, c_mod_shift, mod_scale, mod_shift))
    if combined is None:
        norm_hidden_states = modulated(self.norm, hidden_states, mod_scale, mod_shift, fuse=True)
        norm_encoder_hidden_states = modulated(self.norm, encoder_hidden_states, c_mod_scale, c_mod_shift, fuse=True)
        combined = torch.cat([norm_encoder_hidden_states, norm_hidden_states], dim=1)

    attn_output = self.attn(hidden_states=combined, image_rotary_emb=image_rotary_emb)
    ff_output = self.ff(combined)

    # output = attn_output + ff_output, split into (context, content): each stream's rows summed in its kernel
    sizes = [encoder_hidden_states.shape[1], hidden_states.shape[1]]
    context_attn, content_attn = torch.split(attn_output, sizes, dim=1)
    context_ff, content_ff = torch.split(ff_output, sizes, dim=1)
    encoder_hidden_states = gated_sum(encoder_hidden_states, c_mod_gate, context_attn, context_ff)
    hidden_states = gated_sum(hidden_states, mod_gate, content_attn, content_ff)
    return encoder_hidden_states, hidden_states


def norm_out(self, hidden_states, temb, *args, **kwargs):
    if args or kwargs or not (fusable(hidden_states, (self,), temb) and hidden_states.dim() == 3):
        return FALLBACK
    # diffusers 0.42.1 Flux3AdaLayerNorm.forward, the LayerNorm and modulation in one kernel.
    emb = linear(self.linear, self.act_fn(temb))
    scale, shift = torch.chunk(emb, 2, dim=-1)
    return modulated(self.norm, hidden_states, scale, shift, fuse=True)
