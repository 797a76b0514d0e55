"""torchpatches.ops.swiglu (FLUX.2's one-input form and the two-input ``silu(x) * up``), ops.slices (GELU / copy
into a concat slice) and ops.linear_gelu.

SwiGLU and GELU round where diffusers rounds, so the Triton tier (interpreter on the CPU, tiny shapes)
matches diffusers' modules to one ulp in bf16/fp16 and a few in fp32 (the interpreter's exp/tanh are numpy's,
not torch's); the PyTorch tier is diffusers' expression, bit for bit. Writes into slices leave the rest of the
buffer untouched. ``linear_gelu_tanh`` must never use ``torch._addmm_activation`` on the
CPU, where it computes the erf GELU: on CPU tensors it is diffusers' two ops, bit for bit. Its cuBLASLt
tier (one rounding instead of two) is checked on the GPU by ``benchmarks/fused_ops.py``.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, HAS_TRITON, hyp, needs_triton, strided, ulps
from torchpatches.ops import _linear_gelu as linear_gelu, _slices as slices, _swiglu as swiglu
from torchpatches.ops import force_tier
from torchpatches.ops._runtime import tiers as _tiers

HYP = hyp(20)


@st.composite
def matrices(draw: Any):
    rows = draw(st.integers(1, 5))
    width = draw(st.sampled_from([2, 6, 32, 70]))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = (torch.randn(2, rows, width, generator=g) * draw(st.sampled_from([1.0, 5.0]))).to(dtype)
    return strided(x) if draw(st.booleans()) else x


@needs_triton
@settings(**HYP)
@given(matrices())
def test_swiglu_triton_matches_flux2_module(x: torch.Tensor) -> None:
    import torchpatches
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    with torchpatches.disabled("swiglu"):
        ref = Flux2SwiGLU()(x)
    assert torch.equal(swiglu.swiglu(x, tier="torch"), ref)
    got = swiglu.swiglu(x, tier="triton")
    limit = 4.0 if x.dtype == torch.float32 else 1.0
    assert ulps(got, ref) <= limit
    # into a slice of a NaN-filled buffer: exactly the slice is written
    buf = torch.full((*x.shape[:-1], x.shape[-1] // 2 + 3), float("nan"), dtype=x.dtype)
    swiglu.swiglu(x, out=buf[..., 3:], tier="triton")
    assert torch.equal(buf[..., 3:], got) and torch.isnan(buf[..., :3]).all()


def _pair(layout: str, dtype: torch.dtype, shape: tuple = (2, 3, 12)) -> tuple:
    """(x, up) of ``shape`` with ``layout``: the same values in every layout of one dtype."""
    g = torch.Generator().manual_seed(7)
    x, up = ((torch.randn(*shape, generator=g) * 4).to(dtype) for _ in range(2))
    if layout == "w13 halves":  # both halves of one projection's output (row stride 2F)
        both = torch.cat([x, up], -1)
        return both[..., : shape[-1]], both[..., shape[-1]:]
    if layout == "padded rows":  # row-strided slices of larger buffers, NaN in the padding
        return strided(x, 5), strided(up, 2)
    if layout == "transposed":  # leading dims that do not flatten to rows without a copy; up's last dim not unit-stride
        return (x.transpose(0, 1).contiguous().transpose(0, 1),
                up.transpose(-1, -2).contiguous().transpose(-1, -2))
    return x, up


SWIGLU_TWO = [pytest.param(dtype, tier, layout, id=f"{str(dtype)[6:]}-{tier}-{layout}")
              for dtype in DTYPES for tier in ("torch", "triton")
              for layout in ("contiguous", "w13 halves", "padded rows", "transposed")]


@pytest.mark.parametrize("dtype, tier, layout", SWIGLU_TWO)
def test_swiglu_two_inputs_is_silu_times_up(dtype: torch.dtype, tier: str, layout: str) -> None:
    """``swiglu(x, up)`` against diffusers' ``F.silu(x) * up``: the PyTorch tier bit for bit; the Triton tier (CPU
    interpreter) bit for bit what the one-input kernel computes from ``cat([x, up])`` (one kernel, both forms), and
    within its bound of the reference (the interpreter's exp is numpy's)."""
    if tier == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    x, up = _pair(layout, dtype)
    ref = F.silu(x) * up
    got = swiglu.swiglu(x, up, tier=tier)
    assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
    if tier == "torch":
        assert torch.equal(got, ref)
    else:
        assert torch.equal(got, swiglu.swiglu(torch.cat([x, up], -1), tier="triton"))
        assert ulps(got, ref) <= (4.0 if dtype == torch.float32 else 1.0)


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_two_inputs_into_a_column_slice(tier: str, dtype: torch.dtype) -> None:
    """``out=`` a column slice of a NaN-filled buffer: exactly the slice is written, with what the call without
    ``out`` returns; ``out`` itself is returned."""
    if tier == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    x, up = _pair("padded rows", dtype)
    buf = torch.full((2, 3, 3 + 12 + 2), float("nan"), dtype=dtype)
    assert swiglu.swiglu(x, up, out=buf[..., 3:15], tier=tier) is not None
    assert torch.equal(buf[..., 3:15], swiglu.swiglu(x, up, tier=tier))
    assert torch.isnan(buf[..., :3]).all() and torch.isnan(buf[..., 15:]).all()


def _two(**change: Any):
    a = dict(x=torch.randn(2, 3, 8), up=torch.randn(2, 3, 8), out=None)
    a.update(change)
    return lambda: swiglu.swiglu(a["x"], a["up"], out=a["out"])


_BUF = torch.randn(2, 3, 24)
SWIGLU_TWO_REFUSALS = {
    "up not a tensor": (_two(up=[1.0]), r"\bup\b"),
    "up shape": (_two(up=torch.randn(2, 3, 9)), r"\bup\b"),
    "up broadcastable shape": (_two(up=torch.randn(1, 3, 8)), r"\bup\b"),
    "up dtype": (_two(up=torch.randn(2, 3, 8).bfloat16()), r"\bup\b"),
    "up device": (_two(up=torch.empty(2, 3, 8, device="meta")), r"\bup\b"),
    "x not a tensor": (_two(x=[1.0]), r"\bx\b"),
    "x dtype": (_two(x=torch.ones(2, 3, 8, dtype=torch.int32)), r"\bx\b"),
    "out shape": (_two(out=torch.empty(2, 3, 4)), r"\bout\b"),
    "out overlaps up": (_two(x=_BUF[..., :8], up=_BUF[..., 8:16], out=_BUF[..., 12:20]), r"overlaps up"),
    "out overlaps x": (_two(x=_BUF[..., 8:16], up=_BUF[..., 16:], out=_BUF[..., 4:12]), r"overlaps x"),
    "out is up": (_two(x=_BUF[..., :8], up=_BUF[..., 8:16], out=_BUF[..., 8:16]), r"overlaps up"),
}


@pytest.mark.parametrize("case", sorted(SWIGLU_TWO_REFUSALS))
def test_swiglu_two_inputs_refusals(case: str) -> None:
    """A ``ValueError`` naming the argument, before anything is written."""
    call, match = SWIGLU_TWO_REFUSALS[case]
    before = _BUF.clone()
    with pytest.raises(ValueError, match=match):
        call()
    assert torch.equal(_BUF, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_two_inputs_autograd_takes_the_torch_tier(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """With kernels as the automatic tier (as on a GPU), a call autograd records runs the PyTorch tier: the gradients
    of diffusers' expression, bit for bit, also through ``out=``; a requested kernel tier refuses."""
    monkeypatch.setattr(_tiers, "_automatic", lambda device_type: "triton")
    x0, up0 = _pair("contiguous", dtype)
    w = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    x, up, xr, upr = (t.clone().requires_grad_(True) for t in (x0, up0, x0, up0))
    got = swiglu.swiglu(x, up)
    ref = F.silu(xr) * upr
    assert torch.equal(got, ref.detach())
    (got * w).sum().backward()
    (ref * w).sum().backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(up.grad, upr.grad)
    xo, upo = (t.clone().requires_grad_(True) for t in (x0, up0))
    buf = torch.zeros(*x0.shape[:-1], x0.shape[-1] + 4, dtype=dtype)
    swiglu.swiglu(xo, upo, out=buf[..., 4:])
    (buf[..., 4:] * w).sum().backward()
    assert torch.equal(xo.grad, xr.grad) and torch.equal(upo.grad, upr.grad)
    if HAS_TRITON:
        with pytest.raises(ValueError, match="requires grad"):
            swiglu.swiglu(x, up, tier="triton")


