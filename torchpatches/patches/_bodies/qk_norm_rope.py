"""The ``qk_norm_rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/qk_norm_rope.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from .._fused_common import FALLBACK, fusable, linear, pattern_on, stock
from .._joint_attention import Joint, attend, attention, qkv

_FLUX = "diffusers.models.transformers.transformer_flux"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"
#: FluxAttnProcessor: [text; image], torch.nn.RMSNorm per head, fp32 cos/sin of the joint rows, the output slices made
#: contiguous before their projections, a single block's output unprojected (it has no to_out).
_FLUX1 = Joint(_FLUX, text_first=True, rope="joint_rows", head_split="head_dim", rounding="once",
               flux_projections=True, contiguous_out=True, single_out=False)
#: Flux2AttnProcessor (and the q/k stretch of Flux2ParallelSelfAttnProcessor): as FLUX.1's, the slices projected as
#: they are, every call's output through to_out.
_FLUX2_ROW = Joint(_FLUX2, text_first=True, rope="joint_rows", head_split="head_dim", rounding="once",
                   flux_projections=True)


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


def _processor(joint: Joint) -> Any:
    """A FLUX joint-attention processor's ``__call__``: the joint-attention body on the ``joint`` row."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        # Text projections without text: the original would fail on None tensors, let it say so.
        if (encoder_hidden_states is None and attn.added_kv_proj_dim is not None) \
                or not _common_ok(attn, hidden_states, image_rotary_emb, encoder_hidden_states):
            return FALLBACK
        return attend(joint, self, attn, hidden_states, encoder_hidden_states, image_rotary_emb,
                      lambda rows, dtype: attention_mask)

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
    # diffusers 0.42.1 Flux2ParallelSelfAttnProcessor.__call__, its q/k stretch the joint-attention body's.
    hidden_states = linear(attn.to_qkv_mlp_proj, hidden_states)
    qkv_dim = 3 * attn.inner_dim
    mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
    local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
    projected, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv],
                                               dim=-1)
    query, key, value = qkv(_FLUX2_ROW, attn, list(projected.chunk(3, dim=-1)), [], image_rotary_emb)
    hidden_states = attention(_FLUX2_ROW, self, query, key, value, attention_mask)
    joined = _swiglu_into(module, attn, mlp_hidden_states, hidden_states)
    if joined is None:
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        joined = torch.cat([hidden_states, mlp_hidden_states], dim=-1)
    return linear(attn.to_out, joined)


flux = _processor(_FLUX1)
flux2 = _processor(_FLUX2_ROW)
flux2_parallel = _flux2_parallel
