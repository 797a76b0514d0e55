"""Tier choice shared by the fused DiT ops (``modulate``, ``qk_norm_rope``, ``swiglu``, ``linear_gelu``).

Two tiers, chosen per call from facts that do not change while a program runs:

- ``triton``: the op's Triton kernel; compiled on CUDA, and on CPU run by Triton's interpreter
  when a caller forces it (tests: the interpreter is slow);
- ``torch``: plain PyTorch ops in the order diffusers runs them (the reference for the kernels).

``force_tier("torch" | "triton" | None)`` sets the tier for every fused op inside a block; the
patches in ``torchpatches/patches`` also take a forced tier as permission to run their fused path on
CPU (tests of the patch logic without a GPU). Nothing here imports triton: kernels import it when a
Triton tier is first used.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Iterator, Optional

__all__ = ["TIERS", "force_tier", "forced_tier", "choose_tier", "triton_importable"]

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


def choose_tier(device_type: str, tier: Optional[str]) -> str:
    """``"triton"`` or ``"torch"`` for a call on ``device_type``; ValueError for an impossible request."""
    requested = tier if tier is not None else _FORCED
    if requested is None:
        return "triton" if device_type == "cuda" and triton_importable() else "torch"
    if requested == "torch":
        return "torch"
    if requested == "triton":
        if not triton_importable():
            raise ValueError("tier='triton' requested but triton is not installed")
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"tier='triton' runs on CUDA (or the CPU interpreter), not {device_type}")
        return "triton"
    raise ValueError(f"unknown fused-op tier {requested!r}; expected one of {TIERS} or None")
