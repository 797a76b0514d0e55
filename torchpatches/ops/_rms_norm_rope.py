"""q/k RMSNorm over the full width (across heads) + RoPE, for q and k in one launch: what Wan's attention
processor does between its projections and the attention call.

Usable without any patching::

    q, k = rms_norm_rope(q, k, q_weight=wq, k_weight=wk, eps_q=1e-6, eps_k=1e-6, cos=cos, sin=sin)
    q, k = rms_norm_rope(q, k_text, q_weight=wq, k_weight=wk, eps_q=1e-6, eps_k=1e-6)   # no RoPE

``q`` is ``[B, S_q, W]`` and ``k`` ``[B, S_k, W]`` (the projections' layout before ``unflatten``; any strides
with a unit-stride last dim, e.g. chunks of a fused QKV projection). Each token row is RMS-normalized over
its whole width ``W`` (``torch.nn.RMSNorm(W)``, diffusers' ``qk_norm="rms_norm_across_heads"``) with a ``[W]``
weight of the tensors' dtype. With ``cos``/``sin`` (fp32 ``[S, D]``, ``D`` the head dim, ``W`` a multiple of
``D``, ``S_q == S_k == S``) every head is then rotated as Wan's ``apply_rotary_emb`` does: interleaved pairs
``(a, b) = (x[2i], x[2i + 1])`` become ``(a * cos[2i] - b * sin[2i + 1], a * sin[2i + 1] + b * cos[2i])``.
Returns new contiguous ``[B, S, W]`` tensors (``unflatten(2, (H, D))`` views them as heads).

Numerics: torch's RMSNorm (fp32 statistics, ``x * rstd * w`` rounded once, as its fused kernel) followed by
Wan's RoPE (fp32 products on the rounded norm output, rounded once). Differences from diffusers come only
from the fp32 reduction order and fused multiply-adds: at most one ulp of the output dtype.

Tiers (``_tiers``): Triton on CUDA (one launch for q and k), PyTorch elsewhere (diffusers' own ops, the
reference) and for every call autograd records (``tier="triton"`` then raises ``ValueError``). Traced, the
call is one ``torchpatches::rms_norm_rope`` custom op with a fake (``_dispatch``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._runtime import args as _args, dispatch as _dispatch
from ._runtime.tiers import choose_tier, force_tier, needs_grad

__all__ = ["rms_norm_rope", "force_tier"]


# ------------------------------------------------------------------------------------------ torch tier


def _rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers 0.42.1 WanAttnProcessor's apply_rotary_emb on [B, S, H, D], freqs [1, S, 1, D]
    heads = x.unflatten(2, (-1, cos.shape[-1]))
    x1, x2 = heads.unflatten(-1, (-1, 2)).unbind(-1)
    c = cos[None, :, None][..., 0::2]
    s = sin[None, :, None][..., 1::2]
    out = torch.empty_like(heads)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(heads).flatten(2)


def _torch_tier(q, k, wq, wk, eps, cos, sin) -> list[torch.Tensor]:
    q = F.rms_norm(q, (q.shape[-1],), wq, eps[0])
    k = F.rms_norm(k, (k.shape[-1],), wk, eps[1])
    if cos is not None:
        q, k = _rope_torch(q, cos, sin), _rope_torch(k, cos, sin)
    return [q, k]


# ------------------------------------------------------------------------------------------ dispatch


def _impl(q, k, wq, wk, eps, cos, sin, tier) -> list[torch.Tensor]:
    eps = tuple(eps)
    if tier == "torch":
        return _torch_tier(q, k, wq, wk, eps, cos, sin)
    from . import _rms_norm_rope_triton

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _rms_norm_rope_triton.launch(q, k, wq, wk, eps, cos, sin, q_out, k_out)
    return [q_out, k_out]


@torch.library.custom_op("torchpatches::rms_norm_rope", mutates_args=())
def _rms_norm_rope_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: list[float], cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                      tier: str) -> list[torch.Tensor]:
    return _impl(q, k, q_weight, k_weight, tuple(eps), cos, sin, tier)


@_rms_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, eps, cos, sin, tier):
    return [q.new_empty(q.shape), k.new_empty(k.shape)]


# ------------------------------------------------------------------------------------------ validation


def _check_rows(t: torch.Tensor, name: str, ref: Optional[torch.Tensor]) -> torch.Tensor:
    _args.float_tensor(t, name, 3, "[B, S, W]")
    if ref is not None and (t.dtype != ref.dtype or t.device != ref.device or t.shape[0] != ref.shape[0]
                            or t.shape[2] != ref.shape[2]):
        raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} on {t.device} does not match q "
                         f"{tuple(ref.shape)} {ref.dtype} on {ref.device} in batch, width, dtype or device")
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _check_weight(w: torch.Tensor, name: str, q: torch.Tensor) -> torch.Tensor:
    _args.tensor(w, name)
    if w.shape != q.shape[-1:]:
        raise ValueError(f"{name} must be a [{q.shape[-1]}] tensor, got {tuple(w.shape)}")
    if w.dtype != q.dtype or w.device != q.device:
        # torch.nn.RMSNorm only runs its fused kernel (one rounding) when the dtypes match.
        raise ValueError(f"{name} is {w.dtype} on {w.device}; expected {q.dtype} on {q.device}")
    return w.contiguous()


def _check_rotary(cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    if cos is None and sin is None:
        return
    for t, name in ((cos, "cos"), (sin, "sin")):
        _args.tensor(t, name)
        if t.dtype != torch.float32 or t.device != q.device or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D [S, D] fp32 tensor on {q.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    S, D = cos.shape
    if sin.shape != cos.shape or D == 0 or D % 2 or q.shape[-1] % D:
        raise ValueError(f"cos/sin must both be [S, D] with an even head dim D dividing the width {q.shape[-1]}, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.shape[1] != S or k.shape[1] != S:
        raise ValueError(f"with RoPE q and k need S = {S} tokens, got {q.shape[1]} and {k.shape[1]}")


@_dispatch.public
def rms_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps_q: float,
    eps_k: float,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm q and k over their full width, then (with ``cos``/``sin``) Wan's RoPE per head: ``(q, k)``.

    Raises:
        ValueError: on any input that does not fit, before anything is computed.
    """
    q = _check_rows(q, "q", None)
    k = _check_rows(k, "k", q)
    wq, wk = _check_weight(q_weight, "q_weight", q), _check_weight(k_weight, "k_weight", q)
    _check_rotary(cos, sin, q, k)
    eps = [_args.number(eps_q, "eps_q"), _args.number(eps_k, "eps_k")]
    grad = needs_grad(q, k, wq, wk, cos, sin)
    chosen = choose_tier(q.device.type, tier, grad)
    outs = _dispatch.run(q, grad, _impl, _rms_norm_rope_op, q, k, wq, wk, eps, cos, sin, chosen)
    return outs[0], outs[1]
