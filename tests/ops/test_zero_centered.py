"""Krea 2's forms of three ops: ``modulate`` with its zero-centered RMSNorm (``rms_norm_modulate``,
``gate_residual_rms_norm_modulate``, the rounded two-term vectors of ``prechecked``), ``qk_norm_rope`` with
``rounding="zero_centered"`` and GQA (``k_repeat``), and ``swiglu``'s sigmoid GLU (the attention output gate).

The PyTorch tier is diffusers' expression (``Krea2RMSNorm.forward``, ``Krea2TransformerBlock.forward``'s products,
``apply_rotary_emb``, ``repeat_interleave``): bit for bit against it. The Triton tier (Triton's interpreter on the
CPU) matches it to one ulp at the norm's magnitude (fp32 statistics in another summation order).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, UNIT, hyp, interleaved_tables, needs_triton, strided
from torchpatches.ops import _modulate as modulate, _qk_norm_rope as qknr, _swiglu as swiglu, force_tier

HYP = hyp(20)


def krea_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers 0.42.1 ``Krea2RMSNorm.forward``."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight=w + 1.0, eps=eps).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb(x, (cos, sin), sequence_dim=1)`` (use_real, interleaved pairs)."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def within_ulp(out: torch.Tensor, ref: torch.Tensor, ulps: int = 1) -> None:
    tol = ulps * UNIT[out.dtype] * 2 * ref.double().abs() + 1e-6
    bad = (out.double() - ref.double()).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} element(s) off: max {float((out.double() - ref.double()).abs().max())}"


@st.composite
def block_cases(draw: Any) -> Dict[str, Any]:
    B, S = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    D = draw(st.sampled_from([2, 7, 16, 33, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    w_dtype = draw(st.sampled_from([torch.float32, dtype]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def rnd(*shape: int, scale: float = 1.0, to: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(to)

    x = rnd(B, S, D, scale=draw(st.sampled_from([0.5, 4.0, 100.0])))
    if draw(st.booleans()):
        x = strided(x)
    return dict(x=x, y=rnd(B, S, D, scale=3.0), temb=rnd(B, 1, 6 * D), table=rnd(6, D, scale=0.3),
                weight=rnd(D, scale=0.2, to=w_dtype), eps=draw(st.sampled_from([1e-6, 1e-5])))


def _block_reference(c: Dict[str, Any]) -> tuple:
    """Krea2TransformerBlock.forward's glue with ``attn`` and ``ff`` the identity on ``y`` (their outputs given)."""
    x, y, w, eps = c["x"], c["y"], c["weight"], c["eps"]
    prescale, preshift, pregate, postscale, postshift, postgate = (c["temb"].unflatten(-1, (6, -1)) + c["table"]
                                                                   ).unbind(-2)
    out1 = (1.0 + prescale) * krea_norm(x, w, eps) + preshift
    h = x + pregate * y
    out2 = (1.0 + postscale) * krea_norm(h, w, eps) + postshift
    return out1, h, out2, h + postgate * y


def _block_fused(c: Dict[str, Any]) -> tuple:
    x, y, w, eps = c["x"], c["y"], c["weight"], c["eps"]
    terms = c["temb"].unflatten(-1, (6, -1)).unbind(-2)
    rows = c["table"].expand(x.shape[0], 1, *c["table"].shape).unbind(-2)
    out1 = modulate.prechecked(x, None, None, terms[0], terms[1], eps, addends=(None, rows[0], rows[1]),
                               norm_weight=w)[0]
    h, out2 = modulate.prechecked(x, terms[2], y, terms[3], terms[4], eps, addends=rows[2:5], norm_weight=w)
    last = modulate.prechecked(h, terms[5], y, None, None, None, addends=(rows[5], None, None))[0]
    return out1, h, out2, last


@settings(**HYP)
@given(block_cases())
def test_block_glue_torch_tier_is_diffusers(c: Dict[str, Any]) -> None:
    with force_tier("torch"):
        got = _block_fused(c)
    for g, r in zip(got, _block_reference(c)):
        assert torch.equal(g, r)


@needs_triton
@settings(**HYP)
@given(block_cases())
def test_block_glue_kernel_within_an_ulp(c: Dict[str, Any]) -> None:
    with force_tier("triton"):
        got = _block_fused(c)
    ref = _block_reference(c)
    assert torch.equal(got[1], ref[1])  # the gated residual: the same roundings, no statistics
    for g, r in zip(got, ref):
        within_ulp(g, r, 2 if g.dtype == torch.float32 else 1)


def test_public_entries_check_and_compute() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    w, scale, shift, gate = (torch.randn(2, 8, generator=g)[0] * 0.1, torch.randn(2, 8, generator=g),
                             torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g))
    out = modulate.rms_norm_modulate(x, w, scale, shift, tier="torch")
    assert torch.equal(out, (1.0 + scale[:, None]) * krea_norm(x, w, 1e-5) + shift[:, None])
    h, out = modulate.gate_residual_rms_norm_modulate(x, gate, y, w, scale, shift, tier="torch")
    assert torch.equal(h, x + gate[:, None] * y)
    assert torch.equal(out, (1.0 + scale[:, None]) * krea_norm(h, w, 1e-5) + shift[:, None])
    with pytest.raises(ValueError, match="weight"):
        modulate.rms_norm_modulate(x, torch.zeros(7), scale, shift)
    with pytest.raises(ValueError, match="weight"):
        modulate.rms_norm_modulate(x, "w", scale, shift)  # None: the weightless form (test_ltx2_ops)


