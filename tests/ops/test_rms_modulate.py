"""torchpatches.ops rms_modulate: diffusers' RMSNorm + scale, gated post-norm residual, both in one pass.

The PyTorch tier is diffusers' own expression (``RMSNorm.forward`` then the Z-Image / Ideogram 4 block's products),
so it is the reference for rounding: the Triton tier (run on the CPU by Triton's interpreter, tiny shapes) must match
it to one ulp at the norm's magnitude (fp32 statistics in another summation order), and both must be within a few unit
roundoffs of float64 math.
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, UNIT, hyp, needs_triton, strided, ulps
from torchpatches.ops import _rms_modulate as rms

HYP = hyp(25)


@st.composite
def cases(draw: Any) -> Dict[str, Any]:
    B = draw(st.integers(1, 2))
    S = draw(st.integers(1, 4))
    D = draw(st.sampled_from([1, 2, 7, 16, 33, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    form = draw(st.sampled_from(["BD", "B1D", "BSD"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    vec_shape = {"BD": (B, D), "B1D": (B, 1, D), "BSD": (B, S, D)}[form]

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x = rnd(B, S, D, scale=draw(st.sampled_from([0.5, 4.0, 100.0])))
    if draw(st.booleans()):
        x = strided(x)
    return dict(x=x, y=rnd(B, S, D, scale=3.0), gate=rnd(*vec_shape).tanh(), scale=1.0 + rnd(*vec_shape, scale=0.5),
                y_weight=1.0 + rnd(D, scale=0.2), weight=1.0 + rnd(D, scale=0.2),
                eps=draw(st.sampled_from([1e-6, 1e-5])))


def tok(v: torch.Tensor) -> torch.Tensor:
    return v[:, None] if v.dim() == 2 else v


def rms_64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def close_to_64(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, rounds: int) -> None:
    tol = rounds * UNIT[out.dtype] * magnitude.double().abs() + 1e-5 * magnitude.double().abs() + 1e-6
    bad = (out.double() - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} element(s) off: max {float((out.double() - ref).abs().max())}"


@needs_triton
@settings(**HYP)
@given(cases())
def test_triton_tier_matches_diffusers_rounding_and_float64(case: Dict[str, Any]) -> None:
    x, y, gate, scale, wy, w, eps = (case[k] for k in ("x", "y", "gate", "scale", "y_weight", "weight", "eps"))
    limit = 8.0 if x.dtype == torch.float32 else 1.0  # fp32 outputs carry the statistics' own few-ulp differences
    ref = rms.rms_norm_scale(x, w, scale, eps=eps, tier="torch")
    got = rms.rms_norm_scale(x, w, scale, eps=eps, tier="triton")
    magnitude = rms_64(x, w, eps).abs() * tok(scale).double().abs()
    assert ulps(got, ref, magnitude) <= limit
    close_to_64(got, rms_64(x, w, eps) * tok(scale).double(), magnitude, rounds=4)

    ref_h = rms.gate_rms_norm_residual(x, gate, y, wy, eps=eps, tier="torch")
    got_h = rms.gate_rms_norm_residual(x, gate, y, wy, eps=eps, tier="triton")
    n64 = tok(gate).double() * rms_64(y, wy, eps)
    assert ulps(got_h, ref_h, x.double().abs() + n64.abs()) <= limit
    close_to_64(got_h, x.double() + n64, x.double().abs() + n64.abs(), rounds=4)

    h2, out2 = rms.gate_rms_norm_residual_scale(x, gate, y, wy, w, scale, y_eps=eps, eps=eps, tier="triton")
    r_h2, r_out2 = rms.gate_rms_norm_residual_scale(x, gate, y, wy, w, scale, y_eps=eps, eps=eps, tier="torch")
    assert torch.equal(h2, got_h) and torch.equal(r_h2, ref_h)
    assert ulps(out2, r_out2, rms_64(r_h2, w, eps).abs() * tok(scale).double().abs()) <= limit
    assert out2.is_contiguous() and h2.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_tier_is_the_blocks_expression(dtype: torch.dtype) -> None:
    """The PyTorch tier computes exactly what diffusers' ZImageTransformerBlock computes with its RMSNorms."""
    from diffusers.models.normalization import RMSNorm

    g = torch.Generator().manual_seed(0)
    x, attn_out = torch.randn(2, 5, 24, generator=g).to(dtype), torch.randn(2, 5, 24, generator=g).to(dtype)
    norm1, norm2, ffn_norm1 = (RMSNorm(24, eps=1e-5).to(dtype) for _ in range(3))
    for norm in (norm1, norm2, ffn_norm1):
        torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    scale_msa, gate_msa, scale_mlp = (torch.randn(2, 1, 24, generator=g).to(dtype) for _ in range(3))
    scale_msa, gate_msa, scale_mlp = 1.0 + scale_msa, gate_msa.tanh(), 1.0 + scale_mlp
    with torch.no_grad():
        assert torch.equal(rms.rms_norm_scale(x, norm1.weight, scale_msa, tier="torch"), norm1(x) * scale_msa)
        h = x + gate_msa * norm2(attn_out)
        got_h, got = rms.gate_rms_norm_residual_scale(x, gate_msa, attn_out, norm2.weight, ffn_norm1.weight,
                                                      scale_mlp, tier="torch")
        assert torch.equal(got_h, h) and torch.equal(got, ffn_norm1(h) * scale_mlp)


