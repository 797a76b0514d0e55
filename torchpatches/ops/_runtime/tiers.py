"""What every op in ``torchpatches.ops`` shares about tiers: the forced-tier switch, the Triton probe,
"does autograd record this call", and the refusal text.

Tiers: ``flashinfer`` (RoPE's cache form only), ``triton`` (compiled on CUDA; on CPU Triton's interpreter
when a caller forces it) and ``torch`` (plain PyTorch ops in diffusers' order: the reference, and the
only differentiable tier).

``force_tier("torch" | "triton" | "flashinfer" | None)`` sets the tier of every op inside a block. It is a
``ContextVar``: each thread and each asyncio task sees its own setting. An op without the forced tier
takes its nearest (the fused ops have no FlashInfer tier: a forced ``flashinfer`` means ``triton`` there).
The fusion patches in ``torchpatches/patches`` take a forced tier as permission to run their fused path
on CPU (tests of the patch logic without a GPU).

Nothing here imports triton: the probe reads ``sys.modules`` / the import system only, so a stub
``triton`` (a bare ``ModuleType``, a ``MagicMock``) reads as unavailable instead of raising.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import sys
import types
from typing import Any, Iterator, Optional, Tuple

import torch
from torch.autograd import forward_ad as _forward_ad

from ..._core.compat import assume_constant, is_compiling

__all__ = ["TIERS", "FLOAT_DTYPES", "force_tier", "forced_tier", "triton_usable", "needs_grad", "transforms_active",
           "grad_refusal", "choose_tier", "jit_tracing", "eager_transforms"]

TIERS = ("flashinfer", "triton", "torch")
#: The dtypes every tier of every op serves.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Position ids (``ops.rope_tables``): diffusers' FLUX embedders take ``ids.float()`` of any of these (FLUX.2's
#: pipeline passes int64, FLUX.1's the latents' float dtype).
POSITION_DTYPES = FLOAT_DTYPES + (torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

_FORCED: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("torchpatches_forced_tier", default=None)


@contextlib.contextmanager
def force_tier(tier: Optional[str]) -> Iterator[None]:
    """Use ``tier`` for every op call inside the block, in this thread/task (None: automatic)."""
    if tier is not None and tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS} or None")
    token = _FORCED.set(tier)
    try:
        yield
    finally:
        _FORCED.reset(token)


@assume_constant
def forced_tier() -> Optional[str]:
    """The tier :func:`force_tier` set for this thread/task, or None. Dynamo cannot trace a ContextVar:
    under torch.compile the value at trace time is folded into the graph (set it before compiling)."""
    return _FORCED.get()


def jit_tracing() -> bool:
    """``torch.jit.trace`` is recording (a kernel launch would see traced sizes; shape checks would warn)."""
    return not is_compiling() and _tracing_state() is not None


# ---- is triton there (without importing it) -------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _spec_found() -> Tuple[bool, str]:
    try:
        found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError) as e:  # a broken install, or a module without __spec__
        return False, f"triton cannot be found ({type(e).__name__}: {e})"
    return (True, "available") if found else (False, "triton is not installed")


def triton_usable() -> Tuple[bool, str]:
    """(usable, why) for the triton package. An imported ``triton`` counts only if it is a real module
    with ``triton.jit`` (stubs and mocks placed in ``sys.modules`` by tests or other libraries do not)."""
    mod = sys.modules.get("triton")
    if mod is None:
        return _spec_found()
    if type(mod) is not types.ModuleType or not callable(vars(mod).get("jit")):
        return False, f"sys.modules['triton'] is a {type(mod).__name__} stand-in, not the triton package"
    return True, "available"


def reset() -> None:
    """Forget the cached probe (tests that install or remove a triton stand-in)."""
    _spec_found.cache_clear()


# ---- does autograd record this call ---------------------------------------------------------------


_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack
_tracing_state = torch._C._get_tracing_state


def transforms_active() -> bool:
    """A forward-AD dual level or a functorch transform (vmap, grad, jvp, functionalize) is active.

    Inputs are then dual or wrapped tensors whose ``requires_grad`` says nothing; kernels writing raw
    memory would drop tangents or fail on storage-less wrappers. Two reads; under Dynamo only
    ``requires_grad`` counts (Dynamo handles these transforms itself and must not trace the probes).
    """
    return not is_compiling() and eager_transforms()


def eager_transforms() -> bool:
    """:func:`transforms_active` or ``torch.jit.trace`` recording, for callers that know they are not
    being compiled (three C reads, ~0.1 us)."""
    return _forward_ad._current_level >= 0 or _peek_interpreter_stack() is not None or _tracing_state() is not None


def needs_grad(*tensors: Any) -> bool:
    """Whether autograd records a call on these tensors in any form: grad mode on and one requires grad,
    or forward-mode AD / a functorch transform active (:func:`transforms_active`)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return True
    return transforms_active()


def grad_refusal(tier: str, what: str = "an input") -> str:
    """Why a kernel tier refuses a call autograd records."""
    return (f"tier={tier!r} requested but {what} requires grad (grad mode on), or forward-mode AD or a "
            "functorch transform is active: the kernels are not differentiable; use tier='torch' or the "
            "automatic tier (which picks the PyTorch tier for such calls), or call under torch.no_grad()")


# ---- the fused ops' choice (RoPE adds FlashInfer in _rope_tiers) ----------------------------------


def _automatic(device_type: str) -> str:
    return "triton" if device_type == "cuda" and triton_usable()[0] else "torch"


def choose_tier(device_type: str, tier: Optional[str], grad: bool = False) -> str:
    """``"triton"`` or ``"torch"`` for a fused-op call on ``device_type``; ValueError for an impossible request.

    ``grad``: autograd records the call (:func:`needs_grad`); only the PyTorch tier is differentiable.
    ``torch.jit.trace`` gets the PyTorch tier (a kernel launch would see traced sizes).
    """
    requested = tier if tier is not None else forced_tier()
    if requested == "flashinfer" and tier is None:
        requested = "triton"  # a block forcing RoPE's FlashInfer: the fused ops' kernel tier
    if requested is None:
        return "torch" if grad or jit_tracing() else _automatic(device_type)
    if requested == "torch":
        return "torch"
    if requested != "triton":
        raise ValueError(f"unknown fused-op tier {requested!r}; expected 'triton', 'torch' or None")
    if grad:
        raise ValueError(grad_refusal("triton"))
    ok, why = triton_usable()
    if not ok:
        raise ValueError(f"tier='triton' requested but {why}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"tier='triton' runs on CUDA (or the CPU interpreter), not {device_type}")
    return "triton"
