"""The ``sd3_qk_norm`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/sd3_qk_norm.py``."""
from __future__ import annotations

import sys
from typing import Any

import torch

from .._fused_common import FALLBACK, declined, fusable
from .._joint_attention import Joint, attend

_PROCESSOR = "diffusers.models.attention_processor"
#: JointAttnProcessor2_0: image rows first, no RoPE, heads split by view, F.scaled_dot_product_attention on
#: [B, H, S, D], the text output unprojected in a context_pre_only block.
_SD3 = Joint(_PROCESSOR, head_split="view", sdpa=True, context_pre_only=True)


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


def _joint_attn(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
    if args or kwargs or attention_mask is not None:
        return declined("an attention mask or extra arguments to the processor")
    if not _call_ok(self, attn, hidden_states, encoder_hidden_states):
        return FALLBACK
    return attend(_SD3, self, attn, hidden_states, encoder_hidden_states)
