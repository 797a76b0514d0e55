"""Comparison helpers and the hypothesis set-up of the fused-op tests (not a test module).

Differences are measured in ulps of the output dtype at a *scale*: the magnitude of the last rounded
intermediate (e.g. ``|n * (1 + scale)|`` before ``+ shift``, or ``|(a, b)|`` of a rotated pair). A
one-ulp difference in that intermediate that cancels to a tiny output then reads as one ulp.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import pytest
import torch
from hypothesis import HealthCheck

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def hyp(max_examples: int) -> Dict[str, Any]:
    """hypothesis ``settings`` of the op tests: reproducible, no deadline (the interpreter is slow)."""
    return dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), max_examples=max_examples)


def interleaved_tables(angles: torch.Tensor) -> tuple:
    """``(cos, sin)`` of ``[..., D/2]`` angles, each value repeated for the two elements of its pair (FLUX's
    ``use_real`` tables, the ops' cos/sin layout)."""
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
#: Unit roundoff per dtype (half an ulp at 1.0).
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def ulps(out: torch.Tensor, ref: torch.Tensor, scale: Optional[torch.Tensor] = None) -> float:
    """Largest |out - ref| in ulps of out's dtype at max(|out|, |ref|, |scale|); 0 for empty tensors."""
    if out.numel() == 0:
        return 0.0
    a, b = out.double(), ref.double()
    mag = torch.maximum(a.abs(), b.abs())
    if scale is not None:
        mag = torch.maximum(mag, scale.double().abs())
    mag = mag.clamp_min(torch.finfo(out.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA[out.dtype])
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    return float((diff / ulp).max())


def assert_rotated_close(got: Any, ref: Any, exact: Any, dtype: torch.dtype) -> None:
    """A kernel tier's normed and rotated tensors against the PyTorch tier's (ulps at each rotated pair's
    magnitude: 8 in fp32, where the statistics' summation order differs, else 1) and against float64 math (within
    4 unit roundoffs: two roundings, after the norm and after the rotation)."""
    limit = 8.0 if dtype == torch.float32 else 1.0
    for g, r, e in zip(got, ref, exact):
        assert g.shape == r.shape and g.is_contiguous() and g.dtype == dtype
        assert ulps(g, r, pair_norm(r)) <= limit
        err = ((g.double() - e).abs() / (pair_norm(e) + 1e-30)).max()
        assert float(err) <= 4 * UNIT[dtype] + 1e-5


def pair_norm(t: torch.Tensor) -> torch.Tensor:
    """|(a, b)| of each interleaved pair, for both elements (a rotation keeps it)."""
    p = t.double().reshape(*t.shape[:-1], -1, 2)
    return p.norm(dim=-1, keepdim=True).expand_as(p).reshape(t.shape)


def strided(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as ``t`` in a view whose rows are padded (last dim stays unit-stride)."""
    big = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan"), dtype=t.dtype)
    big[..., : t.shape[-1]] = t
    return big[..., : t.shape[-1]]
