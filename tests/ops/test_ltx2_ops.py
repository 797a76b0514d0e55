"""LTX-2's forms of two ops: ``modulate`` with diffusers' weightless ``RMSNorm`` (``rms_norm_modulate`` /
``gate_residual_rms_norm_modulate`` with ``weight=None``; ``prechecked(rms=True)`` with two-term vectors) and
``rms_norm_rope``'s split RoPE (``rope="split"``: per-head ``[B, H, S, D/2]`` tables, k's of its own).

The PyTorch tier is diffusers' expression (``RMSNorm.forward``, ``LTX2VideoTransformerBlock``'s modulation,
``torch.nn.RMSNorm`` + ``apply_split_rotary_emb``): bit for bit against it. The Triton tier (Triton's interpreter on
the CPU) matches it to an ulp at the norm's magnitude (fp32 statistics in another summation order).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, hyp, needs_triton, strided, ulps
from torchpatches.ops import _modulate as modulate
from torchpatches.ops._rms_norm_rope import rms_norm_rope

pytest.importorskip("diffusers")
from diffusers.models.normalization import RMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb  # noqa: E402

HYP = hyp(15)


@st.composite
def glue(draw: Any) -> Dict[str, Any]:
    B, S = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    D = draw(st.sampled_from([2, 7, 16, 33]))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x = rnd(B, S, D, scale=draw(st.sampled_from([0.5, 4.0, 100.0])))
    if draw(st.booleans()):
        x = strided(x)
    T = draw(st.sampled_from([1, S]))  # temb per sample, or per token (per-token timesteps)
    return dict(x=x, y=rnd(B, S, D, scale=3.0), temb=rnd(B, T, 3 * D), table=rnd(3, D, scale=0.3),
                eps=draw(st.sampled_from([1e-6, 1e-5])))


def _diffusers(case: Dict[str, Any]) -> tuple:
    """``LTX2VideoTransformerBlock``'s glue: ``table + temb`` (get_mod_params), ``h = x + y * gate``,
    ``norm(h) * (1 + scale) + shift``."""
    x, D = case["x"], case["x"].shape[-1]
    B, T = case["temb"].shape[:2]
    shift, scale, gate = (case["table"][None, None] + case["temb"].reshape(B, T, 3, -1)).unbind(dim=2)
    norm = RMSNorm(D, eps=case["eps"], elementwise_affine=False)
    h = x + case["y"] * gate
    return norm(x) * (1 + scale) + shift, h, norm(h) * (1 + scale) + shift


def _fused(case: Dict[str, Any], tier: str) -> tuple:
    x, D = case["x"], case["x"].shape[-1]
    terms = case["temb"].unflatten(-1, (3, D)).unbind(-2)
    rows = case["table"].expand(x.shape[0], 1, 3, D).unbind(-2)
    with modulate.force_tier(tier):
        out = modulate.prechecked(x, None, None, terms[1], terms[0], case["eps"], addends=(None, rows[1], rows[0]),
                                  rms=True)[0]
        h, out2 = modulate.prechecked(x, terms[2], case["y"], terms[1], terms[0], case["eps"],
                                      addends=(rows[2], rows[1], rows[0]), rms=True)
    return out, h, out2


@settings(**HYP)
@given(glue())
def test_weightless_rms_glue_torch_tier_is_diffusers(case: Dict[str, Any]) -> None:
    for got, ref in zip(_fused(case, "torch"), _diffusers(case)):
        assert torch.equal(got, ref)


@needs_triton
@settings(**HYP)
@given(glue())
def test_weightless_rms_glue_triton_tier_within_an_ulp(case: Dict[str, Any]) -> None:
    ref_out, ref_h, ref_out2 = _fused(case, "torch")
    out, h, out2 = _fused(case, "triton")
    assert torch.equal(h, ref_h)  # the residual rounds as torch does
    limit = 8.0 if case["x"].dtype == torch.float32 else 1.0
    # an ulp of the norm's output, carried through (1 + scale) and + shift: at the magnitude of n * (1 + scale)
    assert ulps(out, ref_out, ref_out.abs() + 4) <= 4 * limit
    assert ulps(out2, ref_out2, ref_out2.abs() + 4) <= 4 * limit


def test_public_entries_take_weight_none() -> None:
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    scale, shift, gate = (torch.randn(2, 8, dtype=torch.bfloat16) for _ in range(3))
    norm = RMSNorm(8, eps=1e-6, elementwise_affine=False)
    out = modulate.rms_norm_modulate(x, None, scale, shift, eps=1e-6, tier="torch")
    assert torch.equal(out, norm(x) * (1 + scale[:, None]) + shift[:, None])
    h, out = modulate.gate_residual_rms_norm_modulate(x, gate, x * 2, None, scale, shift, eps=1e-6, tier="torch")
    ref_h = x + gate[:, None] * (x * 2)
    assert torch.equal(h, ref_h) and torch.equal(out, norm(ref_h) * (1 + scale[:, None]) + shift[:, None])
    with pytest.raises(ValueError, match="weight"):
        modulate.rms_norm_modulate(x, "w", scale, shift)


# ---- rms_norm_rope, rope="split" -----------------------------------------------------------------------------------


@st.composite
def split_cases(draw: Any) -> Dict[str, Any]:
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    D = draw(st.sampled_from([2, 6, 8, 16]))
    Sq = draw(st.integers(1, 4))
    Sk = draw(st.sampled_from([Sq, 1, 3]))
    own_k = Sk != Sq or draw(st.booleans())  # cross-modal: k's own tables
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    W = H * D

    def tables(S: int) -> tuple:
        # as LTX2AudioVideoRotaryPosEmbed makes them: [B, S, W/2] angles, reshaped to heads and swapped: [B, H, S, D/2]
        angles = torch.rand(B, S, W // 2, generator=g) * 40 - 20
        return tuple(t.reshape(B, S, H, -1).swapaxes(1, 2) for t in (angles.cos(), angles.sin()))

    q = (torch.randn(B, Sq, W, generator=g) * 3).to(dtype)
    if draw(st.booleans()):
        q = strided(q)
    weights = [(torch.rand(W, generator=g) + 0.5).to(dtype) for _ in range(2)]
    return dict(q=q, k=(torch.randn(B, Sk, W, generator=g) * 3).to(dtype), weights=weights, q_tables=tables(Sq),
                k_tables=tables(Sk) if own_k else None)


def _split_call(case: Dict[str, Any], tier: str) -> tuple:
    wq, wk = case["weights"]
    k_cos, k_sin = case["k_tables"] if case["k_tables"] is not None else (None, None)
    return rms_norm_rope(case["q"], case["k"], q_weight=wq, k_weight=wk, eps_q=1e-6, eps_k=1e-5,
                         cos=case["q_tables"][0], sin=case["q_tables"][1], rope="split", k_cos=k_cos, k_sin=k_sin,
                         tier=tier)


def _split_diffusers(case: Dict[str, Any]) -> tuple:
    """``LTX2AudioVideoAttnProcessor``: ``torch.nn.RMSNorm`` across heads, then ``apply_split_rotary_emb``."""
    W = case["q"].shape[-1]
    out = []
    for x, w, eps, tables in ((case["q"], case["weights"][0], 1e-6, case["q_tables"]),
                              (case["k"], case["weights"][1], 1e-5, case["k_tables"] or case["q_tables"])):
        norm = torch.nn.RMSNorm(W, eps=eps, dtype=x.dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
            out.append(apply_split_rotary_emb(norm(x), tables))
    return tuple(out)


@settings(**HYP)
@given(split_cases())
def test_split_rope_torch_tier_is_diffusers(case: Dict[str, Any]) -> None:
    for got, ref in zip(_split_call(case, "torch"), _split_diffusers(case)):
        assert torch.equal(got, ref)


@needs_triton
@settings(**HYP)
@given(split_cases())
def test_split_rope_triton_tier_within_an_ulp(case: Dict[str, Any]) -> None:
    limit = 8.0 if case["q"].dtype == torch.float32 else 1.0
    for got, ref in zip(_split_call(case, "triton"), _split_call(case, "torch")):
        assert got.shape == ref.shape and got.is_contiguous()
        assert ulps(got, ref, ref.abs() + 2) <= 2 * limit


def test_split_rope_refuses_what_does_not_fit() -> None:
    q = torch.randn(1, 3, 8)
    w = torch.ones(8)
    cos = torch.ones(1, 2, 3, 2)
    with pytest.raises(ValueError, match="rope"):
        rms_norm_rope(q, q, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, cos=cos, sin=cos, rope="half")
    with pytest.raises(ValueError, match="D/2"):  # 2 heads x 2 x 2 = 8 fits; 2 x 2 x 3 does not
        rms_norm_rope(q, q, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, cos=torch.ones(1, 2, 3, 3),
                      sin=torch.ones(1, 2, 3, 3), rope="split")
    with pytest.raises(ValueError, match="k_cos"):  # k of another length needs its own tables
        rms_norm_rope(q, q[:, :2], q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, cos=cos, sin=cos, rope="split")
    with pytest.raises(ValueError, match="split"):
        rms_norm_rope(q, q, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, k_cos=cos, k_sin=cos)