@pytest.mark.parametrize("tier", ["torch", "triton"])
def test_swiglu_prechecked_is_the_public_op(tier: str) -> None:
    """The patterns' entry without the checks returns what ``swiglu(x, up)`` returns, bit for bit, in a new
    contiguous tensor, also from views the public entry copies."""
    if tier == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    for layout in ("contiguous", "w13 halves", "padded rows", "transposed"):
        x, up = _pair(layout, torch.bfloat16)
        with force_tier(tier):
            got = swiglu.prechecked(x, up)
            want = swiglu.swiglu(x, up)
        assert got.is_contiguous() and torch.equal(got, want), layout


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("up", [False, True])
def test_swiglu_custom_op_and_fake(tier: str, up: bool) -> None:
    """``torchpatches::swiglu_out`` in both forms: schema, fake and the mutation of ``out`` (``opcheck``)."""
    if tier == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 8 if up else 16, generator=g).bfloat16()
    out = torch.empty(2, 3, 8, dtype=torch.bfloat16)
    args = (x, out, tier, torch.randn(2, 3, 8, generator=g).bfloat16()) if up else (x, out, tier)
    torch.library.opcheck(swiglu._swiglu_op, args, test_utils=("test_schema", "test_faketensor"))


@needs_triton
@settings(**HYP)
@given(matrices())
def test_gelu_and_copy_into_slices(x: torch.Tensor) -> None:
    buf = torch.full((*x.shape[:-1], 2 * x.shape[-1] + 1), float("nan"), dtype=x.dtype)
    slices.gelu_tanh_into(x, buf[..., x.shape[-1]:-1], tier="triton")
    slices.copy_into(x, buf[..., : x.shape[-1]], tier="triton")
    ref = F.gelu(x, approximate="tanh")
    # the interpreter's tanh is exp-based (CUDA uses libdevice tanhf, torch's own): compare at |x|
    assert ulps(buf[..., x.shape[-1]:-1], ref, x) <= (8.0 if x.dtype == torch.float32 else 1.0)
    assert torch.equal(buf[..., : x.shape[-1]], x)
    assert torch.isnan(buf[..., -1]).all()
    cpu = torch.empty_like(ref)
    slices.gelu_tanh_into(x, cpu, tier="torch")
    assert torch.equal(cpu, ref)