@needs_triton
def test_outputs_are_fully_written_and_nan_passes() -> None:
    x, y = torch.randn(3, 7, 40), torch.randn(3, 7, 40)
    w, gate, scale = torch.ones(40), torch.randn(3, 40), torch.randn(3, 40)
    h, out = rms.gate_rms_norm_residual_scale(x, gate, y, w, w, scale, tier="triton")
    assert torch.isfinite(h).all() and torch.isfinite(out).all()
    y[0, 0, 0] = float("nan")
    h, out = rms.gate_rms_norm_residual_scale(x, gate, y, w, w, scale, tier="triton")
    assert torch.isnan(h[0, 0]).all() and torch.isfinite(h[0, 1:]).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(x=torch.randn(2, 3)), "3-D"),
        (dict(x=torch.randn(2, 3, 4).int()), "dtype"),
        (dict(weight=torch.ones(5)), r"weight must be a \[4\]"),
        (dict(weight=torch.ones(4).double()), "weight is torch.float64"),
        (dict(weight=None), "weight must be a torch.Tensor"),
        (dict(scale=torch.randn(2, 5)), r"\[B, D\]"),
        (dict(scale=torch.randn(2, 4).double()), "expected"),
        (dict(scale=None), r"\[B, D\]|scale must be"),
    ],
)
def test_bad_input_raises_value_error(kwargs: Dict[str, Any], message: str) -> None:
    args = dict(x=torch.randn(2, 3, 4), weight=torch.ones(4), scale=torch.randn(2, 4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        rms.rms_norm_scale(args["x"], args["weight"], args["scale"], tier="torch")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(y=torch.randn(2, 4, 4)), "does not match"),
        (dict(y=None), "y must be a torch.Tensor"),
        (dict(gate=None), "gate must be a torch.Tensor"),
        (dict(gate=torch.randn(3, 4)), r"\[B, D\]"),
        (dict(weight=torch.ones(4, dtype=torch.bfloat16)), "^weight is torch.bfloat16"),
        (dict(weight=torch.ones(5)), r"^weight must be a \[4\]"),
    ],
)
def test_bad_residual_input_raises_value_error(kwargs: Dict[str, Any], message: str) -> None:
    args = dict(residual=torch.randn(2, 3, 4), gate=torch.randn(2, 4), y=torch.randn(2, 3, 4), weight=torch.ones(4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        rms.gate_rms_norm_residual(args["residual"], args["gate"], args["y"], args["weight"], tier="torch")


def test_gradients_through_the_reference_tier() -> None:
    """Autograd records: the PyTorch tier runs (the kernel has no backward) and gradients are diffusers'."""
    x = torch.randn(2, 3, 8, requires_grad=True)
    w, scale = torch.ones(8), torch.randn(2, 8)
    rms.rms_norm_scale(x, w, scale).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    (rms.rms_norm_torch(x2, w, 1e-5) * scale[:, None]).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    with pytest.raises(ValueError, match="grad|backward|autograd"):
        rms.rms_norm_scale(x, w, scale, tier="triton")


def test_compiles_fullgraph_as_a_custom_op() -> None:
    x, g, y = torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 3, 8)
    w, sc = torch.randn(8), torch.randn(2, 8)

    def fn(x, g, y, w, sc):
        return rms.gate_rms_norm_residual_scale(x, g, y, w, w, sc, tier="torch")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, ref in zip(compiled(x, g, y, w, sc), fn(x, g, y, w, sc)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch._dynamo.reset()
