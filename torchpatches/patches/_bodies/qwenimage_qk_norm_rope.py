"""The ``qwenimage_qk_norm_rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/qwenimage_qk_norm_rope.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from ..._core.lazy import lazy_module
from .._diffusers_norms import diffusers_rms_norms_fit
from .._fused_common import FALLBACK, dropout, fusable, linear

# imported at the first fused call: the tables' module is not needed to declare the patch (import cost)
_tables = lazy_module("torchpatches.patches._per_step")
_QWEN = "diffusers.models.transformers.transformer_qwenimage"


_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def _norms_fit(attn: Any, x: torch.Tensor) -> bool:
    """The four q/k norms fit x (decided once per attention module and x's signature)."""
    return diffusers_rms_norms_fit(attn, x, _NORMS)


def _mask_fits(mask: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> bool:
    if mask is None:
        return True
    return (
        type(mask) is torch.Tensor
        and mask.device == hidden_states.device
        and tuple(mask.shape) == tuple(encoder_hidden_states.shape[:2])
        and not mask.requires_grad
    )


def _covered(attn: Any, hidden_states: Any, encoder_hidden_states: Any, mask: Any,
             attention_mask: Any, image_rotary_emb: Any) -> bool:
    return (
        encoder_hidden_states is not None
        and attention_mask is None  # diffusers raises for an external mask: let it
        and isinstance(image_rotary_emb, (tuple, list))
        and len(image_rotary_emb) == 2
        and fusable(hidden_states, (attn,), encoder_hidden_states)
        and type(encoder_hidden_states) is torch.Tensor
        and hidden_states.dim() == 3
        and encoder_hidden_states.dim() == 3
        and _mask_fits(mask, hidden_states, encoder_hidden_states)
    )


def _fused_qkv(attn: Any, img: list, txt: list, image_rotary_emb: Any, module: Any = None) -> Optional[tuple]:
    """(q, k, v) joint tensors from the fused op, or None where a tensor does not fit it.

    The kernel tier rotates with the op's cos/sin tables. The PyTorch tier (CPU with a forced tier, or a GPU
    without Triton) has the op normalize and concatenate only, then rotates each stream with diffusers' own
    ``apply_rotary_emb_qwen`` (one complex64 multiply per tensor, fewer launches than the op's real form): torch
    rounds a complex product differently from the real-form rotation where its vectorized loop does not reach
    (the CPU's scalar tail contracts ``a*c - b*d`` to an FMA; CUDA always does), so only diffusers' own
    multiply on each stream's own tensor gives diffusers' bits at every head dim and on every device.
    ``module``: diffusers' ``transformer_qwenimage`` (looked up when None: ``benchmarks/dit_ops.py`` calls this)."""
    q = img[0]
    if any(type(t) is not torch.Tensor or t.dtype != q.dtype for t in img + txt):
        return None
    if not _norms_fit(attn, q):
        return None
    s_txt = txt[0].shape[1]
    tables = _tables().rope_tables(*image_rotary_emb, q.shape[1], s_txt, q.shape[-1], q.device)
    if tables is None:
        return None
    from ...ops._runtime.tiers import choose_tier
    from ...ops._qk_norm_rope import qk_norm_rope  # lazily: importing an op registers torch.library ops

    try:
        tier = choose_tier(q.device.type, None)  # never under autograd: fusable() leaves such calls to diffusers
        q, k, v = qk_norm_rope(img[0], img[1], *(tables if tier != "torch" else (None, None)),
                               q_weight=attn.norm_q.weight, k_weight=attn.norm_k.weight, eps_q=attn.norm_q.eps,
                               eps_k=attn.norm_k.eps, v=img[2], q_txt=txt[0], k_txt=txt[1], v_txt=txt[2],
                               q_txt_weight=attn.norm_added_q.weight, k_txt_weight=attn.norm_added_k.weight,
                               eps_q_txt=attn.norm_added_q.eps, eps_k_txt=attn.norm_added_k.eps,
                               rounding="each", tier=tier)
    except ValueError:  # a forced tier that cannot run, a projection of another shape: checked before computing
        return None
    if tier == "torch":
        module = module if module is not None else sys.modules[_QWEN]
        img_freqs, txt_freqs = image_rotary_emb

        def rotate(joint: torch.Tensor) -> torch.Tensor:  # diffusers' four calls and its concat
            return torch.cat([module.apply_rotary_emb_qwen(joint[:, :s_txt], txt_freqs, use_real=False),
                              module.apply_rotary_emb_qwen(joint[:, s_txt:], img_freqs, use_real=False)], dim=1)

        q, k = rotate(q), rotate(k)
    return q, k, v


def _diffusers_qkv(attn: Any, img: list, txt: list, image_rotary_emb: Any, module: Any) -> tuple:
    """diffusers 0.42.1's code for the same stretch (when a tensor does not fit the op)."""
    img_query, img_key, img_value = img
    txt_query, txt_key, txt_value = txt
    if attn.norm_q is not None:
        img_query = attn.norm_q(img_query)
    if attn.norm_k is not None:
        img_key = attn.norm_k(img_key)
    if attn.norm_added_q is not None:
        txt_query = attn.norm_added_q(txt_query)
    if attn.norm_added_k is not None:
        txt_key = attn.norm_added_k(txt_key)
    img_freqs, txt_freqs = image_rotary_emb
    img_query = module.apply_rotary_emb_qwen(img_query, img_freqs, use_real=False)
    img_key = module.apply_rotary_emb_qwen(img_key, img_freqs, use_real=False)
    txt_query = module.apply_rotary_emb_qwen(txt_query, txt_freqs, use_real=False)
    txt_key = module.apply_rotary_emb_qwen(txt_key, txt_freqs, use_real=False)
    return (torch.cat([txt_query, img_query], dim=1), torch.cat([txt_key, img_key], dim=1),
            torch.cat([txt_value, img_value], dim=1))


def _processor(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
               attention_mask=None, image_rotary_emb=None):
    if not _covered(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask,
                    image_rotary_emb):
        return FALLBACK
    module = sys.modules[_QWEN]
    # diffusers 0.42.1 QwenDoubleStreamAttnProcessor2_0.__call__, with the q/k stretch fused.
    if encoder_hidden_states_mask is not None:
        attention_mask = _tables().joint_mask(encoder_hidden_states_mask, hidden_states)
    seq_txt = encoder_hidden_states.shape[1]
    head_dim = attn.inner_dim // attn.heads
    img = [linear(p, hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v)]
    txt = [linear(p, encoder_hidden_states).unflatten(-1, (-1, head_dim))
           for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
    qkv = _fused_qkv(attn, img, txt, image_rotary_emb, module)
    if qkv is None:
        qkv = _diffusers_qkv(attn, img, txt, image_rotary_emb, module)
    joint_query, joint_key, joint_value = qkv
    joint_hidden_states = module.dispatch_attention_fn(
        joint_query, joint_key, joint_value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
        backend=self._attention_backend, parallel_config=self._parallel_config,
    )
    joint_hidden_states = joint_hidden_states.flatten(2, 3).to(joint_query.dtype)
    txt_attn_output = joint_hidden_states[:, :seq_txt, :]
    img_attn_output = joint_hidden_states[:, seq_txt:, :]
    to_out = attn.to_out
    img_attn_output = linear(to_out[0], img_attn_output.contiguous())
    if len(to_out) > 1:
        img_attn_output = dropout(to_out[1], img_attn_output)
    txt_attn_output = linear(attn.to_add_out, txt_attn_output.contiguous())
    return img_attn_output, txt_attn_output
