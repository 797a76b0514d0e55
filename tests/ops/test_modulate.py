"""torchpatches.ops.modulate: LayerNorm + modulate, gate + residual, both in one pass.

The PyTorch tier is diffusers' own expression, so it is the reference for rounding: the Triton tier
(run on the CPU by Triton's interpreter, tiny shapes) must match it bit for bit for gate + residual,
and to one ulp at the intermediate's magnitude where the LayerNorm is involved (fp32 statistics in
another summation order; a few ulps for fp32 outputs). Both are checked against float64 math with a tolerance of a few unit
roundoffs of the dtype times the magnitude of the terms (bf16 rounds four times on the way).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, UNIT, hyp, needs_triton, strided, ulps
from torchpatches.ops import _modulate as modulate

HYP = hyp(25)


@st.composite
def cases(draw: Any) -> Dict[str, Any]:
    B = draw(st.integers(1, 2))
    S = draw(st.integers(1, 4))
    D = draw(st.sampled_from([1, 2, 7, 16, 33, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    form = draw(st.sampled_from(["BD", "B1D", "BSD"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    vec_shape = {"BD": (B, D), "B1D": (B, 1, D), "BSD": (B, S, D)}[form]

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x = rnd(B, S, D, scale=draw(st.sampled_from([0.5, 4.0, 100.0])))
    if draw(st.booleans()):
        x = strided(x)
    return dict(x=x, y=rnd(B, S, D), gate=rnd(*vec_shape), scale=rnd(*vec_shape, scale=0.5),
                shift=rnd(*vec_shape), dtype=dtype, eps=draw(st.sampled_from([1e-6, 1e-5])))


def tok(v: torch.Tensor) -> torch.Tensor:
    return v[:, None] if v.dim() == 2 else v


def ln_mod_64(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * (1 + tok(scale).double()) + tok(shift).double()


def ln_magnitude(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Magnitude the LayerNorm output's error scales with: ``x - mean`` cancels, so (|x| + |mean|) * rstd."""
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
    return (x.abs() + mean.abs()) * rstd * (1 + tok(scale).double()).abs()


def close_to_64(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, rounds: int) -> None:
    """|out - ref| <= rounds unit roundoffs of the magnitude of the terms (plus fp32 LN noise)."""
    tol = rounds * UNIT[out.dtype] * magnitude.double().abs() + 1e-5 * magnitude.double().abs() + 1e-6
    bad = (out.double() - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} element(s) off: max {float((out.double() - ref).abs().max())}"


