"""q/k RMSNorm + RoPE (+ the text/image concat of joint attention) in one op: what a FLUX processor does
between its projections and the attention call.

Usable without any patching::

    q, k, v = qk_norm_rope(q, k, cos, sin, q_weight=wq, k_weight=wk, eps_q=1e-6, eps_k=1e-6)
    # joint attention (FLUX double blocks): text rows first, as torch.cat([txt, img], dim=1)
    q, k, v = qk_norm_rope(q, k, cos, sin, q_weight=wq, k_weight=wk, eps_q=1e-6, eps_k=1e-6,
                           v=v, q_txt=tq, k_txt=tk, v_txt=tv, q_txt_weight=wtq, k_txt_weight=wtk,
                           eps_q_txt=1e-6, eps_k_txt=1e-6)

q, k (and v) are ``[B, S, H, D]`` views (diffusers' layout after ``unflatten``; any strides with a
unit-stride head dim, e.g. chunks of a fused QKV projection); the text tensors are
``[B, S_txt, H, D]``. ``cos``/``sin`` are fp32 ``[S_txt + S, D]`` with one value per element and
interleaved pairs (diffusers' FLUX ``FluxPosEmbed`` / ``Flux2PosEmbed`` output), rows in the output's
order (text rows first unless ``text_first=False``), shared by every sample; or per-sample
``[B, S_txt + S, D]`` (sample ``b`` rotated by ``cos[b]``, ``sin[b]``), where a batch of 1 or a batch
stride of 0 (``t.expand(B, S_txt + S, D)``) shares one table. cos and sin of one shape, unit-stride last
dim (other strides free). The weights are
``[D]`` RMSNorm weights in the tensors' dtype. Returns new contiguous ``q``, ``k`` and ``v``
(``[B, S_txt + S, H, D]``); without text tensors ``v`` is returned as given (nothing to concat).

Options for other models (SD3's ``JointAttnProcessor2_0``):

- ``cos=None, sin=None``: no RoPE (q/k RMSNorm and the concat only; any head dim);
- ``text_first=False``: image rows first, as ``torch.cat([img, txt])`` (SD3's order; FLUX puts text first);
- ``rounding="each"``: diffusers' own ``RMSNorm`` (``normalization.RMSNorm``), which rounds ``x * rstd`` to
  the weight's dtype before multiplying by the weight (two roundings); the default ``"once"`` is
  ``torch.nn.RMSNorm``'s fused kernel (``x * rstd * w`` rounded once); ``"zero_centered"`` is Krea 2's
  ``Krea2RMSNorm`` (``F.rms_norm(x.float(), weight=w + 1.0).to(x.dtype)``: ``1 + w`` in the weight's dtype, which
  may be any float dtype, then as ``"once"``).
- ``rounding="fp32"``: FLUX.3's chain (``Flux3AttnProcessor``): ``norm(q.float())`` with a ``torch.nn.RMSNorm``
  whose weight may be fp32 (``_keep_in_fp32_modules``) or q's dtype, RoPE on the fp32 result, one rounding to
  q's dtype at the end (``.to(value.dtype)``); weights of any float dtype.
- ``k_repeat=r`` (GQA, no text tensors): k has ``H / r`` heads; the returned k is normalized, rotated and repeated
  ``r`` times over heads (``repeat_interleave(r, dim=2)``, Krea 2's order), so it has q's heads.
- ``rope="half_each"``: Ideogram 4's RoPE (``transformer_ideogram4.Ideogram4AttnProcessor``): half-split pairs
  ``(n[j], n[j + D/2])``, ``rotate_half(n) = cat(-n[D/2:], n[:D/2])``, tables of q's dtype (the model casts
  them), and ``n * cos + rotate_half(n) * sin`` in q's dtype, every product and the sum rounded on its own
  (``round(round(n * cos) + round(rotate_half(n) * sin))``). The default ``"interleaved"`` is the fp32 form
  above. Ideogram's use: ``rounding="each", rope="half_each"``, no text tensors, per-sample ``[B, L, D]`` tables.

Numerics: torch.nn.RMSNorm (fp32 statistics, ``x * rstd * w`` rounded once, as torch's fused kernel)
followed by diffusers' ``apply_rotary_emb`` (fp32 ``n * cos + rotate(n) * sin``, rounded once).
Differences from diffusers come only from fp32 reduction order / fused multiply-adds crossing a
rounding boundary: at most one ulp of the output dtype.

Tiers (``_tiers``): Triton on CUDA (one launch for q, k, v), PyTorch elsewhere and for every call
autograd records (``tier="triton"`` with tensors requiring grad raises ``ValueError``). Under
``torch.compile`` the call is one ``torchpatches::qk_norm_rope`` custom op (with a fake).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .._core.lazy import lazy_module
from ._runtime import args as _args, dispatch as _dispatch
from ._runtime.memory import check_no_overlap
from ._runtime.tiers import FLOAT_DTYPES, choose_tier, force_tier, needs_grad

__all__ = ["qk_norm_rope", "prechecked", "force_tier", "ROUNDINGS", "ROPES"]

#: ``"once"``: torch.nn.RMSNorm (one rounding); ``"each"``: diffusers' RMSNorm (``x * rstd`` rounded, then ``* w``);
#: ``"zero_centered"``: Krea 2's RMSNorm (``1 + w``, fp32 compute, one rounding);
#: ``"fp32"``: torch.nn.RMSNorm of ``x.float()`` and RoPE in fp32, rounded once after RoPE (FLUX.3).
ROUNDINGS = ("once", "each", "zero_centered", "fp32")
#: ``"interleaved"``: pairs ``(n[2i], n[2i+1])``, fp32 tables and math, rounded once (FLUX, QwenImage, Z-Image);
#: ``"half_each"``: pairs ``(n[j], n[j + D/2])``, tables and every op in q's dtype, each rounded (Ideogram 4).
ROPES = ("interleaved", "half_each")


# ------------------------------------------------------------------------------------------ torch tier


def _rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers.models.embeddings.apply_rotary_emb(use_real=True, use_real_unbind_dim=-1, sequence_dim=1);
    # [S, D] tables broadcast over the batch as [S, 1, D], [B or 1, S, D] ones as [B or 1, S, 1, D].
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x_real, x_imag = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2).unbind(-1)  # not -1: zero-size tensors
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # diffusers.models.transformers.transformer_ideogram4._rotate_half, verbatim.
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_half_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Ideogram4AttnProcessor's expression: tables of x's dtype, every op in that dtype (each one rounds);
    # [S, D] tables broadcast as [S, 1, D], [B or 1, S, D] ones as [B or 1, S, 1, D] (diffusers' unsqueeze(2)).
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x * cos) + (_rotate_half(x) * sin)


def _rms_norm_each(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # diffusers.models.normalization.RMSNorm.forward (weight present, of x's dtype), op for op.
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if w.dtype in (torch.float16, torch.bfloat16):
        x = x.to(w.dtype)
    return x * w


def _rms_norm_zero_centered(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # diffusers.models.transformers.transformer_krea2.Krea2RMSNorm.forward, verbatim.
    dtype = x.dtype
    x = F.rms_norm(x.float(), (x.shape[-1],), weight=w + 1.0, eps=eps)
    return x.to(dtype)


def _torch_tier(q, k, v, qt, kt, vt, wq, wk, wqt, wkt, eps, cos, sin, text_first, rounding, half, k_repeat):
    if rounding == "fp32":  # FLUX.3: norm_q(query.float()), RoPE in fp32, then .to(value.dtype): one rounding
        f = lambda t: None if t is None else t.float()  # noqa: E731
        outs = _torch_tier(f(q), f(k), v, f(qt), f(kt), vt, wq, wk, wqt, wkt, eps, cos, sin, text_first, "once",
                           half, k_repeat)
        return [outs[0].to(q.dtype), None if outs[1] is None else outs[1].to(q.dtype), outs[2]]
    norm = {"each": _rms_norm_each, "zero_centered": _rms_norm_zero_centered}.get(
        rounding, lambda x, w, e: F.rms_norm(x, (x.shape[-1],), w, e))
    join = (lambda t, i: torch.cat([t, i], dim=1)) if text_first else (lambda t, i: torch.cat([i, t], dim=1))
    q = norm(q, wq, eps[0])
    k = norm(k, wk, eps[1]) if k is not None else None  # k None: q alone (prechecked)
    if qt is not None:
        q = join(norm(qt, wqt, eps[2]), q)
        k = join(norm(kt, wkt, eps[3]), k)
        v = join(vt, v)
    if cos is not None:
        rot = _rope_half_torch if half else _rope_torch
        q, k = rot(q, cos, sin), (rot(k, cos, sin) if k is not None else None)
    if k_repeat > 1:  # Krea2AttnProcessor: key.repeat_interleave(num_key_value_groups, dim=2) after the rotation
        k = k.repeat_interleave(k_repeat, dim=2)
    return [q, k, v]


# ------------------------------------------------------------------------------------------ dispatch


def _impl(q, k, v, qt, kt, vt, wq, wk, wqt, wkt, eps, cos, sin, text_first, rounding, rope,
          tier, k_repeat=1, k_prefix=None) -> list[torch.Tensor]:
    eps = tuple(eps)
    each = rounding == "each"
    half = rope == "half_each"
    chain = rounding == "fp32"
    if tier == "torch":
        outs = _torch_tier(q, k, v, qt, kt, vt, wq, wk, wqt, wkt, eps, cos, sin, text_first, rounding, half, k_repeat)
        if k_prefix is not None:  # QwenImage 2.1's KV cache: torch.cat([cached_k, key], dim=1)
            outs[1] = torch.cat([k_prefix, outs[1]], dim=1)
        return outs
    kernels = _triton_tier()
    B, S, H, D = q.shape
    S_all = S + (qt.shape[1] if qt is not None else 0)
    new = lambda: torch.empty((B, S_all, H, D), dtype=q.dtype, device=q.device)  # noqa: E731
    q_out, k_out = new(), (new() if k is not None else None)
    k_whole = k_out
    if k_prefix is not None:  # k's rows written behind the prefix's copy: the cat costs no pass over k
        P = k_prefix.shape[1]
        k_whole = torch.empty((B, P + S_all, H, D), dtype=q.dtype, device=q.device)
        k_whole[:, :P].copy_(k_prefix)
        k_out = k_whole[:, P:]
    v_out = new() if qt is not None else None
    if qt is not None and not text_first:
        # The kernel writes its "first" group's rows first: hand it the image tensors there.
        q, k, v, qt, kt, vt, wq, wk, wqt, wkt = qt, kt, vt, q, k, v, wqt, wkt, wq, wk
        eps = (eps[2], eps[3], eps[0], eps[1])
    kernels.launch(q, k, v, qt, kt, vt, wq, wk, wqt, wkt, eps, cos, sin, q_out, k_out, v_out, each=each,
                   half_split=half, zero_centered=rounding == "zero_centered", k_repeat=k_repeat, chain=chain)
    return [q_out, k_whole, v_out if v_out is not None else v]


#: The Triton tier's module, imported at its first call (it imports triton).
_triton_tier = lazy_module(f"{__package__}._qk_norm_rope_triton")


@torch.library.custom_op("torchpatches::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], q_txt: Optional[torch.Tensor],
                     k_txt: Optional[torch.Tensor], v_txt: Optional[torch.Tensor], q_weight: torch.Tensor,
                     k_weight: torch.Tensor, q_txt_weight: Optional[torch.Tensor],
                     k_txt_weight: Optional[torch.Tensor], eps: list[float], cos: Optional[torch.Tensor],
                     sin: Optional[torch.Tensor], text_first: bool, rounding: str, rope: str,
                     tier: str, k_repeat: int = 1) -> list[torch.Tensor]:
    outs = _impl(q, k, v, q_txt, k_txt, v_txt, q_weight, k_weight, q_txt_weight, k_txt_weight, tuple(eps),
                 cos, sin, text_first, rounding, rope, tier, k_repeat)
    # A custom op may not return an input (v without text tensors): hand back a copy when traced.
    return [o.clone() if o is v else o for o in outs if o is not None]


@_qk_norm_rope_op.register_fake
def _(q, k, v, q_txt, k_txt, v_txt, q_weight, k_weight, q_txt_weight, k_txt_weight, eps, cos, sin, text_first,
      rounding, rope, tier, k_repeat=1):
    B, S, H, D = q.shape
    S_all = S + (q_txt.shape[1] if q_txt is not None else 0)
    n = 3 if v is not None else 2
    return [q.new_empty((B, S_all, H, D)) for _ in range(n)]


# ------------------------------------------------------------------------------------------ validation


def _check_4d(t: Optional[torch.Tensor], name: str, ref: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    _args.float_tensor(t, name, 4, "[B, S, H, D]")
    if ref is not None:
        if t.dtype != ref.dtype or t.device != ref.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; expected {ref.dtype} on {ref.device}")
        if t.shape[0] != ref.shape[0] or t.shape[2:] != ref.shape[2:]:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match q {tuple(ref.shape)} in batch, "
                             "heads or head dim")
    check_no_overlap(t, name)
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_weight(w: Optional[torch.Tensor], name: str, q: torch.Tensor, any_dtype: bool = False
                  ) -> Optional[torch.Tensor]:
    if w is None:
        return None
    if not isinstance(w, torch.Tensor) or w.shape != (q.shape[-1],):
        raise ValueError(f"{name} must be a [{q.shape[-1]}] tensor, got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if (w.dtype != q.dtype and not (any_dtype and w.dtype in FLOAT_DTYPES)) or w.device != q.device:
        # torch.nn.RMSNorm only runs its fused kernel (one rounding) when the dtypes match.
        raise ValueError(f"{name} is {w.dtype} on {w.device}; expected {q.dtype} on {q.device}")
    return w.contiguous()


def _strides_read(t: torch.Tensor) -> tuple:
    """The strides the kernel multiplies by a non-zero index: those of the dims longer than one."""
    return tuple(stride for size, stride in zip(t.shape, t.stride()) if size != 1)


def _same_strides(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The kernel reads a group (q, k, v of one stream; shapes equal) with one set of strides: where they differ
    (rare: e.g. a padded q beside a contiguous k), every tensor of the group is made contiguous. Copying only the
    one that differs is not enough: ``.contiguous()`` of a contiguous tensor is the tensor itself, whose strides
    still differ from a padded one's."""
    first = _strides_read(tensors[0])
    if all(_strides_read(t) == first for t in tensors[1:]):
        return tensors
    return [t.contiguous() for t in tensors]


