"""The RoPE tiers as ``torch.library`` ops (with fake kernels), so torch.compile and export trace them.

The Triton tier is a ``torch.library.triton_op`` on CUDA (Inductor sees and schedules the kernel,
CUDA graphs capture it), registered on first need; on CPU (Triton's interpreter) and on torch without
``triton_op`` it is an opaque custom op. FlashInfer's functions are wrapped in custom ops of ours
(not all FlashInfer versions register theirs). Outside any tracing the plain functions are called
directly: the dispatcher costs tens of microseconds of host time per call.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any, Optional

import torch

from .._core.lazy import lazy_module
from ._runtime.dispatch import plain_eager
from ._rope_checks import bshd, positions_2d


# ---- Triton ------------------------------------------------------------------------------------


def triton_body(kernel: Any, q: torch.Tensor, k: Optional[torch.Tensor], q_out: torch.Tensor,
                k_out: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                positions: Optional[torch.Tensor], sequence_dim: int, interleaved: bool,
                cos_half: bool) -> None:
    """Launch ``kernel`` on [B, S, H, D] views of the caller's layout (``q_out is q``: in place)."""
    qv = bshd(q, sequence_dim)
    if qv.shape[0] * qv.shape[1] == 0:
        return
    rotary_dim = cos.shape[1] * (2 if cos_half else 1)
    kv = bshd(k, sequence_dim) if k is not None else None
    # Same view object for input and output means in place (the launcher checks identity).
    qov = qv if q_out is q else bshd(q_out, sequence_dim)
    kov = None if k_out is None else (kv if k_out is k else bshd(k_out, sequence_dim))
    _triton_module().launch(
        kernel, qv, kv, qov, kov, cos, sin, positions_2d(positions),
        interleaved=interleaved, cos_half=cos_half, rotary_dim=rotary_dim,
    )


#: torchpatches.ops._rope_triton, imported on first use (it imports triton).
_triton_module = lazy_module("torchpatches.ops._rope_triton")


def _kernel(device_type: str, wrap: bool) -> Any:
    kernel = _triton_module().kernel_for(device_type)
    if wrap:
        from torch.library import wrap_triton

        return wrap_triton(kernel)
    return kernel


def _triton_inplace_impl(wrap: bool):
    def impl(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             positions: Optional[torch.Tensor], sequence_dim: int, interleaved: bool,
             cos_half: bool) -> None:
        triton_body(_kernel(q.device.type, wrap), q, k, q, k, cos, sin, positions,
                    sequence_dim, interleaved, cos_half)
    return impl


def _triton_out_impl(wrap: bool):
    def impl(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             positions: Optional[torch.Tensor], sequence_dim: int, interleaved: bool,
             cos_half: bool) -> list[torch.Tensor]:
        q_out = torch.empty_like(q)
        k_out = torch.empty_like(k) if k is not None else None
        triton_body(_kernel(q.device.type, wrap), q, k, q_out, k_out, cos, sin, positions,
                    sequence_dim, interleaved, cos_half)
        return [q_out] if k_out is None else [q_out, k_out]
    return impl


# Plain-function versions, used outside torch.compile (no dispatcher overhead).
_eager_triton_inplace = _triton_inplace_impl(False)
_eager_triton_out = _triton_out_impl(False)

_HAS_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")

# Opaque versions: always registered (CPU interpreter, older torch).
_rope_qk_triton_opaque_ = torch.library.custom_op(
    "torchpatches::rope_qk_triton_opaque_", mutates_args=("q", "k"))(_triton_inplace_impl(False))
_rope_qk_triton_opaque = torch.library.custom_op(
    "torchpatches::rope_qk_triton_opaque", mutates_args=())(_triton_out_impl(False))


@_rope_qk_triton_opaque_.register_fake
def _(q, k, cos, sin, positions, sequence_dim, interleaved, cos_half) -> None:
    return None


@_rope_qk_triton_opaque.register_fake
def _(q, k, cos, sin, positions, sequence_dim, interleaved, cos_half) -> list[torch.Tensor]:
    return [torch.empty_like(q)] + ([torch.empty_like(k)] if k is not None else [])


_TRITON_OPS: Optional[tuple[Any, Any]] = None


def ensure_triton_ops() -> tuple[Any, Any]:
    """(in-place op, out-of-place op) for the Triton tier on CUDA, registered on first need.

    ``torch.library.triton_op`` imports triton and torch._inductor when it registers (it scans
    the function for kernels), so registering at import time would make ``import`` slow. This runs
    from ``select_tier``, i.e. outside Dynamo's tracing, before any traced code uses the ops.
    The op body runs under FakeTensor mode to build the graph; ``wrap_triton`` records the launch
    so Inductor schedules (and CUDA graphs capture) the kernel itself.
    """
    global _TRITON_OPS
    if _TRITON_OPS is None:
        if _HAS_TRITON_OP:
            _TRITON_OPS = (
                torch.library.triton_op("torchpatches::rope_qk_triton_", mutates_args=("q", "k"))(
                    _triton_inplace_impl(True)),
                torch.library.triton_op("torchpatches::rope_qk_triton", mutates_args=())(
                    _triton_out_impl(True)),
            )
        else:  # pragma: no cover - torch < 2.6: opaque to Inductor, still compiles
            _TRITON_OPS = (_rope_qk_triton_opaque_, _rope_qk_triton_opaque)
    return _TRITON_OPS


