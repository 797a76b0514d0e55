"""Which RoPE tier runs a call: what is available (found once, cached) and the choice itself.

The choice is a function of Python constants only (device type, requested tier, call form), marked
constant for Dynamo, so under torch.compile it runs once at trace time and its answer is folded into
the graph; the fallback warnings are emitted from there for the same reason.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Optional, Tuple

import torch

from .._core.compat import assume_constant, emit_log_once, emit_warning_once, reset_once
from ._runtime import tiers as _tiers
from ._rope_library import ensure_triton_ops, flashinfer_rope

log = logging.getLogger("torchpatches")

TIERS = ("flashinfer", "triton", "torch")
FLASHINFER_HEAD_DIMS = (64, 128, 256)

#: What tier selection answers: ``(tier, None)``, or ``(None, why the requested tier cannot run the
#: call)``. Plain constants, because under torch.compile Dynamo folds the answer into the graph.
TierChoice = Tuple[Optional[str], Optional[str]]

_LAST_TIER: Optional[str] = None


def _warn_fallback(message: str) -> None:
    """Log and warn (RuntimeWarning) once per message. Runs in Python: eager, or while Dynamo traces
    the constant-folded tier choice, so a message costs no graph break."""
    emit_log_once(log, logging.WARNING, message)
    emit_warning_once(message, RuntimeWarning, stacklevel=3)


@functools.cache
def triton_import() -> tuple[bool, str]:
    ok, why = _tiers.triton_usable()
    if not ok:
        return False, why
    try:
        importlib.import_module("torchpatches.ops._rope_triton")
    except Exception as e:
        return False, f"importing the Triton kernel failed: {type(e).__name__}: {e}"
    return True, "available"


def triton_status(device_type: str) -> tuple[bool, str]:
    ok, why = triton_import()
    if not ok:
        return ok, why
    if device_type == "cuda":
        return True, "available (compiled)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "available (TRITON_INTERPRET=1: Triton's CPU interpreter, slow; for tests)"
    return False, f"no Triton backend for {device_type} (set TRITON_INTERPRET=1 to interpret on CPU)"


def describe_tiers(device_type: str = "cuda") -> dict[str, tuple[bool, str]]:
    """For each tier, (available for tensors on ``device_type``, why or why not)."""
    fi, why = flashinfer_rope()
    if fi is not None and device_type != "cuda":
        fi, why = None, "flashinfer runs on CUDA only"
    return {
        "flashinfer": (fi is not None, why if fi is None else why + " (cache form, token-major only)"),
        "triton": triton_status(device_type),
        "torch": (True, "always available"),
    }


def last_tier() -> Optional[str]:
    """The tier chosen by the most recent call (under torch.compile: when it was traced)."""
    return _LAST_TIER


def reset_caches() -> None:
    """For tests that inject or remove a stand-in flashinfer module."""
    global _LAST_TIER
    flashinfer_rope.cache_clear()
    triton_import.cache_clear()
    _tiers.reset()
    reset_once()
    _LAST_TIER = None


@assume_constant
def select_tier(device_type: str, requested: str, cache_form: bool, flashinfer_fits: bool,
                needs_grad: bool = False) -> TierChoice:
    """The tier for a call, or why a requested tier cannot run it (see :data:`TierChoice`).

    Only Python constants go in and out, so under torch.compile this runs once at trace time and
    its answer is baked into the graph (no graph break); the warning is emitted from here for the
    same reason.
    """
    global _LAST_TIER
    tier, refusal = choose(device_type, requested, cache_form, flashinfer_fits, needs_grad)
    if tier == "triton" and device_type == "cuda":
        ensure_triton_ops()  # registers the triton_ops outside tracing
    if tier is not None:
        _LAST_TIER = tier
    return tier, refusal


def choose(device_type: str, requested: str, cache_form: bool, flashinfer_fits: bool,
           needs_grad: bool = False) -> TierChoice:
    if requested == "torch":
        return "torch", None
    if needs_grad:
        if requested == "auto":
            return "torch", None  # the only differentiable tier
        return None, _tiers.grad_refusal(requested, "q, k or a cos/sin table")
    if requested == "triton":
        ok, why = triton_import()  # forcing Triton on CPU runs the interpreter
        return ("triton", None) if ok else (None, f"tier='triton' requested but {why}")
    if requested == "flashinfer":
        fi, why = flashinfer_rope()
        if fi is None:
            return None, f"tier='flashinfer' requested but {why}"
        if not (cache_form and flashinfer_fits):
            return None, ("tier='flashinfer' requested but FlashInfer only takes the cos_sin_cache form "
                          "with token-major fp16/bf16 q and k (both given), last two dims dense, "
                          f"head dim in {FLASHINFER_HEAD_DIMS}")
        return "flashinfer", None
    # automatic
    if device_type == "cuda" and cache_form and flashinfer_fits:
        fi, why = flashinfer_rope()
        if fi is not None:
            return "flashinfer", None
        _warn_fallback(f"torchpatches RoPE: FlashInfer tier unavailable ({why}); falling back to the Triton tier")
    ok, why = triton_status(device_type)
    if ok:
        return "triton", None
    if device_type == "cuda":
        _warn_fallback(f"torchpatches RoPE: Triton tier unavailable ({why}); falling back to plain PyTorch")
    else:
        log.debug("torchpatches RoPE on %s uses plain PyTorch: %s", device_type, why)
    return "torch", None


def flashinfer_takes(q: torch.Tensor, k: Optional[torch.Tensor], seq_dim: int, D: int,
                     positions: torch.Tensor) -> bool:
    """FlashInfer takes (nnz, H*D) views of q and k with one stride between tokens."""
    if k is None or q.dtype not in (torch.float16, torch.bfloat16) or D not in FLASHINFER_HEAD_DIMS:
        return False
    if q.dim() == 4 and seq_dim != 1:
        return False
    if q.dim() == 4 and positions.dim() == 1 and q.shape[0] != 1:
        return False  # [S] positions shared across a batch would need a gathered copy
    return all(tokens_flat(x) for x in (q, k))


def tokens_flat(x: torch.Tensor) -> bool:
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return False
    if x.dim() == 4 and x.shape[0] > 1 and x.stride(0) != x.shape[1] * x.stride(1):
        return False
    return True