def _check_rope_args(cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]) -> bool:
    """True when RoPE is wanted; cos and sin come together or not at all."""
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must both be given (RoPE) or both be None (no RoPE)")
    return cos is not None


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, S_all: int, rope: str) -> None:
    """``[S_all, D]`` or ``[B or 1, S_all, D]`` tables on q's device, of one shape, unit-stride last dim; fp32
    (``rope="interleaved"``) or of q's dtype (``"half_each"``)."""
    B, D = q.shape[0], q.shape[-1]
    dtype = q.dtype if rope == "half_each" else torch.float32
    for t, name in ((cos, "cos"), (sin, "sin")):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != q.device:
            if rope == "half_each":
                got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a tensor of q's dtype {q.dtype} on {q.device} with "
                                 f"rope='half_each' (the model casts its tables), got {got}")
            raise ValueError(f"{name} must be an fp32 tensor on {q.device}")
        shape = tuple(t.shape)
        fits = shape == (S_all, D) or (len(shape) == 3 and shape[0] in (1, B) and shape[1:] == (S_all, D))
        if not fits or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [S_txt + S, D] = [{S_all}, {D}] or [B, S_txt + S, D] = "
                             f"[{B}, {S_all}, {D}] (batch 1 or stride 0: one table for all samples) with a "
                             f"unit-stride last dim, got {shape} with strides {tuple(t.stride())}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")