# ---- FlashInfer --------------------------------------------------------------------------------


@functools.cache
def flashinfer_rope() -> tuple[Any, str]:
    """(flashinfer.rope module or None, reason). Imports flashinfer only when first asked."""
    if importlib.util.find_spec("flashinfer") is None:
        return None, "flashinfer is not installed"
    try:
        mod = importlib.import_module("flashinfer.rope")
    except Exception as e:  # a broken install must not break RoPE: fall back and say why
        return None, f"import flashinfer.rope failed: {type(e).__name__}: {e}"
    for name in ("apply_rope_with_cos_sin_cache_inplace", "apply_rope_with_cos_sin_cache"):
        if not hasattr(mod, name):
            return None, f"flashinfer.rope has no {name} (version too old?)"
    return mod, "available"


def _flashinfer_inplace(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                        positions: torch.Tensor, interleaved: bool) -> None:
    fi, why = flashinfer_rope()
    if fi is None:
        raise RuntimeError(f"FlashInfer tier called but {why}")
    fi.apply_rope_with_cos_sin_cache_inplace(
        positions=positions.reshape(-1), query=flat_tokens(q), key=flat_tokens(k),
        head_size=q.shape[-1], cos_sin_cache=cos_sin_cache, is_neox=not interleaved)


def _flashinfer_out(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                    positions: torch.Tensor, interleaved: bool) -> list[torch.Tensor]:
    fi, why = flashinfer_rope()
    if fi is None:
        raise RuntimeError(f"FlashInfer tier called but {why}")
    q_out, k_out = fi.apply_rope_with_cos_sin_cache(
        positions=positions.reshape(-1), query=flat_tokens(q), key=flat_tokens(k),
        head_size=q.shape[-1], cos_sin_cache=cos_sin_cache, is_neox=not interleaved)
    # FlashInfer returns fresh (nnz, H*D) tensors; a custom op may not return views of its inputs.
    return [q_out.view(q.shape), k_out.view(k.shape)]


# FlashInfer's own functions are not all registered ops in every version: wrap them in ours.
_rope_qk_flashinfer_ = torch.library.custom_op(
    "torchpatches::rope_qk_flashinfer_", mutates_args=("q", "k"))(_flashinfer_inplace)
_rope_qk_flashinfer = torch.library.custom_op(
    "torchpatches::rope_qk_flashinfer", mutates_args=())(_flashinfer_out)


@_rope_qk_flashinfer_.register_fake
def _(q, k, cos_sin_cache, positions, interleaved) -> None:
    return None


@_rope_qk_flashinfer.register_fake
def _(q, k, cos_sin_cache, positions, interleaved) -> list[torch.Tensor]:
    return [torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device)]


def flat_tokens(x: torch.Tensor) -> torch.Tensor:
    """(nnz, H*D) view of a token-major [T, H, D] or [B, S, H, D] tensor (checked by _rope_tiers.tokens_flat)."""
    hd = x.shape[-2] * x.shape[-1]
    return x.as_strided((x.numel() // hd, hd), (x.stride(-3), 1))


# ---- running a tier: the plain function outside tracing, the op inside ---------------------------


def run_triton(q, k, cos, sin, positions, seq_dim, interleaved, cos_half, inplace):
    """The Triton tier on validated inputs; returns (q_out, k_out), or None in place."""
    # Kernel loads assume a unit-stride head dim; anything else goes through a documented copy.
    qs = q if q.stride(-1) == 1 else q.contiguous()
    ks = k if (k is None or k.stride(-1) == 1) else k.contiguous()
    on_cuda = q.device.type == "cuda"
    args = (cos, sin, positions, seq_dim, interleaved, cos_half)
    if plain_eager(q):
        # Eager: launch directly. The torch.library ops exist for tracing; their dispatch costs
        # tens of microseconds of host time per call, more than the kernel itself on small inputs.
        op = _eager_triton_inplace if inplace else _eager_triton_out
    elif on_cuda:
        ops = _TRITON_OPS if _TRITON_OPS is not None else ensure_triton_ops()
        op = ops[0] if inplace else ops[1]
    else:
        op = _rope_qk_triton_opaque_ if inplace else _rope_qk_triton_opaque
    if inplace:
        op(qs, ks, *args)
        if qs is not q:
            q.copy_(qs)
        if ks is not k:
            k.copy_(ks)
        return None
    outs = op(qs, ks, *args)
    return outs[0], (outs[1] if k is not None else None)


def run_flashinfer(q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                   interleaved: bool, inplace: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The FlashInfer tier on validated inputs: the plain function outside tracing, else our custom op."""
    eager = plain_eager(q)  # skip the dispatcher outside tracing
    if inplace:
        (_flashinfer_inplace if eager else _rope_qk_flashinfer_)(q, k, cache, positions, interleaved)
        return None
    q_out, k_out = (_flashinfer_out if eager else _rope_qk_flashinfer)(q, k, cache, positions, interleaved)
    return q_out, k_out
