"""One body for diffusers' joint (image + text) attention processors, with each processor's differences as data.

FLUX.1's ``FluxAttnProcessor``, FLUX.2's ``Flux2AttnProcessor`` (and the q/k stretch of its
``Flux2ParallelSelfAttnProcessor``), SD3's ``JointAttnProcessor2_0``, QwenImage's ``QwenDoubleStreamAttnProcessor2_0``,
HunyuanVideo 1.5's ``HunyuanVideo15AttnProcessor2_0``, the single-stream Z-Image ``ZSingleStreamAttnProcessor``
and Ideogram 4 ``Ideogram4AttnProcessor``, and Wan's ``WanAttnProcessor`` (self- and cross-attention) run the same
stretch: project each stream (module calls: LoRA layers and hooks keep working), split heads, RMSNorm q and k of
each stream, rotate (or not), concatenate the streams, attend, split the output and project each stream back.
A :class:`Joint` row says where they differ; :func:`attend` runs the stretch with q/k norms, RoPE and the concat in
one ``ops.qk_norm_rope`` launch through its ``prechecked`` entry (this module makes the op's checks, the norms' once
per module: about 30 us of Python a call less), or, where the norms span all heads (Wan), in one
``ops.rms_norm_rope`` launch; and :func:`_diffusers_qkv` is diffusers' own code for that stretch when a tensor does
not fit the op (a projection that returned another dtype or shape, a hooked or replaced norm). The callers decide
beforehand whether the call is theirs (the ``fusable`` predicates) and build the mask.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .._core.lazy import lazy_module
from ..ops._runtime.args import number
from ..ops._runtime.memory import expanded
from ._diffusers_norms import norms_fit, plain_diffusers_rms_norm
from ._fused_common import FLOAT_DTYPES, declined, dropout, linear, plain_rms_norm

_per_step = lazy_module("torchpatches.patches._per_step")
#: ``torchpatches.ops.qk_norm_rope``, imported at the first fused call (importing an op registers torch.library ops).
_qk_ops = lazy_module("torchpatches.ops._qk_norm_rope")
_tiers = lazy_module("torchpatches.ops._runtime.tiers")
#: ``torchpatches.ops.rms_norm_rope`` (norms across heads), imported at the first fused call, as above.
_across_ops = lazy_module("torchpatches.ops._rms_norm_rope")
_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_QK_NORMS = _NORMS[:2]
#: The complex RoPE forms, which the PyTorch tier rotates with diffusers' own complex multiply (``_fused_qkv``).
_COMPLEX = ("complex", "complex_batch")


@dataclasses.dataclass(frozen=True)
class Joint:
    """How one diffusers 0.42.1 joint-attention processor differs from the others.

    - ``module``: the diffusers module whose globals the processor reads (``dispatch_attention_fn``, its RoPE);
    - ``text_first``: the joint sequence is ``[text; image]`` (FLUX, QwenImage) rather than ``[image; text]``;
    - ``rope``: None (SD3), ``"complex"`` (QwenImage: a complex64 table per stream, ``apply_rotary_emb_qwen``),
      ``"image_rows"`` (HunyuanVideo 1.5: fp32 cos/sin of the image rows, FLUX's ``apply_rotary_emb``),
      ``"joint_rows"`` (FLUX: fp32 ``[S_txt + S, D]`` cos/sin of every row, the module's ``apply_rotary_emb`` after
      the concat; a single-stream call rotates all its rows), ``"complex_batch"`` (Z-Image: complex64 ``[B, S, D/2]``,
      the processor's nested complex multiply) or ``"half_each"`` (Ideogram 4: ``(cos, sin)`` ``[B, S, D]`` of the
      activations' dtype, half-split pairs, each op rounding);
    - ``head_split``: ``"view"`` (SD3: ``view(B, -1, H, D)`` with ``D = key width / heads``), ``"inner_dim"``
      (QwenImage: ``unflatten(-1, (-1, inner_dim / heads))``), ``"head_dim"`` (FLUX: ``unflatten(-1, (-1,
      head_dim))``), ``"num_heads"`` (Ideogram 4: ``unflatten(-1, (num_heads, head_dim))``) or ``"heads"``
      (``unflatten(2, (heads, -1))``);
    - ``rounding``: ``"each"`` (diffusers' ``RMSNorm``: ``x * rstd`` rounded, then ``* w``) or ``"once"``
      (``torch.nn.RMSNorm``'s fused kernel: FLUX);
    - ``flux_projections``: FLUX's projections: the module's ``_get_qkv_projections`` after
      ``fuse_qkv_projections()``, the text projected only where ``attn.added_kv_proj_dim`` is set;
    - ``sdpa``: attention through ``F.scaled_dot_product_attention`` on ``[B, H, S, D]`` (SD3) rather than
      ``dispatch_attention_fn`` on ``[B, S, H, D]``;
    - ``contiguous_out``: the output slices made contiguous before their projections (QwenImage, FLUX.1);
    - ``optional_out``: ``to_out`` / ``to_add_out`` applied only where present (HunyuanVideo 1.5),
      ``context_pre_only``: the text output unprojected where the module says so (SD3's last block), and
      ``single_out``: a single-stream call's output projected (False: FLUX.1's single blocks, which have no to_out),
      ``out_dropout``: ``to_out[1]`` applied after ``to_out[0]`` where present (not by Ideogram 4);
    - ``norm_span``: ``"head"`` (q and k normalized per head after the split) or ``"inner"`` (Wan's
      ``rms_norm_across_heads``: ``torch.nn.RMSNorm`` over ``[B, S, H * D]`` before the split, then rope
      ``"wan_rows"``: fp32 ``(cos, sin)`` ``[1, S, 1, D]``, interleaved pairs, rotated after the split);
    - ``kv_from_context``: a call with context states is cross-attention (Wan): q from the image, k and v from the
      context (the module's ``_get_qkv_projections``), the image's output only, and diffusers' context parallelism
      handed to self-attention alone (the context is not split)."""

    module: str
    text_first: bool = False
    rope: Optional[str] = None
    head_split: str = "heads"
    rounding: str = "each"
    flux_projections: bool = False
    sdpa: bool = False
    contiguous_out: bool = False
    optional_out: bool = False
    context_pre_only: bool = False
    single_out: bool = True
    out_dropout: bool = True
    norm_span: str = "head"
    kv_from_context: bool = False

    def __post_init__(self) -> None:
        if (self.norm_span == "inner") != (self.rope == "wan_rows") or self.norm_span not in ("head", "inner"):
            raise ValueError(f"norm_span {self.norm_span!r} with rope {self.rope!r}: norms across heads ('inner') "
                             "go with Wan's rows ('wan_rows'), and only they do")


def _split(joint: Joint, attn: Any, tensors: List[torch.Tensor], key_width: int) -> List[torch.Tensor]:
    """Each ``[B, S, H * D]`` projection as ``[B, S, H, D]``, split as the processor splits it."""
    if joint.head_split == "head_dim":
        sizes = (-1, attn.head_dim)
        return [t.unflatten(-1, sizes) for t in tensors]
    if joint.head_split == "view":
        heads = attn.heads
        return [t.view(t.shape[0], -1, heads, key_width // heads) for t in tensors]
    if joint.head_split == "inner_dim":
        sizes = (-1, attn.inner_dim // attn.heads)
        return [t.unflatten(-1, sizes) for t in tensors]
    if joint.head_split == "num_heads":
        sizes = (attn.num_heads, attn.head_dim)
        return [t.unflatten(-1, sizes) for t in tensors]
    sizes = (attn.heads, -1)
    return [t.unflatten(2, sizes) for t in tensors]


def _norms_fit(joint: Joint, attn: Any, x: torch.Tensor, names: Tuple[str, ...]) -> bool:
    """The norms ``names`` of ``attn`` are what the op computes for x (``joint.rounding``), remembered per module."""
    if joint.rounding == "once":
        return norms_fit(attn, x, names, plain_rms_norm)
    return norms_fit(attn, x, names, plain_diffusers_rms_norm,
                     "a norm is not a stock diffusers RMSNorm with a weight of the input's dtype and no bias")


def joint_rows_fit(rope: Any, q: torch.Tensor, rows: int) -> bool:
    """FLUX's tables: fp32 ``(cos, sin)`` ``[rows, D]`` on q's device with a unit-stride last dim."""
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        return False
    for t in rope:
        if type(t) is not torch.Tensor or t.dtype != torch.float32 or t.device != q.device \
                or tuple(t.shape) != (rows, q.shape[-1]) or t.stride(-1) != 1:
            return False
    return True


def _complex_batch_tables(freqs: Any, q: torch.Tensor) -> Optional[Tuple[Any, Any]]:
    """Z-Image's complex64 ``[B, S, D/2]`` frequencies as the op's fp32 tables, None where they do not fit."""
    tables = _per_step().complex_tables(freqs, q.shape[1], q.shape[-1], q.device)
    if tables is None:
        declined("freqs_cis is not complex64 [B, S, D/2] of the sequence's length")
        return None
    return tables if tables[0].dim() == 2 or tables[0].shape[0] in (1, q.shape[0]) else None


def _half_tables_fit(rope: Any, q: torch.Tensor) -> bool:
    """Ideogram 4's ``(cos, sin)``: plain ``[B, L, D]`` tensors of q's dtype and device (the model casts them), with
    a unit-stride last dim."""
    if not isinstance(rope, tuple) or len(rope) != 2:
        return False
    shape = (q.shape[0], q.shape[1], q.shape[3])
    return all(type(t) is torch.Tensor and t.dtype == q.dtype and t.device == q.device and tuple(t.shape) == shape
               and t.stride(-1) == 1 for t in rope)


def _rotate_complex(x_in: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``ZSingleStreamAttnProcessor``'s nested ``apply_rotary_emb`` (autocast is off here)."""
    x = torch.view_as_complex(x_in.float().reshape(*x_in.shape[:-1], -1, 2))
    x_out = torch.view_as_real(x * freqs_cis.unsqueeze(2)).flatten(3)
    return x_out.type_as(x_in)


def _tables(joint: Joint, rope: Any, q: torch.Tensor, s_txt: int) -> Optional[Tuple[Any, Any]]:
    """The op's (cos, sin) rows for the joint sequence, ``(None, None)`` without RoPE, None where they do not fit."""
    if joint.rope is None:
        return None, None
    if joint.rope == "joint_rows":
        return tuple(rope) if joint_rows_fit(rope, q, q.shape[1] + s_txt) else None
    if joint.rope == "complex_batch":
        return _complex_batch_tables(rope, q)
    if joint.rope == "half_each":
        if _half_tables_fit(rope, q):
            return rope
        declined("image_rotary_emb is not (cos, sin) [B, L, D] of the activations' dtype")
        return None
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        return None
    if joint.rope == "complex":
        return _per_step().rope_tables(*rope, q.shape[1], s_txt, q.shape[-1], q.device)
    tables = _per_step().image_rows_tables(*rope, s_txt, q.device)
    if tables is None or tables[0].shape != (q.shape[1] + s_txt, q.shape[-1]):
        declined("image_rotary_emb is not fp32 (cos, sin) [S, D] of the image's rows")
        return None
    return tables


def group_fits(x: torch.Tensor, group: List[torch.Tensor]) -> bool:
    """Each ``[B, S, H, D]`` tensor of a stream's q, k, v is a plain tensor of ``x``'s dtype and device, of one
    shape, with ``x``'s batch, heads and head dim, and no expanded dim (two outputs in one place): what
    ``ops.qk_norm_rope`` checks, checked here so that the body can call its ``prechecked`` entry."""
    shape = group[0].shape
    if len(shape) != 4 or shape[0] != x.shape[0] or shape[2:] != x.shape[2:]:
        return False
    for t in group:
        if type(t) is not torch.Tensor or t.dtype != x.dtype or t.device != x.device or t.shape != shape \
                or expanded(t):
            return False
    return True


def _eps(*norms: Any) -> Optional[tuple]:
    """The norms' eps as floats (read per call: not in the remembered state), None where one is not a number."""
    eps = []
    for norm in norms:
        value = norm.eps
        if type(value) is not float:
            try:
                value = number(value, "eps")  # the ops' own rule for a number
            except ValueError:
                return None
        eps.append(value)
    return tuple(eps)


def _fused_qkv(joint: Joint, attn: Any, img: List[torch.Tensor], txt: List[torch.Tensor],
               rope: Any) -> Optional[tuple]:
    """The joint q, k, v (``[B, S, H, D]``) from one ``qk_norm_rope`` launch, or None where a tensor does not fit.

    For the complex RoPE forms (QwenImage, Z-Image) the PyTorch tier has the op normalize and concatenate only and
    rotates with diffusers' own complex multiply: torch rounds a complex product differently from the real-form
    rotation where its vectorized loop does not reach (the CPU's scalar tail contracts ``a*c - b*d`` to an FMA;
    CUDA always does), so only diffusers' multiply on each stream's own tensor gives diffusers' bits."""
    q = img[0]
    if type(q) is not torch.Tensor or q.dtype not in FLOAT_DTYPES or not group_fits(q, img) \
            or (txt and not group_fits(q, txt)) or (joint.rope is not None and q.shape[-1] % 2):
        return None
    names = _NORMS if txt else _QK_NORMS
    if not _norms_fit(joint, attn, q, names):
        return None
    s_txt = txt[0].shape[1] if txt else 0
    tables = _tables(joint, rope, q, s_txt)
    modules = attn._modules  # the norms, read from the dict (Module.__getattr__ costs a microsecond a lookup)
    norm_q, norm_k = modules["norm_q"], modules["norm_k"]
    norm_qt, norm_kt = (modules["norm_added_q"], modules["norm_added_k"]) if txt else (norm_q, norm_k)
    eps = _eps(norm_q, norm_k, norm_qt, norm_kt) if tables is not None else None
    if eps is None:
        return None
    own_rotation = joint.rope in _COMPLEX and _tiers().choose_tier(q.device.type, None) == "torch"
    text = {}
    if txt:
        text = dict(v=img[2], q_txt=txt[0], k_txt=txt[1], v_txt=txt[2], q_txt_weight=norm_qt._parameters["weight"],
                    k_txt_weight=norm_kt._parameters["weight"])
    form = "half_each" if joint.rope == "half_each" else "interleaved"
    q, k, v = _qk_ops().prechecked(q, img[1], *((None, None) if own_rotation else tables),
                                   norm_q._parameters["weight"], norm_k._parameters["weight"], eps,
                                   rounding=joint.rounding, rope=form, text_first=joint.text_first, **text)
    if own_rotation and joint.rope == "complex_batch":
        q, k = _rotate_complex(q, rope), _rotate_complex(k, rope)
    elif own_rotation:
        module, (img_freqs, txt_freqs) = sys.modules[joint.module], rope

        def rotate(t: torch.Tensor) -> torch.Tensor:  # diffusers' four calls and its concat
            return torch.cat([module.apply_rotary_emb_qwen(t[:, :s_txt], txt_freqs, use_real=False),
                              module.apply_rotary_emb_qwen(t[:, s_txt:], img_freqs, use_real=False)], dim=1)

        q, k = rotate(q), rotate(k)
    return q, k, (v if txt else img[2])


def _diffusers_qkv(joint: Joint, attn: Any, img: List[torch.Tensor], txt: List[torch.Tensor], rope: Any) -> tuple:
    """diffusers 0.42.1's code for the same stretch: each stream's norms (where present), its rotation, the concat."""
    def normed(t: torch.Tensor, norm: Any) -> torch.Tensor:
        # FLUX's processors (torch.nn.RMSNorm, "once") call their norms unconditionally: None raises, as there
        return norm(t) if norm is not None or joint.rounding == "once" else t

    img = [normed(img[0], attn.norm_q), normed(img[1], attn.norm_k), img[2]]
    if txt:
        txt = [normed(txt[0], attn.norm_added_q), normed(txt[1], attn.norm_added_k), txt[2]]
    if joint.rope == "complex":
        module, (img_freqs, txt_freqs) = sys.modules[joint.module], rope
        for stream, freqs in ((img, img_freqs), (txt, txt_freqs)):
            stream[0], stream[1] = (module.apply_rotary_emb_qwen(t, freqs, use_real=False) for t in stream[:2])
    elif joint.rope == "complex_batch":
        img[0], img[1] = _rotate_complex(img[0], rope), _rotate_complex(img[1], rope)
    elif joint.rope == "half_each":  # Ideogram 4's processor
        rotate_half, (cos, sin) = sys.modules[joint.module]._rotate_half, rope
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        img[0], img[1] = ((t * cos) + (rotate_half(t) * sin) for t in img[:2])
    elif joint.rope == "image_rows" and rope is not None:
        from diffusers.models.embeddings import apply_rotary_emb  # as diffusers imports it, per call

        img[0], img[1] = (apply_rotary_emb(t, rope, sequence_dim=1) for t in img[:2])
    joined = img
    if txt:
        first, second = (txt, img) if joint.text_first else (img, txt)
        joined = [torch.cat([a, b], dim=1) for a, b in zip(first, second)]
    if joint.rope == "joint_rows":  # FLUX: after the concat, every row, through the module's global
        apply_rotary_emb = sys.modules[joint.module].apply_rotary_emb
        joined[0], joined[1] = (apply_rotary_emb(t, rope, sequence_dim=1) for t in joined[:2])
    return tuple(joined)


def _across_heads_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, rope: Any) -> Optional[tuple]:
    """q and k ``[B, S, H * D]`` normalized over their width (and rotated) by one ``ops.rms_norm_rope`` launch, or
    None where a tensor does not fit the op."""
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and query.dim() == 3 and key.dim() == 3
            and plain_rms_norm(attn.norm_q, query) and plain_rms_norm(attn.norm_k, key)):
        return None
    cos = sin = None
    if rope is not None:
        cos, sin = (t[0, :, 0] for t in rope)  # [S, head_dim] views
    try:
        return _across_ops().rms_norm_rope(query, key, q_weight=attn.norm_q.weight, k_weight=attn.norm_k.weight,
                                           eps_q=attn.norm_q.eps, eps_k=attn.norm_k.eps, cos=cos, sin=sin)
    except ValueError:  # e.g. a projection returned another dtype or width; the op checks before it computes
        return None


def _rotate_wan(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    # diffusers 0.42.1 WanAttnProcessor.__call__'s nested apply_rotary_emb (used when the op does not fit)
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def _across_heads_qkv(joint: Joint, attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      rope: Any) -> tuple:
    """Wan's stretch (``norm_span="inner"``): the norms over all heads, the split, the rotation; fused where it fits,
    else diffusers 0.42.1's code."""
    qk = _across_heads_qk(attn, query, key, rope)
    query, key = (attn.norm_q(query), attn.norm_k(key)) if qk is None else qk
    query, key, value = _split(joint, attn, [query, key, value], 0)
    if qk is None and rope is not None:
        query, key = _rotate_wan(query, *rope), _rotate_wan(key, *rope)
    return query, key, value


def qkv(joint: Joint, attn: Any, img: List[torch.Tensor], txt: List[torch.Tensor], rope: Any) -> tuple:
    """The joint ``[B, S, H, D]`` q, k, v of a stream's projections ``img`` (and ``txt``: the text stream's, or
    empty): heads split, q and k normalized and rotated, the streams concatenated."""
    if joint.norm_span == "inner":
        return _across_heads_qkv(joint, attn, *img, rope)
    key_width = img[1].shape[-1] if joint.head_split == "view" else 0
    img = _split(joint, attn, img, key_width)
    txt = _split(joint, attn, txt, key_width) if txt else txt
    fused = _fused_qkv(joint, attn, img, txt, rope)
    return fused if fused is not None else _diffusers_qkv(joint, attn, img, txt, rope)


def attention(joint: Joint, processor: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: Optional[torch.Tensor], parallel: bool = True) -> torch.Tensor:
    """Attention over ``[B, S, H, D]`` q, k, v as the processor calls it, ``[B, S, H * D]`` in q's dtype;
    ``parallel``: with the processor's context-parallel config (if any)."""
    if joint.sdpa:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).reshape(q.shape[0], -1, q.shape[2] * q.shape[3]).to(q.dtype)
    out = sys.modules[joint.module].dispatch_attention_fn(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, backend=processor._attention_backend,
        parallel_config=processor._parallel_config if parallel else None)
    return out.flatten(2, 3).to(q.dtype)


def _project_out(joint: Joint, attn: Any, image: torch.Tensor, text: Optional[torch.Tensor]) -> Any:
    if text is None and not joint.single_out:
        return image
    if joint.contiguous_out:
        image = image.contiguous()
        text = text.contiguous() if text is not None else None
    if text is not None and not (joint.context_pre_only and attn.context_pre_only) \
            and not (joint.optional_out and getattr(attn, "to_add_out", None) is None):
        text = linear(attn.to_add_out, text)
    to_out = getattr(attn, "to_out", None)
    if to_out is not None or not joint.optional_out:
        image = linear(to_out[0], image)
        if joint.out_dropout and len(to_out) > 1:
            image = dropout(to_out[1], image)
    return image if text is None else (image, text)


def _projections(joint: Joint, attn: Any, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor]) -> Tuple[list, list]:
    """Each stream's q, k, v projections (the text's empty where it has none), each a module call."""
    if joint.kv_from_context:  # Wan: the context is k and v's input in cross-attention
        return list(sys.modules[joint.module]._get_qkv_projections(attn, hidden_states, encoder_hidden_states)), []
    texts = encoder_hidden_states is not None
    if joint.flux_projections:
        texts = texts and attn.added_kv_proj_dim is not None
        if attn.fused_projections:
            projected = sys.modules[joint.module]._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
            return list(projected[:3]), list(projected[3:]) if texts else []
    img = [linear(attn.to_q, hidden_states), linear(attn.to_k, hidden_states), linear(attn.to_v, hidden_states)]
    if not texts:
        return img, []
    return img, [linear(attn.add_q_proj, encoder_hidden_states), linear(attn.add_k_proj, encoder_hidden_states),
                 linear(attn.add_v_proj, encoder_hidden_states)]


def native_backend(processor: Any) -> bool:
    """The call goes to diffusers' native backend (``torch.nn.functional.scaled_dot_product_attention``, which turns a
    boolean mask into an additive one in every call) without context parallelism."""
    if processor._parallel_config is not None:
        return False
    backend = processor._attention_backend
    if backend is None:
        registry = sys.modules["diffusers.models.attention_dispatch"]._AttentionBackendRegistry
        backend = registry.get_active_backend()[0]
    return getattr(backend, "value", backend) == "native"


def attend(joint: Joint, processor: Any, attn: Any, hidden_states: torch.Tensor,
           encoder_hidden_states: Optional[torch.Tensor], rope: Any = None,
           mask: Callable[[int, torch.dtype], Optional[torch.Tensor]] = lambda rows, dtype: None) -> Any:
    """The processor's output for a call its body covers: ``image`` or ``(image, text)`` as the processor returns
    them. ``mask(joint_rows, dtype)`` builds the attention mask once q is known (None: none)."""
    q, k, v = qkv(joint, attn, *_projections(joint, attn, hidden_states, encoder_hidden_states), rope)
    self_attention = encoder_hidden_states is None
    out = attention(joint, processor, q, k, v, mask(q.shape[1], q.dtype),
                    parallel=self_attention or not joint.kv_from_context)
    if self_attention or joint.kv_from_context:
        return _project_out(joint, attn, out, None)
    # The processors' slices, as one call (each slice is an op of its own: a microsecond or two of host time)
    if joint.text_first:
        s_txt = encoder_hidden_states.shape[1]
        text, image = out.split_with_sizes([s_txt, out.shape[1] - s_txt], dim=1)
    else:
        image_rows = hidden_states.shape[1]
        image, text = out.split_with_sizes([image_rows, out.shape[1] - image_rows], dim=1)
    return _project_out(joint, attn, image, text)