def _unit_head_dim(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def prechecked(q: torch.Tensor, k: Optional[torch.Tensor], cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
               q_weight: torch.Tensor, k_weight: Optional[torch.Tensor], eps: tuple, v: Optional[torch.Tensor] = None,
               q_txt: Optional[torch.Tensor] = None, k_txt: Optional[torch.Tensor] = None,
               v_txt: Optional[torch.Tensor] = None, q_txt_weight: Optional[torch.Tensor] = None,
               k_txt_weight: Optional[torch.Tensor] = None, rounding: str = "once",
               rope: str = "interleaved", k_repeat: int = 1, k_prefix: Optional[torch.Tensor] = None,
               text_first: bool = True) -> tuple:
    """:func:`qk_norm_rope` (text first unless ``text_first=False``; ``eps``: the four floats ``(q, k, q_txt,
    k_txt)``; ``rounding`` and ``rope`` as there, unchecked: one of ``ROUNDINGS`` / ``ROPES``)
    for a caller that has made its checks: the joint-attention body (``patches/_joint_attention``), which
    takes this path only for plain tensors of one float dtype and device whose shapes fit, RoPE tables that fit
    (``[S_txt + S, D]`` there; ``[B or 1, S_txt + S, D]`` would work too, unchecked like the rest),
    stock RMSNorm weights, no expanded view, and nothing traced or transformed. Skipped: those checks (about
    30 us of Python per call on a 2-core CPU, 57 calls per FLUX.1 step). Kept: what the kernel needs (unit-stride
    head dims, one set of strides per group) and the tier choice (a forced tier, autograd recording).
    ``k_repeat`` > 1 (Krea 2's GQA): k with ``H / k_repeat`` heads, no text tensors, read with its own strides.

    ``k=None`` (and ``k_weight=None``; no text tensors): ``q`` alone, normalized and rotated by its own tables, the
    returned k None: Kandinsky 6's cross-attentions, whose q and k differ in length and tables (one launch each).

    ``k_prefix`` (k given, no text tensors, ``k_repeat`` 1): a ``[B, P, H, D]`` tensor of q's dtype and device put
    in front of the returned k as it is, ``torch.cat([k_prefix, k], dim=1)`` (QwenImage 2.1's KV cache: the prompt's
    cached keys, already normalized and rotated); the kernel writes k's rows behind the prefix's copy."""
    joint = q_txt is not None
    if k is None:
        q = _unit_head_dim(q)
    elif joint:
        q, k, v = _same_strides([_unit_head_dim(q), _unit_head_dim(k), _unit_head_dim(v)])
        q_txt, k_txt, v_txt = _same_strides([_unit_head_dim(q_txt), _unit_head_dim(k_txt), _unit_head_dim(v_txt)])
    elif k_repeat > 1:
        q, k = _unit_head_dim(q), _unit_head_dim(k)
    else:
        q, k = _same_strides([_unit_head_dim(q), _unit_head_dim(k)])
    tensors = (q, k, v, q_txt, k_txt, v_txt, q_weight, k_weight, q_txt_weight, k_txt_weight, cos, sin)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    tier = choose_tier(q.device.type, None, grad)
    outs = _impl(q, k, v, q_txt, k_txt, v_txt, q_weight.contiguous(), k_weight.contiguous() if k is not None else None,
                 q_txt_weight.contiguous() if joint else None, k_txt_weight.contiguous() if joint else None,
                 eps, cos, sin, text_first, rounding, rope, tier, k_repeat, k_prefix)
    return outs[0], outs[1], (outs[2] if len(outs) > 2 else v)


@_dispatch.public
def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    *,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps_q: float,
    eps_k: float,
    v: Optional[torch.Tensor] = None,
    q_txt: Optional[torch.Tensor] = None,
    k_txt: Optional[torch.Tensor] = None,
    v_txt: Optional[torch.Tensor] = None,
    q_txt_weight: Optional[torch.Tensor] = None,
    k_txt_weight: Optional[torch.Tensor] = None,
    eps_q_txt: Optional[float] = None,
    eps_k_txt: Optional[float] = None,
    text_first: bool = True,
    rounding: str = "once",
    rope: str = "interleaved",
    k_repeat: int = 1,
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm q and k per head, concat text rows in front (or behind: ``text_first=False``) if given,
    rotate q and k (unless ``cos`` and ``sin`` are None; ``rope``: the form, one of ``ROPES``); returns (q, k, v).

    Raises:
        ValueError: on any input that does not fit, before anything is computed.
    """
    q = _check_4d(q, "q", None)
    if type(k_repeat) is not int or k_repeat < 1 or q.shape[2] % k_repeat:
        raise ValueError(f"k_repeat must be a positive int dividing q's {q.shape[2]} heads, got {k_repeat!r}")
    k = _check_4d(k, "k", q[:, :, ::k_repeat])
    if k.shape != q[:, :, ::k_repeat].shape:
        raise ValueError(f"k shape {tuple(k.shape)} differs from q {tuple(q.shape)} with q's heads / k_repeat")
    if k_repeat > 1 and q_txt is not None:
        raise ValueError("k_repeat > 1 takes no text tensors")
    if not isinstance(rope, str) or rope not in ROPES:
        raise ValueError(f"rope must be one of {ROPES}, got {rope!r}")
    rotates = _check_rope_args(cos, sin)
    if rotates and q.shape[-1] % 2:
        form = "half-split" if rope == "half_each" else "interleaved"
        raise ValueError(f"head dim {q.shape[-1]} must be even for {form} RoPE (rope={rope!r})")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "fp32" and rope != "interleaved":
        raise ValueError("rounding='fp32' (FLUX.3's chain) takes rope='interleaved' only")
    joint = q_txt is not None
    if joint:
        if any(t is None for t in (k_txt, v_txt, v, q_txt_weight, k_txt_weight, eps_q_txt, eps_k_txt)):
            raise ValueError("joint attention needs v, q_txt, k_txt, v_txt, both text weights and both text eps")
        qt = _check_4d(q_txt, "q_txt", q)
        kt, vt = _check_4d(k_txt, "k_txt", q), _check_4d(v_txt, "v_txt", q)
        if not (qt.shape == kt.shape == vt.shape):
            raise ValueError("q_txt, k_txt and v_txt shapes differ")
        v = _check_4d(v, "v", q)
        if v.shape != q.shape:
            raise ValueError(f"v shape {tuple(v.shape)} differs from q {tuple(q.shape)}")
        q, k, v = _same_strides([q, k, v])
        qt, kt, vt = _same_strides([qt, kt, vt])
    else:
        qt = kt = vt = None
        if k_repeat == 1:
            q, k = _same_strides([q, k])
    zc = rounding == "zero_centered"  # Krea 2's weights: any float dtype (its checkpoints keep them in fp32)
    any_dtype = zc or rounding == "fp32"  # FLUX.3's too: fp32 compute, any float weight converts exactly
    wq, wk = _check_weight(q_weight, "q_weight", q, any_dtype), _check_weight(k_weight, "k_weight", q, any_dtype)
    if zc and wq.dtype != wk.dtype:  # the kernel rounds 1 + w to one weight dtype (W_KIND)
        raise ValueError(f"q_weight is {wq.dtype}, k_weight {wk.dtype}: one dtype")
    wqt = _check_weight(q_txt_weight, "q_txt_weight", q, any_dtype) if joint else None
    wkt = _check_weight(k_txt_weight, "k_txt_weight", q, any_dtype) if joint else None
    if zc and joint and not (wqt.dtype == wkt.dtype == wq.dtype):
        raise ValueError("the text weights must have the image weights' dtype")
    if rotates:
        _check_tables(cos, sin, q, q.shape[1] + (qt.shape[1] if joint else 0), rope)
    if v is not None and not isinstance(v, torch.Tensor):
        raise ValueError(f"v must be a torch.Tensor or None, got {type(v).__name__}")
    eps = tuple(_args.number(value, name) for value, name in (
        (eps_q, "eps_q"), (eps_k, "eps_k"), (eps_q_txt if joint else eps_q, "eps_q_txt"),
        (eps_k_txt if joint else eps_k, "eps_k_txt")))
    grad = needs_grad(q, k, v, qt, kt, vt, wq, wk, wqt, wkt, cos, sin)
    chosen = choose_tier(q.device.type, tier, grad)
    outs = _dispatch.run(q, grad, _impl, _qk_norm_rope_op, q, k, v, qt, kt, vt, wq, wk, wqt, wkt, list(eps), cos,
                         sin, bool(text_first), rounding, rope, chosen, k_repeat)
    return outs[0], outs[1], (outs[2] if len(outs) > 2 else v)