@st.composite
def qk_cases(draw: Any) -> Dict[str, Any]:
    B, S = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    kv_heads, rep = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([2, 8, 16, 24]))
    dtype = draw(st.sampled_from(DTYPES))
    w_dtype = draw(st.sampled_from([torch.float32, dtype]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, S, kv_heads * rep, D, generator=g).to(dtype)
    k = (torch.randn(B, S, kv_heads, D, generator=g) * 3).to(dtype)
    if draw(st.booleans()):  # a column slice of a wider projection, as diffusers' unflatten views can be
        k = torch.randn(B, S, kv_heads + 1, D, generator=g).to(dtype)[:, :, 1:]
    cos, sin = interleaved_tables(torch.randn(S, D // 2, generator=g))
    return dict(q=q, k=k, rep=rep, cos=cos, sin=sin, wq=(torch.randn(D, generator=g) * 0.2).to(w_dtype),
                wk=(torch.randn(D, generator=g) * 0.2).to(w_dtype), rotate=draw(st.booleans()))


def _qk_reference(c: Dict[str, Any]) -> tuple:
    """Krea2AttnProcessor's stretch: norms, RoPE, then k's repeat over heads."""
    q, k = krea_norm(c["q"], c["wq"], 1e-5), krea_norm(c["k"], c["wk"], 1e-5)
    if c["rotate"]:
        q, k = rope(q, c["cos"], c["sin"]), rope(k, c["cos"], c["sin"])
    return q, k.repeat_interleave(c["rep"], dim=2)


def _qk_fused(c: Dict[str, Any], tier: str) -> tuple:
    tables = (c["cos"], c["sin"]) if c["rotate"] else (None, None)
    q, k, _ = qknr.qk_norm_rope(c["q"], c["k"], *tables, q_weight=c["wq"], k_weight=c["wk"], eps_q=1e-5, eps_k=1e-5,
                                rounding="zero_centered", k_repeat=c["rep"], tier=tier)
    return q, k


@settings(**HYP)
@given(qk_cases())
def test_qk_torch_tier_is_diffusers(c: Dict[str, Any]) -> None:
    for g, r in zip(_qk_fused(c, "torch"), _qk_reference(c)):
        assert torch.equal(g, r)


@needs_triton
@settings(**HYP)
@given(qk_cases())
def test_qk_kernel_within_an_ulp(c: Dict[str, Any]) -> None:
    for g, r in zip(_qk_fused(c, "triton"), _qk_reference(c)):
        assert g.shape == r.shape and g.is_contiguous()
        within_ulp(g, r, 2 if g.dtype == torch.float32 else 1)


def test_qk_refusals() -> None:
    q, k, w = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 2, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="k_repeat"):
        qknr.qk_norm_rope(q, k, q_weight=w, k_weight=w, eps_q=1e-5, eps_k=1e-5, k_repeat=3)
    with pytest.raises(ValueError, match="k shape"):
        qknr.qk_norm_rope(q, k, q_weight=w, k_weight=w, eps_q=1e-5, eps_k=1e-5)
    with pytest.raises(ValueError, match="q_weight"):  # other weight dtypes: zero_centered only
        qknr.qk_norm_rope(q, k, q_weight=w.double(), k_weight=w.double(), eps_q=1e-5, eps_k=1e-5, k_repeat=2)
    with pytest.raises(ValueError, match="text"):
        qknr.qk_norm_rope(q, k, q_weight=w, k_weight=w, eps_q=1e-5, eps_k=1e-5, k_repeat=2, v=q, q_txt=q, k_txt=q,
                          v_txt=q, q_txt_weight=w, k_txt_weight=w, eps_q_txt=1e-5, eps_k_txt=1e-5)


@st.composite
def glu_cases(draw: Any) -> Dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.sampled_from([1, 7, 64, 1030])))
    gate = (torch.randn(*shape, generator=g) * draw(st.sampled_from([1.0, 8.0]))).to(dtype)
    h = torch.randn(*shape, generator=g).to(dtype)
    return dict(gate=gate, h=strided(h) if draw(st.booleans()) else h)


@settings(**HYP)
@given(glu_cases())
def test_sigmoid_gate_torch_tier_is_diffusers(c: Dict[str, Any]) -> None:
    """Krea2AttnProcessor's ``hidden_states * torch.sigmoid(gate)``, bit for bit."""
    ref = c["h"] * torch.sigmoid(c["gate"])
    assert torch.equal(swiglu.swiglu(c["gate"], c["h"], activation="sigmoid", tier="torch"), ref)


@needs_triton
@settings(**HYP)
@given(glu_cases())
def test_sigmoid_gate_kernel_within_an_ulp(c: Dict[str, Any]) -> None:
    """One ulp (Triton's ``exp``); fp32 a few under the interpreter's numpy ``exp``."""
    ref = c["h"] * torch.sigmoid(c["gate"])
    got = swiglu.swiglu(c["gate"], c["h"], activation="sigmoid", tier="triton")
    within_ulp(got, ref, 4 if got.dtype == torch.float32 else 1)


def test_sigmoid_needs_up() -> None:
    with pytest.raises(ValueError, match="activation"):
        swiglu.swiglu(torch.ones(2, 4), activation="sigmoid")
    with pytest.raises(ValueError, match="activation"):
        swiglu.swiglu(torch.ones(2, 4), torch.ones(2, 4), activation="gelu")
