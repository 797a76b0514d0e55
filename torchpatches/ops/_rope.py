"""Rotary position embedding (RoPE) for q and k in one call: FlashInfer -> Triton -> PyTorch.

Usable without any patching. Four public entry points, two cos/sin forms times in-place/out-of-place::

    apply_rope_qk_inplace(q, k, cos, sin, *, interleaved=True, ...)                 -> None
    apply_rope_qk(q, k, cos, sin, *, interleaved=True, ...)                         -> (q_out, k_out)
    apply_rope_qk_with_cache_inplace(q, k, cos_sin_cache, positions, *, interleaved, ...) -> None
    apply_rope_qk_with_cache(q, k, cos_sin_cache, positions, *, interleaved, ...)   -> (q_out, k_out)

Layouts of q and k (``sequence_dim`` says where the tokens are; the head dim is the other one):

- ``[T, H, D]`` token-major (LLM serving), ``sequence_dim=0`` (the default for 3-D);
- ``[B, S, H, D]``, ``sequence_dim=1`` (the default for 4-D; diffusers' FLUX attention processor);
- ``[B, H, S, D]``, ``sequence_dim=2`` (diffusers' ``apply_rotary_emb`` default).

Any strides work as long as the last dim is unit-stride (views such as transposes or slices of a
fused qkv projection); a tensor whose last dim is strided is copied for the Triton tier (and written
back for in-place calls). q and k may have different head counts (GQA); ``k=None`` rotates q only.

Pair conventions (``interleaved``):

- ``True``: GPT-J pairs ``(x[2i], x[2i+1])``, diffusers ``use_real_unbind_dim=-1`` (FLUX);
- ``False``: NeoX/LLaMA halves ``(x[i], x[i + rotary_dim/2])``, diffusers ``use_real_unbind_dim=-2``.

Only the first ``rotary_dim`` elements of each head rotate; the rest pass through unchanged.
Math is fp32 whatever the input dtype (fp32, bf16, fp16), rounded once to the input dtype.

Tiers (``describe_tiers()`` says which exist and why not; ``last_tier()`` says which one ran):

- ``flashinfer``: ``flashinfer.rope.apply_rope_with_cos_sin_cache[_inplace]`` on CUDA for the cache
  form with token-major, fp16/bf16 q and k (both given), head dim 64/128/256;
- ``triton``: one launch for q and k, on CUDA (``torch.library.triton_op`` so Inductor sees the
  kernel), and on CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` (for CI);
- ``torch``: plain PyTorch ops, which Inductor fuses with neighbouring ops under torch.compile.

Choose a tier with ``tier=`` on a call or ``force_tier(...)`` for a block (tests, benchmarks).
Falling back from a tier whose software is missing warns once; the availability query runs
through ``torch.compiler.assume_constant_result``, so it costs no graph break.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._runtime import args as _args, dispatch as _dispatch, memory as _memory
from . import _rope_checks, _rope_library, _rope_tiers, _rope_torch
from ._rope_tiers import describe_tiers, last_tier
from ._runtime.tiers import TIERS, force_tier, forced_tier, jit_tracing, needs_grad

__all__ = [
    "apply_rope_qk_inplace",
    "apply_rope_qk",
    "apply_rope_qk_with_cache_inplace",
    "apply_rope_qk_with_cache",
    "describe_tiers",
    "last_tier",
    "force_tier",
    "TIERS",
]


# ---------------------------------------------------------------------------------------------
# Dispatch: validate, choose the tier, run it.
# ---------------------------------------------------------------------------------------------


def _tier_for(q: torch.Tensor, tier: Optional[str], cache_form: bool, fits: bool, grad: bool) -> str:
    requested = tier if tier is not None else (forced_tier() or "auto")
    if not isinstance(requested, str) or requested not in TIERS + ("auto",):
        raise ValueError(f"unknown RoPE tier {requested!r}; expected one of {TIERS} or None")
    if requested == "auto" and jit_tracing():
        requested = "torch"  # torch.jit.trace: a kernel launch would see traced sizes
    chosen, refusal = _rope_tiers.select_tier(q.device.type, requested, cache_form, bool(fits), bool(grad))
    if chosen is None:
        raise ValueError(refusal)
    return chosen


def _run(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
         positions: Optional[torch.Tensor], seq_dim: int, interleaved: bool, cos_half: bool,
         rotary_dim: int, tier: str, inplace: bool):
    """Run the Triton or PyTorch tier on validated inputs."""
    if tier == "triton":
        return _rope_library.run_triton(q, k, cos, sin, positions, seq_dim, interleaved, cos_half, inplace)
    c, s = _rope_torch.full_cos_sin(cos, sin, _rope_checks.positions_2d(positions), interleaved=interleaved,
                                    cos_half=cos_half)
    outs = []
    for x in (q, k):
        if x is None:
            outs.append(None)
            continue
        xv = _rope_checks.bshd(x, seq_dim)
        if inplace:
            _rope_torch.rope_inplace(xv, c, s, rotary_dim, interleaved)
        else:
            o = _rope_torch.rope_out(xv, c, s, rotary_dim, interleaved)
            outs.append(o.squeeze(0) if x.dim() == 3 else (o if seq_dim == 1 else o.transpose(1, 2)))
    return None if inplace else (outs[0], outs[1])


def _nothing_to_do(q: torch.Tensor, k: Optional[torch.Tensor], inplace: bool):
    """Result for inputs without tokens (validated already)."""
    if inplace:
        return None
    return q.clone(), (k.clone() if k is not None else None)


@_dispatch.public
def _per_token(q, k, cos, sin, interleaved, rotary_dim, sequence_dim, tier, inplace):
    _args.flag(interleaved, "interleaved")
    seq_dim = _rope_checks.sequence_dim_of(q, sequence_dim)
    B, S, D = _rope_checks.check_qk(q, k, seq_dim)
    r = _rope_checks.check_per_token(q, cos, sin, S, D, rotary_dim)
    if inplace:
        _memory.check_inplace(q, k, {"cos": cos, "sin": sin})
    grad = needs_grad(q, k, cos, sin)
    chosen = _tier_for(q, tier, cache_form=False, fits=False, grad=grad)
    if B * S == 0:
        return _nothing_to_do(q, k, inplace)
    return _run(q, k, cos, sin, None, seq_dim, interleaved, False, r, chosen, inplace)


@_dispatch.public
def _with_cache(q, k, cache, positions, interleaved, rotary_dim, sequence_dim, tier, inplace):
    _args.flag(interleaved, "interleaved")
    seq_dim = _rope_checks.sequence_dim_of(q, sequence_dim)
    B, S, D = _rope_checks.check_qk(q, k, seq_dim)
    r = _rope_checks.check_cache(q, cache, positions, B, S, D, rotary_dim)
    if inplace:
        _memory.check_inplace(q, k, {"cos_sin_cache": cache, "positions": positions})
    grad = needs_grad(q, k, cache)
    fits = cache.dtype == torch.float32 and _rope_tiers.flashinfer_takes(q, k, seq_dim, D, positions)
    chosen = _tier_for(q, tier, cache_form=True, fits=fits, grad=grad)
    if B * S == 0:
        return _nothing_to_do(q, k, inplace)
    if chosen == "flashinfer":
        return _rope_library.run_flashinfer(q, k, cache, positions, interleaved, inplace)
    half = r // 2
    return _run(q, k, cache[:, :half], cache[:, half:r], positions, seq_dim, interleaved, True, r,
                chosen, inplace)


# ---------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------


def apply_rope_qk_inplace(
    q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
    *, interleaved: bool = True, rotary_dim: Optional[int] = None, sequence_dim: Optional[int] = None,
    tier: Optional[str] = None,
) -> None:
    """Rotate q and k in place with per-token cos/sin (diffusers' form).

    Args:
        q, k: ``[T, H, D]``, ``[B, S, H, D]`` or ``[B, H, S, D]`` (see ``sequence_dim``); fp32, bf16 or
            fp16, same dtype, same B/S/D; head counts may differ. ``k=None`` rotates q only.
        cos, sin: ``[S, rotary_dim]`` floating (fp32 in diffusers), one value per element of the
            rotary span, indexed by the token's sequence index (shared across the batch). For
            ``interleaved=True`` diffusers repeats each frequency for both elements of a pair; for
            NeoX halves the row is ``[f, f]``. Values are used per element as given, so results
            match diffusers' ``apply_rotary_emb`` (``use_real=True``) for any cos/sin.
        interleaved: GPT-J pairs (FLUX, ``use_real_unbind_dim=-1``) if True, NeoX halves if False.
        rotary_dim: optional check; the rotary width is ``cos.shape[1]`` (<= head dim, even).
        sequence_dim: where S is: 0 for 3-D (default), 1 (default for 4-D) or 2 for 4-D.
        tier: ``"triton"``, ``"torch"`` or None (automatic); ``"flashinfer"`` needs the cache form.

    Raises:
        ValueError: on any invalid input, before q or k is modified.
    """
    _per_token(q, k, cos, sin, interleaved, rotary_dim, sequence_dim, tier, inplace=True)


def apply_rope_qk(
    q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
    *, interleaved: bool = True, rotary_dim: Optional[int] = None, sequence_dim: Optional[int] = None,
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Out-of-place :func:`apply_rope_qk_inplace`: returns new ``(q_out, k_out)``; q, k untouched.

    ``k_out`` is None when ``k`` is None. Outputs have q's shape and dtype (the Triton tier keeps a
    dense input's strides; the PyTorch tier lets PyTorch pick them).
    """
    return _per_token(q, k, cos, sin, interleaved, rotary_dim, sequence_dim, tier, inplace=False)


def apply_rope_qk_with_cache_inplace(
    q: torch.Tensor, k: Optional[torch.Tensor], cos_sin_cache: torch.Tensor, positions: torch.Tensor,
    *, interleaved: bool, rotary_dim: Optional[int] = None, sequence_dim: Optional[int] = None,
    tier: Optional[str] = None,
) -> None:
    """Rotate q and k in place with a ``cos_sin_cache`` indexed by ``positions`` (vLLM/FlashInfer).

    Args:
        q, k: as in :func:`apply_rope_qk_inplace`.
        cos_sin_cache: ``[max_position, rotary_dim]`` floating (fp32 for FlashInfer); the first
            ``rotary_dim // 2`` columns are cos, the rest sin, one value per pair.
        positions: int32/int64 row of the cache for each token: ``[T]`` for 3-D q, ``[S]`` (shared
            across the batch) or ``[B, S]`` for 4-D q. Out-of-range rows are only detected for
            CPU tensors outside torch.compile; elsewhere they are the caller's responsibility.
        interleaved: required. GPT-J pairs if True (FlashInfer ``is_neox=False``), NeoX halves if
            False (``is_neox=True``).
        rotary_dim: optional check against ``cos_sin_cache.shape[1]``.
        sequence_dim, tier: as in :func:`apply_rope_qk_inplace`.

    Raises:
        ValueError: on any invalid input, before q or k is modified.
    """
    _with_cache(q, k, cos_sin_cache, positions, interleaved, rotary_dim, sequence_dim, tier,
                inplace=True)


def apply_rope_qk_with_cache(
    q: torch.Tensor, k: Optional[torch.Tensor], cos_sin_cache: torch.Tensor, positions: torch.Tensor,
    *, interleaved: bool, rotary_dim: Optional[int] = None, sequence_dim: Optional[int] = None,
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Out-of-place :func:`apply_rope_qk_with_cache_inplace`: returns new ``(q_out, k_out)``."""
    return _with_cache(q, k, cos_sin_cache, positions, interleaved, rotary_dim, sequence_dim, tier,
                       inplace=False)
