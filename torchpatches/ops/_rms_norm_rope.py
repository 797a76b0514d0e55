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

``rope="split"``: LTX-2's split RoPE (``transformer_ltx2.apply_split_rotary_emb``): fp32 per-head tables
``[B, H, S, D/2]`` (any strides with a unit-stride last dim: the model's ``swapaxes`` views), half-split pairs
``(a, b) = (n[j], n[j + D/2])`` of each head become ``(a * cos[j] - b * sin[j], b * cos[j] + a * sin[j])`` in fp32,
rounded once. ``k_cos``/``k_sin`` rotate k by tables of its own (LTX-2's audio-to-video and video-to-audio
attentions: ``[B, H, S_k, D/2]``, q and k of different lengths); without them k takes q's (``S_k == S_q``).

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

__all__ = ["rms_norm_rope", "force_tier", "ROPES"]

#: ``"interleaved"``: Wan's ``[S, D]`` tables, interleaved pairs; ``"split"``: LTX-2's ``[B, H, S, D/2]`` tables,
#: half-split pairs, separate k tables.
ROPES = ("interleaved", "split")


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


def _split_rope_torch(x: torch.Tensor, freqs: tuple) -> torch.Tensor:
    """diffusers 0.42.1 ``transformer_ltx2.apply_split_rotary_emb``, verbatim but its odd-width check (the op's
    checks exclude odd widths)."""
    cos, sin = freqs

    x_dtype = x.dtype
    needs_reshape = False
    if x.ndim != 4 and cos.ndim == 4:
        # cos is (b, h, t, r) -> reshape x to (b, h, t, dim_per_head)
        b, h, t, _ = cos.shape
        x = x.reshape(b, t, h, -1).swapaxes(1, 2)
        needs_reshape = True

    # Split last dim (2*r) into (d=2, r)
    last = x.shape[-1]
    r = last // 2

    # (..., 2, r)
    split_x = x.reshape(*x.shape[:-1], 2, r).float()  # Explicitly upcast to float
    first_x = split_x[..., :1, :]  # (..., 1, r)
    second_x = split_x[..., 1:, :]  # (..., 1, r)

    cos_u = cos.unsqueeze(-2)  # broadcast to (..., 1, r) against (..., 2, r)
    sin_u = sin.unsqueeze(-2)

    out = split_x * cos_u
    first_out = out[..., :1, :]
    second_out = out[..., 1:, :]

    first_out.addcmul_(-sin_u, second_x)
    second_out.addcmul_(sin_u, first_x)

    out = out.reshape(*out.shape[:-2], last)

    if needs_reshape:
        out = out.swapaxes(1, 2).reshape(b, t, -1)

    out = out.to(dtype=x_dtype)
    return out


def _torch_tier(q, k, wq, wk, eps, cos, sin, rope="interleaved", k_cos=None, k_sin=None) -> list[torch.Tensor]:
    q = F.rms_norm(q, (q.shape[-1],), wq, eps[0])
    k = F.rms_norm(k, (k.shape[-1],), wk, eps[1])
    if cos is not None and rope == "split":
        q = _split_rope_torch(q, (cos, sin))
        k = _split_rope_torch(k, (k_cos, k_sin) if k_cos is not None else (cos, sin))
    elif cos is not None:
        q, k = _rope_torch(q, cos, sin), _rope_torch(k, cos, sin)
    return [q, k]


# ------------------------------------------------------------------------------------------ dispatch


def _impl(q, k, wq, wk, eps, cos, sin, tier, rope="interleaved", k_cos=None, k_sin=None) -> list[torch.Tensor]:
    eps = tuple(eps)
    if tier == "torch":
        return _torch_tier(q, k, wq, wk, eps, cos, sin, rope, k_cos, k_sin)
    from . import _rms_norm_rope_triton

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if rope == "split" and cos is not None:
        _rms_norm_rope_triton.launch_split(q, k, wq, wk, eps, (cos, sin), (k_cos, k_sin) if k_cos is not None
                                           else (cos, sin), q_out, k_out)
    else:
        _rms_norm_rope_triton.launch(q, k, wq, wk, eps, cos, sin, q_out, k_out)
    return [q_out, k_out]


@torch.library.custom_op("torchpatches::rms_norm_rope", mutates_args=())
def _rms_norm_rope_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: list[float], cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                      tier: str, rope: str = "interleaved", k_cos: Optional[torch.Tensor] = None,
                      k_sin: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    return _impl(q, k, q_weight, k_weight, tuple(eps), cos, sin, tier, rope, k_cos, k_sin)


@_rms_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, eps, cos, sin, tier, rope="interleaved", k_cos=None, k_sin=None):
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