def test_slices_validate() -> None:
    with pytest.raises(ValueError, match="must match"):
        slices.copy_into(torch.randn(2, 3), torch.empty(2, 4))
    with pytest.raises(ValueError, match="unit-stride"):
        slices.copy_into(torch.randn(3, 2), torch.empty(2, 3).t())


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_gelu_on_cpu_is_diffusers_two_ops(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g).to(dtype)
    w = torch.randn(24, 16, generator=g).to(dtype)
    b = torch.randn(24, generator=g).to(dtype)
    assert not linear_gelu.lt_tier_fits(x, w, b)
    got = linear_gelu.linear_gelu_tanh(x, w, b)
    assert torch.equal(got, F.gelu(F.linear(x, w, b), approximate="tanh"))
    if dtype == torch.float32:
        # The reason the op never takes that path on the CPU: there it is the erf GELU.
        erf_like = torch._addmm_activation(b, x.reshape(-1, 16), w.t(), use_gelu=True)
        assert torch.allclose(erf_like, F.gelu(F.linear(x, w, b)).reshape(-1, 24), atol=1e-5)
        assert not torch.allclose(erf_like, got.reshape(-1, 24), atol=1e-5)
    with pytest.raises(ValueError, match="cublaslt"):
        linear_gelu.linear_gelu_tanh(x, w, b, tier="cublaslt")


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("gelu", [False, True])
def test_slices_prechecked_is_the_public_op(tier: str, gelu: bool) -> None:
    """The pattern's entry without the checks writes what ``gelu_tanh_into`` / ``copy_into`` write, bit for bit,
    also from an ``x`` whose last dim is not unit-stride."""
    if tier == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(2, 5, 24, generator=g).bfloat16(),
              torch.randn(2, 24, 5, generator=g).bfloat16().transpose(1, 2)):
        got, want = torch.zeros(2, 5, 40, dtype=torch.bfloat16), torch.zeros(2, 5, 40, dtype=torch.bfloat16)
        with force_tier(tier):
            assert slices.prechecked(x, got[..., 16:], gelu=gelu) is not None
            (slices.gelu_tanh_into if gelu else slices.copy_into)(x, want[..., 16:])
        assert torch.equal(got, want) and not got[..., :16].any()
