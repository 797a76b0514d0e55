"""torchpatches.ops.swiglu, ops.slices (GELU / copy into a concat slice) and ops.linear_gelu.

SwiGLU and GELU round where diffusers rounds, so the Triton tier (interpreter on the CPU, tiny shapes)
matches diffusers' modules to one ulp (Triton's exp/tanh against torch's); writes into slices leave
the rest of the buffer untouched. ``linear_gelu_tanh`` must never use ``torch._addmm_activation`` on the
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
