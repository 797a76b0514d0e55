"""torchpatches.ops.lse_merge: two partial attention results merged by their log-sum-exps, in one pass.

The PyTorch tier is diffusers' ring merge (``TemplatedRingAttention.forward`` with ``convert_to_fp32``) and must
equal it bit for bit. The Triton tier computes the same fp32 steps; under the CPU interpreter (numpy's ``exp``
and ``log(1 + x)`` where CUDA calls libdevice's ``expf`` / ``log1pf``, the functions torch's kernels call) it
must match the PyTorch tier within 4 fp32 ulps at the inputs' magnitude, and one ulp for a 16-bit output (its
last rounding). On a GPU (a visible one) the Triton tier must equal the PyTorch tier bit for bit, but where an fp32
intermediate is subnormal (Triton's libdevice flushes those to zero): there within 2^-124.
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, HAS_TRITON, hyp, needs_triton, ulps
from torchpatches.ops._lse_merge import MAX_TRITON_D, force_tier, lse_merge

HYP = hyp(25)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def diffusers_merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                    out_dtype: torch.dtype) -> tuple:
    """diffusers 0.42.1's ring loop for two steps, as written there (the running output converted to fp32, the
    log-sum-exp given a trailing dim, the merge, the final cast and squeeze)."""
    prev_out, prev_lse = out_a.to(torch.float32), lse_a.to(torch.float32).unsqueeze(-1)
    out, lse = out_b.to(torch.float32), lse_b.to(torch.float32).unsqueeze(-1)
    out = prev_out - torch.nn.functional.sigmoid(lse - prev_lse) * (prev_out - out)
    lse = prev_lse - torch.nn.functional.logsigmoid(prev_lse - lse)
    return out.to(out_dtype), lse.squeeze(-1)


@st.composite
def cases(draw: Any) -> Dict[str, Any]:
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 3)),
             draw(st.sampled_from([1, 8, 40, 128, 130])))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    spread = draw(st.sampled_from([0.1, 3.0, 40.0]))  # from near-equal weights to one side dominating
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in range(2)]
    transposed = draw(st.booleans())  # outputs as [B, H, S, D] storage seen as [B, S, H, D]

    def out(dtype: torch.dtype) -> torch.Tensor:
        t = (torch.randn(shape[0], shape[2], shape[1], shape[3], generator=g) * 2).to(dtype)
        return t.transpose(1, 2) if transposed else t.transpose(1, 2).contiguous()

    return dict(out_a=out(dtypes[0]), lse_a=torch.randn(shape[:3], generator=g) * spread, out_b=out(dtypes[1]),
                lse_b=torch.randn(shape[:3], generator=g) * spread,
                out_dtype=draw(st.sampled_from(DTYPES)))


def call(case: Dict[str, Any], tier: str) -> tuple:
    return lse_merge(case["out_a"], case["lse_a"], case["out_b"], case["lse_b"], out_dtype=case["out_dtype"],
                     tier=tier)


@settings(**HYP)
@given(cases())
def test_torch_tier_is_diffusers_merge(case: Dict[str, Any]) -> None:
    got = call(case, "torch")
    want = diffusers_merge(case["out_a"], case["lse_a"], case["out_b"], case["lse_b"], case["out_dtype"])
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
        assert g.is_contiguous()  # as the fake says, also for strided inputs


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy: exp overflows to inf (then 1/inf)
@settings(**HYP)
@given(cases())
def test_triton_tier_matches_the_torch_tier(case: Dict[str, Any]) -> None:
    out, lse = call(case, "triton")
    ref_out, ref_lse = call(case, "torch")
    assert out.dtype == case["out_dtype"] and lse.dtype == torch.float32
    assert out.is_contiguous() and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert ulps(lse, ref_lse, case["lse_a"].abs() + case["lse_b"].abs()) <= 4.0
    scale = torch.maximum(case["out_a"].float().abs(), case["out_b"].float().abs())
    assert ulps(out, ref_out, scale) <= (4.0 if out.dtype == torch.float32 else 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_on_cuda_the_kernel_is_diffusers_merge_bit_for_bit(dtype: torch.dtype) -> None:
    """FLUX.1-dev's ring shard (2304 tokens, 24 heads of 128) and a ragged one: libdevice's quotient, expf and
    log1pf, no fused multiply-add, one cast: torch's CUDA kernels' bits."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in [(1, 2304, 24, 128), (2, 37, 3, 40)]:
        out_a, out_b = (torch.randn(shape, device="cuda", generator=g).to(dtype) for _ in range(2))
        lse_a, lse_b = (torch.randn(shape[:3], device="cuda", generator=g) * 8 for _ in range(2))
        for out_dtype in (dtype, torch.float32):
            got = lse_merge(out_a, lse_a, out_b, lse_b, out_dtype=out_dtype, tier="triton")
            want = diffusers_merge(out_a, lse_a, out_b, lse_b, out_dtype)
            for x, w in zip(got, want):
                assert torch.equal(x, w), (shape, dtype, out_dtype, (x.float() - w.float()).abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_only_subnormal_intermediates_differ() -> None:
    """The documented exception: the second partial's log-sum-exp 80 to 95 below the first's makes sigmoid's weight,
    or its product with ``out_a - out_b``, or ``exp(-|lse_a - lse_b|)``, an fp32 subnormal, which Triton's libdevice
    flushes to zero and torch's kernels keep. Where ``out_a`` (or ``lse_a``, here 0) is about zero the kernel then
    gives a value off by less than 2^-124 (4.7e-38); every element torch puts above 2^-120 is bit-equal
    (``benchmarks/lse_merge_edges.py`` maps the gaps)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (1, 64, 4, 128)
    out_a = torch.randn(shape, device="cuda", generator=g)
    out_a[:, ::2] = 0.0  # half the tokens: an exact zero the tiny weight is not lost against
    out_b = torch.randn(shape, device="cuda", generator=g)
    lse_a = torch.zeros(shape[:3], device="cuda")
    lse_b = -torch.linspace(70.0, 110.0, shape[1], device="cuda")[None, :, None].expand(shape[:3]).contiguous()
    for got, want in zip(lse_merge(out_a, lse_a, out_b, lse_b, tier="triton"),
                         diffusers_merge(out_a, lse_a, out_b, lse_b, torch.float32)):
        assert float((got - want).abs().max()) < 2.0 ** -124
        above = want.abs() > 2.0 ** -120
        assert torch.equal(got[above], want[above])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy: exp overflows to inf, inf - inf
@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_edge_values_and_aliases(tier: str, device: str) -> None:
    """Infinite and NaN log-sum-exps (a row with no visible key), one storage read as both outputs, zero sizes,
    rows without values (their log-sum-exps still merged)."""
    if tier == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    out = torch.randn(1, 4, 2, 8, device=device)
    lse_a = torch.tensor([[[0.0, float("-inf")], [float("inf"), 1.0], [float("nan"), 2.0], [-80.0, 80.0]]],
                         device=device)
    lse_b = torch.tensor([[[float("-inf"), float("-inf")], [3.0, float("inf")], [0.0, 2.0], [80.0, -80.0]]],
                         device=device)
    other = torch.randn(1, 4, 2, 8, device=device)
    got = lse_merge(out, lse_a, other, lse_b, tier=tier)
    want = diffusers_merge(out, lse_a, other, lse_b, torch.float32)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, equal_nan=True)
    finite_a, finite_b = torch.randn(1, 4, 2, device=device), torch.randn(1, 4, 2, device=device)
    flipped = out.flip(-1)  # one storage read as both outputs, through a strided view
    got = lse_merge(out, finite_a, flipped, finite_b, tier=tier)
    for g, w in zip(got, diffusers_merge(out, finite_a, flipped, finite_b, torch.float32)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    empty = lse_merge(out[:, :0], lse_a[:, :0], out[:, :0], lse_b[:, :0], out_dtype=torch.bfloat16, tier=tier)
    assert empty[0].shape == (1, 0, 2, 8) and empty[0].dtype == torch.bfloat16 and empty[1].shape == (1, 0, 2)
    no_width = lse_merge(out[..., :0], finite_a, out[..., :0], finite_b, tier=tier)  # rows without values
    assert no_width[0].shape == (1, 4, 2, 0)
    torch.testing.assert_close(no_width[1], diffusers_merge(out, finite_a, out, finite_b, torch.float32)[1],
                               rtol=1e-6, atol=1e-6)


def test_bad_input_raises_before_computing() -> None:
    o, lse = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="out_b's shape"):
        lse_merge(o, lse, o[:, :3], lse)
    with pytest.raises(ValueError, match="lse_a and lse_b must have shape"):
        lse_merge(o, lse.unsqueeze(-1), o, lse)
    with pytest.raises(ValueError, match="lse_b dtype"):
        lse_merge(o, lse, o, lse.long())
    with pytest.raises(ValueError, match="out_dtype"):
        lse_merge(o, lse, o, lse, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="at least 1 dim"):
        lse_merge(torch.tensor(1.0), lse, o, lse)


@needs_triton
def test_rows_wider_than_a_program_take_the_torch_tier() -> None:
    o, lse = torch.randn(1, MAX_TRITON_D + 1), torch.randn(1)
    with pytest.raises(ValueError, match=f"at most {MAX_TRITON_D}"):
        lse_merge(o, lse, o * 2, lse + 1, tier="triton")
    with force_tier("triton"):  # a block's forced tier (not the call's own) falls back to the reference
        got = lse_merge(o, lse, o * 2, lse + 1)
    assert torch.equal(got[0], diffusers_merge(o, lse, o * 2, lse + 1, torch.float32)[0])


def test_gradients_take_the_torch_tier_and_a_kernel_tier_refuses() -> None:
    out_a = torch.randn(1, 3, 2, 8, requires_grad=True)
    lse_a = torch.randn(1, 3, 2, requires_grad=True)
    out_b, lse_b = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2)
    out, lse = lse_merge(out_a, lse_a, out_b, lse_b)
    (out.sum() + lse.sum()).backward()
    assert out_a.grad is not None and lse_a.grad is not None and torch.isfinite(lse_a.grad).all()
    if HAS_TRITON:
        with pytest.raises(ValueError, match="requires grad"):
            lse_merge(out_a, lse_a, out_b, lse_b, tier="triton")


def test_compiles_fullgraph_as_a_custom_op() -> None:
    args = (torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2))

    def fn(*a):
        return lse_merge(*a, out_dtype=torch.bfloat16, tier="torch")

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    torch._dynamo.reset()
    for g, w in zip(got, fn(*args)):
        assert torch.equal(g, w)