def _check_split(cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], x: torch.Tensor, name: str) -> tuple:
    """LTX-2's split tables for ``x`` ``[B, S, W]``: fp32 ``[B, H, S, D/2]`` with ``H * D == W`` (unit-stride last
    dim: a copy otherwise)."""
    for t, n in ((cos, f"{name}cos"), (sin, f"{name}sin")):
        _args.tensor(t, n)
        if t.dtype != torch.float32 or t.device != x.device or t.dim() != 4:
            raise ValueError(f"{n} must be a 4-D [B, H, S, D/2] fp32 tensor on {x.device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    B, H, S, R = cos.shape
    if sin.shape != cos.shape or B != x.shape[0] or S != x.shape[1] or R == 0 or H * 2 * R != x.shape[2]:
        raise ValueError(f"{name}cos/{name}sin must both be [B, H, S, D/2] = [{x.shape[0]}, H, {x.shape[1]}, D/2] "
                         f"with H * D = {x.shape[2]}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))


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
    rope: str = "interleaved",
    k_cos: Optional[torch.Tensor] = None,
    k_sin: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm q and k over their full width, then (with ``cos``/``sin``) Wan's RoPE per head, or LTX-2's split RoPE
    (``rope="split"``, k by ``k_cos``/``k_sin`` where given): ``(q, k)``.

    Raises:
        ValueError: on any input that does not fit, before anything is computed.
    """
    if rope not in ROPES:
        raise ValueError(f"rope must be one of {ROPES}, got {rope!r}")
    q = _check_rows(q, "q", None)
    k = _check_rows(k, "k", q)
    wq, wk = _check_weight(q_weight, "q_weight", q), _check_weight(k_weight, "k_weight", q)
    if rope == "split" and (cos is not None or sin is not None):
        cos, sin = _check_split(cos, sin, q, "")
        k_cos, k_sin = _check_split(*((k_cos, k_sin) if k_cos is not None or k_sin is not None else (cos, sin)),
                                    k, "k_")
    elif k_cos is not None or k_sin is not None:
        raise ValueError("k_cos/k_sin need rope='split' with cos/sin")
    else:
        _check_rotary(cos, sin, q, k)
    eps = [_args.number(eps_q, "eps_q"), _args.number(eps_k, "eps_k")]
    grad = needs_grad(q, k, wq, wk, cos, sin, k_cos, k_sin)
    chosen = choose_tier(q.device.type, tier, grad)
    outs = _dispatch.run(q, grad, _impl, _rms_norm_rope_op, q, k, wq, wk, eps, cos, sin, chosen, rope, k_cos, k_sin)
    return outs[0], outs[1]


def prechecked_split(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: tuple,
                     q_tables: Optional[tuple], k_tables: Optional[tuple]) -> list[torch.Tensor]:
    """:func:`rms_norm_rope` (``rope="split"`` with tables, or no RoPE) for a caller that has checked what it checks
    (the ``ltx2`` pattern: plain ``[B, S, W]`` rows of one dtype, weights of it, fp32 ``[B, H, S, D/2]`` tables that
    fit, no tracing). Kept: unit-stride copies, a forced tier, the PyTorch tier when autograd records."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = sin = k_cos = k_sin = None
    if q_tables is not None:
        cos, sin, k_cos, k_sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (*q_tables, *k_tables))
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, wq, wk, cos, sin))
    return _impl(q, k, wq, wk, eps, cos, sin, choose_tier(q.device.type, None, grad), "split", k_cos, k_sin)
