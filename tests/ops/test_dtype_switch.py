"""The kernel tiers give one answer per call, whatever ran before: a call of one shape in bf16, fp16 and fp32 in
turn, and the same calls from several threads at once, each bit for bit the op's own answer to that call made
first and alone. A cached launcher that kept a kernel compiled for another dtype, alignment or constexpr would
fail here, where the math cannot (the same arguments, the same kernel).

Also the distance of each dtype's answer from the PyTorch tier's, at each element's own magnitude (``ulps``): the
math of the kernel against diffusers' op order. With ``TORCHPATCHES_ULPS=1`` it is printed (``pytest -s``) for the
table in docs/fused.md; the bound asserted is the one test_layouts states.

The ops and arguments are test_layouts' table. On a GPU (``TORCHPATCHES_TEST_DEVICE=cuda``) this is the compiled
kernels and the cached launch path; on the CPU the interpreter (no launcher cache: the sequence still runs).
"""
from __future__ import annotations

import os
import threading
from typing import Dict, List

import pytest
import torch

from _fused_checks import needs_triton, ulps
from test_layouts import DEVICE, KERNEL_TIERS, OPS, _tolerance

SEQUENCE = [torch.bfloat16, torch.float16, torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float16]


#: dtypes an op's kernel tier refuses by contract (cuBLASLt's GELU epilogue: fp16/bf16 only).
REFUSED = {"linear_gelu": (torch.float32,)}


def _kernel(op: str, dtype: torch.dtype) -> tuple:
    make, call = OPS[op][:2]
    return tuple(t.clone() for t in call(make(dtype), KERNEL_TIERS.get(op, "triton")))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        torch.nan_to_num(x, nan=0.0), torch.nan_to_num(y, nan=0.0)) and torch.isnan(x).equal(torch.isnan(y))
        for x, y in zip(a, b))


@needs_triton
@pytest.mark.once
@pytest.mark.parametrize("op", list(OPS))
def test_dtype_changes_between_calls(op: str) -> None:
    first: Dict[torch.dtype, tuple] = {}
    for dtype in SEQUENCE:
        if dtype in REFUSED.get(op, ()):
            continue
        got = _kernel(op, dtype)
        if dtype in first:
            assert _same(got, first[dtype]), f"{op}: {dtype} after other dtypes differs from its first call"
        else:
            first[dtype] = got
    make, call = OPS[op][:2]
    for dtype, got in first.items():
        want = call(make(dtype), "torch")
        worst = max(ulps(g, w) for g, w in zip(got, want))
        if os.environ.get("TORCHPATCHES_ULPS"):
            print(f"ULPS {op} | {str(dtype).replace('torch.', '')} | {worst:g}")
        scale_bound = max(ulps(g, w, w.abs().amax(-1, keepdim=True)) for g, w in zip(got, want))
        assert scale_bound <= _tolerance(dtype), f"{op} {dtype}: {scale_bound} ulp from the PyTorch tier"


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton's interpreter is not thread-safe; compiled kernels are")
@pytest.mark.parametrize("op", ["qk_norm_rope joint", "rms_norm_rope", "gate_residual_layer_norm_modulate", "swiglu",
                                "lora_linear"])
def test_threads(op: str) -> None:
    """Four threads, each calling in its own dtype order: every answer is the single-threaded one."""
    alone = {dtype: _kernel(op, dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    errors: List[str] = []

    def worker(shift: int) -> None:
        order = list(alone)[shift:] + list(alone)[:shift]
        for dtype in order * 3:
            if not _same(_kernel(op, dtype), alone[dtype]):
                errors.append(f"{op}: {dtype} in thread {shift}")

    threads = [threading.Thread(target=worker, args=(i % 3,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    assert not errors, errors
