"""One body for diffusers' joint (image + text) attention processors, with each processor's differences as data.

SD3's ``JointAttnProcessor2_0``, QwenImage's ``QwenDoubleStreamAttnProcessor2_0`` and HunyuanVideo 1.5's
``HunyuanVideo15AttnProcessor2_0`` run the same stretch: project each stream (module calls: LoRA layers and hooks
keep working), split heads, RMSNorm q and k of each stream (diffusers' ``RMSNorm``, rounding after each op), rotate
(or not), concatenate the streams, attend, split the output and project each stream back. A :class:`Joint` row says
where they differ; :func:`attend` runs the stretch with q/k norms, RoPE and the concat in one ``ops.qk_norm_rope``
launch, and :func:`_diffusers_qkv` is diffusers' own code for that stretch when a tensor does not fit the op (a
projection that returned another dtype or shape, a hooked or replaced norm). The callers decide beforehand
whether the call is theirs (the ``fusable`` predicates) and build the mask.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .._core.lazy import lazy_module
from ._diffusers_norms import diffusers_rms_norms_fit
from ._fused_common import declined, dropout, linear

_per_step = lazy_module("torchpatches.patches._per_step")
_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_IMAGE_PROJ = ("to_q", "to_k", "to_v")
_TEXT_PROJ = ("add_q_proj", "add_k_proj", "add_v_proj")


@dataclasses.dataclass(frozen=True)
class Joint:
    """How one diffusers 0.42.1 joint-attention processor differs from the others.

    - ``module``: the diffusers module whose globals the processor reads (``dispatch_attention_fn``, its RoPE);
    - ``text_first``: the joint sequence is ``[text; image]`` (QwenImage) rather than ``[image; text]``;
    - ``rope``: None (SD3), ``"complex"`` (QwenImage: a complex64 table per stream, ``apply_rotary_emb_qwen``) or
      ``"image_rows"`` (HunyuanVideo 1.5: fp32 cos/sin of the image rows, FLUX's ``apply_rotary_emb``);
    - ``head_split``: ``"view"`` (SD3: ``view(B, -1, H, D)`` with ``D = key width / heads``), ``"inner_dim"``
      (QwenImage: ``unflatten(-1, (-1, inner_dim / heads))``) or ``"heads"`` (``unflatten(2, (heads, -1))``);
    - ``sdpa``: attention through ``F.scaled_dot_product_attention`` on ``[B, H, S, D]`` (SD3) rather than
      ``dispatch_attention_fn`` on ``[B, S, H, D]``;
    - ``contiguous_out``: the output slices made contiguous before their projections (QwenImage);
    - ``optional_out``: ``to_out`` / ``to_add_out`` applied only where present (HunyuanVideo 1.5), and
      ``context_pre_only``: the text output unprojected where the module says so (SD3's last block)."""

    module: str
    text_first: bool = False
    rope: Optional[str] = None
    head_split: str = "heads"
    sdpa: bool = False
    contiguous_out: bool = False
    optional_out: bool = False
    context_pre_only: bool = False


def _split(joint: Joint, attn: Any, t: torch.Tensor, key_width: int) -> torch.Tensor:
    if joint.head_split == "view":
        return t.view(t.shape[0], -1, attn.heads, key_width // attn.heads)
    if joint.head_split == "inner_dim":
        return t.unflatten(-1, (-1, attn.inner_dim // attn.heads))
    return t.unflatten(2, (attn.heads, -1))


def _tables(joint: Joint, rope: Any, q: torch.Tensor, s_txt: int) -> Optional[Tuple[Any, Any]]:
    """The op's (cos, sin) rows for the joint sequence, ``(None, None)`` without RoPE, None where they do not fit."""
    if joint.rope is None:
        return None, None
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        return None
    if joint.rope == "complex":
        return _per_step().rope_tables(*rope, q.shape[1], s_txt, q.shape[-1], q.device)
    tables = _per_step().image_rows_tables(*rope, s_txt, q.device)
    if tables is None or tables[0].shape != (q.shape[1] + s_txt, q.shape[-1]):
        declined("image_rotary_emb is not fp32 (cos, sin) [S, D] of the image's rows")
        return None
    return tables


def _fused_qkv(joint: Joint, attn: Any, img: List[torch.Tensor], txt: List[torch.Tensor],
               rope: Any) -> Optional[tuple]:
    """The joint q, k, v (``[B, S, H, D]``) from one ``qk_norm_rope`` launch, or None where a tensor does not fit.

    For QwenImage's complex RoPE the PyTorch tier has the op normalize and concatenate only and rotates each
    stream with diffusers' own complex multiply: torch rounds a complex product differently from the real-form
    rotation where its vectorized loop does not reach (the CPU's scalar tail contracts ``a*c - b*d`` to an FMA;
    CUDA always does), so only diffusers' multiply on each stream's own tensor gives diffusers' bits."""
    q = img[0]
    norms = _NORMS if txt else _NORMS[:2]
    if any(type(t) is not torch.Tensor or t.dtype != q.dtype or t.dim() != 4 for t in img + txt) \
            or (joint.rope is not None and q.shape[-1] % 2) or not diffusers_rms_norms_fit(attn, q, norms):
        return None
    s_txt = txt[0].shape[1] if txt else 0
    tables = _tables(joint, rope, q, s_txt)
    if tables is None:
        return None
    from ..ops._qk_norm_rope import qk_norm_rope  # lazily: importing an op registers torch.library ops
    from ..ops._runtime.tiers import choose_tier

    tier = choose_tier(q.device.type, None)  # never under autograd: fusable() leaves such calls to diffusers
    own_rotation = joint.rope == "complex" and tier == "torch"
    text = {}
    if txt:
        text = dict(q_txt=txt[0], k_txt=txt[1], v_txt=txt[2], q_txt_weight=attn.norm_added_q.weight,
                    k_txt_weight=attn.norm_added_k.weight, eps_q_txt=attn.norm_added_q.eps,
                    eps_k_txt=attn.norm_added_k.eps)
    try:
        q, k, v = qk_norm_rope(img[0], img[1], *((None, None) if own_rotation else tables),
                               q_weight=attn.norm_q.weight, k_weight=attn.norm_k.weight, eps_q=attn.norm_q.eps,
                               eps_k=attn.norm_k.eps, v=img[2], text_first=joint.text_first, rounding="each",
                               tier=tier, **text)
    except ValueError:  # a forced tier that cannot run, shapes the op refuses: checked before computing
        return None
    if own_rotation:
        module, (img_freqs, txt_freqs) = sys.modules[joint.module], rope

        def rotate(t: torch.Tensor) -> torch.Tensor:  # diffusers' four calls and its concat
            return torch.cat([module.apply_rotary_emb_qwen(t[:, :s_txt], txt_freqs, use_real=False),
                              module.apply_rotary_emb_qwen(t[:, s_txt:], img_freqs, use_real=False)], dim=1)

        q, k = rotate(q), rotate(k)
    return q, k, v


def _diffusers_qkv(joint: Joint, attn: Any, img: List[torch.Tensor], txt: List[torch.Tensor], rope: Any) -> tuple:
    """diffusers 0.42.1's code for the same stretch: each stream's norms (where present), its rotation, the concat."""
    def normed(t: torch.Tensor, norm: Any) -> torch.Tensor:
        return norm(t) if norm is not None else t

    img = [normed(img[0], attn.norm_q), normed(img[1], attn.norm_k), img[2]]
    if txt:
        txt = [normed(txt[0], attn.norm_added_q), normed(txt[1], attn.norm_added_k), txt[2]]
    if joint.rope == "complex":
        module, (img_freqs, txt_freqs) = sys.modules[joint.module], rope
        for stream, freqs in ((img, img_freqs), (txt, txt_freqs)):
            stream[0], stream[1] = (module.apply_rotary_emb_qwen(t, freqs, use_real=False) for t in stream[:2])
    elif joint.rope == "image_rows" and rope is not None:
        from diffusers.models.embeddings import apply_rotary_emb  # as diffusers imports it, per call

        img[0], img[1] = (apply_rotary_emb(t, rope, sequence_dim=1) for t in img[:2])
    if not txt:
        return tuple(img)
    first, second = (txt, img) if joint.text_first else (img, txt)
    return tuple(torch.cat([a, b], dim=1) for a, b in zip(first, second))


def _attention(joint: Joint, processor: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention over ``[B, S, H, D]`` q, k, v as the processor calls it, ``[B, S, H * D]`` in q's dtype."""
    if joint.sdpa:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).reshape(q.shape[0], -1, q.shape[2] * q.shape[3]).to(q.dtype)
    out = sys.modules[joint.module].dispatch_attention_fn(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, backend=processor._attention_backend,
        parallel_config=processor._parallel_config)
    return out.flatten(2, 3).to(q.dtype)


def _project_out(joint: Joint, attn: Any, image: torch.Tensor, text: Optional[torch.Tensor]) -> Any:
    if joint.contiguous_out:
        image = image.contiguous()
        text = text.contiguous() if text is not None else None
    if text is not None and not (joint.context_pre_only and attn.context_pre_only) \
            and not (joint.optional_out and getattr(attn, "to_add_out", None) is None):
        text = linear(attn.to_add_out, text)
    to_out = getattr(attn, "to_out", None)
    if to_out is not None or not joint.optional_out:
        image = linear(to_out[0], image)
        if len(to_out) > 1:
            image = dropout(to_out[1], image)
    return image if text is None else (image, text)


def attend(joint: Joint, processor: Any, attn: Any, hidden_states: torch.Tensor,
           encoder_hidden_states: Optional[torch.Tensor], rope: Any = None,
           mask: Callable[[int, torch.dtype], Optional[torch.Tensor]] = lambda rows, dtype: None) -> Any:
    """The processor's output for a call its body covers: ``image`` or ``(image, text)`` as the processor returns
    them. ``mask(joint_rows, dtype)`` builds the attention mask once q is known (None: none)."""
    image_rows = hidden_states.shape[1]
    projected = [linear(getattr(attn, name), hidden_states) for name in _IMAGE_PROJ]
    key_width = projected[1].shape[-1]
    img = [_split(joint, attn, t, key_width) for t in projected]
    txt: List[torch.Tensor] = []
    if encoder_hidden_states is not None:
        txt = [_split(joint, attn, linear(getattr(attn, name), encoder_hidden_states), key_width)
               for name in _TEXT_PROJ]
    qkv = _fused_qkv(joint, attn, img, txt, rope)
    q, k, v = qkv if qkv is not None else _diffusers_qkv(joint, attn, img, txt, rope)
    out = _attention(joint, processor, q, k, v, mask(q.shape[1], q.dtype))
    if not txt:
        return _project_out(joint, attn, out, None)
    s_txt = txt[0].shape[1]
    if joint.text_first:
        return _project_out(joint, attn, out[:, s_txt:], out[:, :s_txt])
    return _project_out(joint, attn, out[:, :image_rows], out[:, image_rows:])