@needs_triton
@settings(**HYP)
@given(cases())
def test_triton_tier_matches_diffusers_rounding_and_float64(case: Dict[str, Any]) -> None:
    x, y, gate, scale, shift, eps = (case[k] for k in ("x", "y", "gate", "scale", "shift", "eps"))
    # gate + residual: two roundings, the same in both tiers: bit-identical.
    ref_h = modulate.gate_residual(x, gate, y, tier="torch")
    got_h = modulate.gate_residual(x, gate, y, tier="triton")
    assert torch.equal(got_h, ref_h) or ulps(got_h, ref_h) == 0.0
    close_to_64(got_h, x.double() + tok(gate).double() * y.double(),
                x.double().abs() + (tok(gate).double() * y.double()).abs(), rounds=2)

    # LayerNorm + modulate, alone and after the residual.
    ref = modulate.layer_norm_modulate(x, scale, shift, eps=eps, tier="torch")
    got = modulate.layer_norm_modulate(x, scale, shift, eps=eps, tier="triton")
    u = ln_magnitude(x, scale, eps)  # |n * (1 + scale)| before the cancellation in x - mean
    # bf16/fp16: an fp32 statistic differing in its last bit can move one rounding by one ulp; fp32
    # outputs carry the statistics' own few-ulp differences (LN is several fp32 operations).
    limit = 8.0 if case["dtype"] == torch.float32 else 1.0
    assert ulps(got, ref, u) <= limit
    expect = ln_mod_64(x, scale, shift, eps)
    close_to_64(got, expect, u + tok(shift).double().abs(), rounds=4)

    h2, out2 = modulate.gate_residual_layer_norm_modulate(x, gate, y, scale, shift, eps=eps, tier="triton")
    r_h2, r_out2 = modulate.gate_residual_layer_norm_modulate(x, gate, y, scale, shift, eps=eps, tier="torch")
    assert torch.equal(h2, r_h2) or ulps(h2, r_h2) == 0.0
    assert ulps(out2, r_out2, ln_magnitude(r_h2, scale, eps)) <= limit
    assert out2.is_contiguous() and h2.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_tier_is_diffusers_expression(dtype: torch.dtype) -> None:
    """The PyTorch tier computes exactly what AdaLayerNormZero / the FLUX blocks compute."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 24, generator=g).to(dtype)
    emb = torch.randn(2, 6 * 24, generator=g).to(dtype)
    shift, scale, gate = emb.chunk(6, dim=1)[:3]
    norm = torch.nn.LayerNorm(24, elementwise_affine=False, eps=1e-6)
    assert torch.equal(modulate.layer_norm_modulate(x, scale, shift, tier="torch"),
                       norm(x) * (1 + scale[:, None]) + shift[:, None])
    y = torch.randn(2, 5, 24, generator=g).to(dtype)
    assert torch.equal(modulate.gate_residual(x, gate, y, tier="torch"), x + gate.unsqueeze(1) * y)


@needs_triton
def test_fp16_clip_and_nan() -> None:
    x = torch.tensor([[[60000.0, -60000.0, 1.0, float("nan")]]], dtype=torch.float16)
    gate = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float16)
    y = torch.tensor([[[60000.0, -60000.0, 1.0, 1.0]]], dtype=torch.float16)
    for tier in ("torch", "triton"):
        clipped = modulate.gate_residual(x, gate, y, clip_fp16=True, tier=tier)
        assert clipped[0, 0, :3].tolist() == [65504.0, -65504.0, 2.0] and torch.isnan(clipped[0, 0, 3])
        unclipped = modulate.gate_residual(x, gate, y, tier=tier)
        assert torch.isinf(unclipped[0, 0, :2]).all()


@needs_triton
def test_outputs_are_fully_written() -> None:
    """Every output element is written: fresh outputs over a NaN-filled allocation pool show no NaN."""
    x = torch.randn(3, 7, 40)
    scale, shift, gate = torch.randn(3, 40), torch.randn(3, 40), torch.randn(3, 40)
    h, out = modulate.gate_residual_layer_norm_modulate(x, gate, x, scale, shift, tier="triton")
    assert torch.isfinite(h).all() and torch.isfinite(out).all()


@needs_triton
def test_launch_constants_cached_per_form_and_a_bound_heuristic_applies_after_cache_clear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton tier builds a form's constexprs once (``pick_config`` is not called again); a caller's own
    ``pick_config`` (a launch-configuration sweep) applies after ``_launch_constants.cache_clear()``, and two rows
    per program give the same output."""
    from torchpatches.ops import _modulate_triton

    x, scale, shift = torch.randn(2, 5, 16), torch.randn(2, 16), torch.randn(2, 16)
    seen, picks = [], []
    real, real_pick = _modulate_triton.launch_kernel, _modulate_triton.pick_config
    monkeypatch.setattr(_modulate_triton, "launch_kernel",
                        lambda kernel, grid, args, constexprs: (seen.append((grid, dict(constexprs))),
                                                                real(kernel, grid, args, constexprs)))
    monkeypatch.setattr(_modulate_triton, "pick_config",
                        lambda block_d, interpreted: (picks.append(block_d), real_pick(block_d, interpreted))[1])
    _modulate_triton._launch_constants.cache_clear()
    one = modulate.layer_norm_modulate(x, scale, shift, tier="triton")
    again = modulate.layer_norm_modulate(x, scale, shift, tier="triton")
    assert picks == [16]  # once per form
    monkeypatch.setattr(_modulate_triton, "pick_config", lambda block_d, interpreted: dict(num_warps=1, ROWS=2))
    _modulate_triton._launch_constants.cache_clear()
    try:
        two = modulate.layer_norm_modulate(x, scale, shift, tier="triton")
    finally:
        _modulate_triton._launch_constants.cache_clear()
    assert [g for g, _ in seen] == [(10,), (10,), (5,)]
    assert [c["ROWS"] for _, c in seen] == [1, 1, 2]
    assert torch.equal(one, again) and torch.equal(one, two)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(x=torch.randn(2, 3)), "3-D"),
        (dict(x=torch.randn(2, 3, 4).int()), "dtype"),
        (dict(scale=torch.randn(2, 5)), r"\[B, D\]"),
        (dict(scale=torch.randn(2, 4).double()), "expected"),
        (dict(shift=torch.randn(3, 4)), r"\[B, D\]"),
    ],
)
def test_bad_input_raises_value_error(kwargs: Dict[str, Any], message: str) -> None:
    args = dict(x=torch.randn(2, 3, 4), scale=torch.randn(2, 4), shift=torch.randn(2, 4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        modulate.layer_norm_modulate(args["x"], args["scale"], args["shift"], tier="torch")


def test_compiles_fullgraph_as_a_custom_op() -> None:
    """Under torch.compile the op is one custom op with a fake: no graph break, same values."""
    x, g, y = torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 3, 8)
    sc, sh = torch.randn(2, 8), torch.randn(2, 8)

    def fn(x, g, y, sc, sh):
        return modulate.gate_residual_layer_norm_modulate(x, g, y, sc, sh, tier="torch")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, ref in zip(compiled(x, g, y, sc, sh), fn(x, g, y, sc, sh)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch._dynamo.reset()


# ---- Wan's forms: a residual add without gate, an affine LayerNorm ------------------------------------


@needs_triton
@settings(**HYP)
@given(cases(), st.sampled_from(["each", "once"]))
def test_plain_residual_and_affine_layer_norm_forms(case: Dict[str, Any], rounding: str) -> None:
    """``h = residual + y`` (one rounding: bit-identical in both tiers) then LN + modulate, and
    ``h = residual + gate * y`` then an affine LayerNorm (fp32, one rounding), against float64 and the
    PyTorch tier. With rounding='once' the vectors, weight and bias are fp32 (Wan's tables)."""
    x, y, gate, scale, shift, eps = (case[k] for k in ("x", "y", "gate", "scale", "shift", "eps"))
    D = x.shape[-1]
    g = torch.Generator().manual_seed(D)
    vec_dtype = torch.float32 if rounding == "once" else x.dtype
    gate, scale, shift = (t.to(vec_dtype) for t in (gate, scale, shift))
    weight = (1 + 0.5 * torch.randn(D, generator=g)).to(vec_dtype)
    bias = torch.randn(D, generator=g).to(vec_dtype)
    limit = 8.0 if case["dtype"] == torch.float32 else 1.0

    h, out = modulate.residual_layer_norm_modulate(x, y, scale, shift, eps=eps, rounding=rounding, tier="triton")
    r_h, r_out = modulate.residual_layer_norm_modulate(x, y, scale, shift, eps=eps, rounding=rounding, tier="torch")
    assert torch.equal(h, r_h) and torch.equal(r_h, x + y)
    assert ulps(out, r_out, ln_magnitude(r_h, scale, eps)) <= limit
    close_to_64(out, ln_mod_64(r_h, scale, shift, eps), ln_magnitude(r_h, scale, eps) + tok(shift).double().abs(),
                rounds=4)

    h, out = modulate.gate_residual_layer_norm(x, gate, y, weight, bias, eps=eps, rounding=rounding, tier="triton")
    r_h, r_out = modulate.gate_residual_layer_norm(x, gate, y, weight, bias, eps=eps, rounding=rounding, tier="torch")
    assert torch.equal(h, r_h) or ulps(h, r_h) == 0.0
    mag = ln_magnitude(r_h, weight.expand(1, D) - 1, eps)  # |n * weight|
    assert ulps(out, r_out, mag) <= limit
    expect = torch.nn.functional.layer_norm(r_h.double(), (D,), weight.double(), bias.double(), eps)
    close_to_64(out, expect, mag + bias.double().abs(), rounds=2)
    assert h.is_contiguous() and out.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_tier_is_wans_expression(dtype: torch.dtype) -> None:
    """The PyTorch tier of the Wan forms is WanTransformerBlock's own expression, bit for bit."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 24, generator=g).to(dtype)
    y = torch.randn(2, 5, 24, generator=g).to(dtype)
    table = torch.randn(2, 3, 24, generator=g)  # fp32: scale_shift_table + temb.float()
    gate, scale, shift = table.chunk(3, dim=1)
    w, b = torch.randn(24, generator=g), torch.randn(24, generator=g)
    norm2 = torch.nn.LayerNorm(24, eps=1e-6)
    with torch.no_grad():
        norm2.weight.copy_(w), norm2.bias.copy_(b)
    got_h, got = modulate.gate_residual_layer_norm(h, gate, y, w, b, rounding="once", tier="torch")
    want_h = (h.float() + y * gate).type_as(h)
    assert torch.equal(got_h, want_h) and torch.equal(got, norm2(want_h.float()).type_as(h))
    got_h, got = modulate.residual_layer_norm_modulate(h, y, scale, shift, rounding="once", tier="torch")
    norm3 = torch.nn.LayerNorm(24, eps=1e-6, elementwise_affine=False)
    assert torch.equal(got_h, h + y)
    assert torch.equal(got, (norm3((h + y).float()) * (1 + scale) + shift).type_as(h))


def _transposed(v: torch.Tensor) -> torch.Tensor:
    """The same values with a last dim that is not unit-stride (when it has more than one element)."""
    return v.transpose(0, -1).contiguous().transpose(0, -1)


@needs_triton
@settings(**hyp(12))
@given(cases(), st.sampled_from(["each", "once"]), st.sampled_from(["triton", "torch"]), st.booleans())
def test_prechecked_is_the_public_ops(case: Dict[str, Any], rounding: str, tier: str, transposed: bool) -> None:
    """The patterns' entry without the checks gives each public entry's result bit for bit, in each tier, for
    every form it takes (norm only, gated residual, both, plain residual + norm), with inputs that are not
    unit-stride made so as the public entries make them."""
    x, y, gate, scale, shift, eps = (case[k] for k in ("x", "y", "gate", "scale", "shift", "eps"))
    if rounding == "once":
        gate, scale, shift = (t.float() for t in (gate, scale, shift))
    if transposed:
        gate, scale, shift = (_transposed(t) for t in (gate, scale, shift))
    once = rounding == "once"
    with modulate.force_tier(tier):
        pairs = [
            (modulate.prechecked(x, None, None, scale, shift, eps, once=once),
             [modulate.layer_norm_modulate(x, scale, shift, eps=eps, rounding=rounding)]),
            (modulate.prechecked(x, gate, y, None, None, None, clip=True, once=once),
             [modulate.gate_residual(x, gate, y, clip_fp16=True, rounding=rounding)]),
            (modulate.prechecked(x, gate, y, scale, shift, eps, once=once),
             modulate.gate_residual_layer_norm_modulate(x, gate, y, scale, shift, eps=eps, rounding=rounding)),
            (modulate.prechecked(x, None, y, scale, shift, eps, once=once),
             modulate.residual_layer_norm_modulate(x, y, scale, shift, eps=eps, rounding=rounding)),
        ]
    for got, want in pairs:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.is_contiguous() and torch.equal(g, w)


def test_prechecked_records_autograd_in_the_pytorch_tier() -> None:
    """Grad mode with a vector that requires grad: the PyTorch tier, recorded, with the public entry's gradient."""
    x = torch.randn(2, 3, 8)
    scale = torch.randn(2, 8, requires_grad=True)
    shift = torch.randn(2, 8)
    got, = modulate.prechecked(x, None, None, scale, shift, 1e-6)
    want = modulate.layer_norm_modulate(x, scale, shift)
    assert got.grad_fn is not None and torch.equal(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), scale)
    (g_want,) = torch.autograd.grad(want.sum(), scale)
    assert torch.equal(g_got, g_want)
