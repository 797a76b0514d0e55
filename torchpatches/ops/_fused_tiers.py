"""Tier choice shared by the fused DiT ops (``modulate``, ``qk_norm_rope``, ``swiglu``, ``linear_gelu``).

Two tiers, chosen per call from facts that do not change while a program runs:

- ``triton``: the op's Triton kernel; compiled on CUDA, and on CPU run by Triton's interpreter
  when a caller forces it (tests: the interpreter is slow);
- ``torch``: plain PyTorch ops in the order diffusers runs them (the reference for the kernels).

``force_tier("torch" | "triton" | None)`` sets the tier for every fused op inside a block; the
patches in ``torchpatches/patches`` also take a forced tier as permission to run their fused path on
CPU (tests of the patch logic without a GPU). Nothing here imports triton: kernels import it when a
Triton tier is first used.

Gradients: the Triton kernels write outputs autograd cannot see (the results would be detached, or an
``out=`` written behind autograd's back), so a call autograd records (grad mode on and an input or
``out`` requiring grad) takes the differentiable PyTorch tier when the tier is automatic, and a requested
Triton tier (argument or ``force_tier``) raises ``ValueError``, as the RoPE op does.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any, Iterator, Optional

import torch

__all__ = ["TIERS", "force_tier", "forced_tier", "choose_tier", "needs_grad", "triton_importable"]

TIERS = ("triton", "torch")

_FORCED: Optional[str] = None


@contextlib.contextmanager
def force_tier(tier: Optional[str]) -> Iterator[None]:
    """Use ``tier`` for every fused op inside the block (None: automatic)."""
    global _FORCED
    if tier is not None and tier not in TIERS:
        raise ValueError(f"unknown fused-op tier {tier!r}; expected one of {TIERS} or None")
    old, _FORCED = _FORCED, tier
    try:
        yield
    finally:
        _FORCED = old


def forced_tier() -> Optional[str]:
    """The tier ``force_tier`` set, or None."""
    return _FORCED


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def needs_grad(*tensors: Any) -> bool:
    """Whether autograd records a call on these tensors: grad mode on and any of them requires grad.
    (Static under Dynamo: it guards on both.)"""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


GRAD_REFUSAL = ("tier='triton' requested but an input requires grad (and grad mode is on): the Triton kernels "
                "are not differentiable; use tier='torch' or the automatic tier (which picks the PyTorch tier "
                "for such calls), or call under torch.no_grad()")


def _automatic(device_type: str) -> str:
    return "triton" if device_type == "cuda" and triton_importable() else "torch"


def choose_tier(device_type: str, tier: Optional[str], grad: bool = False) -> str:
    """``"triton"`` or ``"torch"`` for a call on ``device_type``; ValueError for an impossible request.

    ``grad``: autograd records the call (``needs_grad``); only the PyTorch tier is differentiable.
    """
    requested = tier if tier is not None else _FORCED
    if requested is None:
        return "torch" if grad else _automatic(device_type)
    if requested == "torch":
        return "torch"
    if requested == "triton" and grad:
        raise ValueError(GRAD_REFUSAL)
    if requested == "triton":
        if not triton_importable():
            raise ValueError("tier='triton' requested but triton is not installed")
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"tier='triton' runs on CUDA (or the CPU interpreter), not {device_type}")
        return "triton"
    raise ValueError(f"unknown fused-op tier {requested!r}; expected one of {TIERS} or None")
