"""torchpatches.ops.qk_norm_rope, ``rounding="fp32"``: FLUX.3's chain (``Flux3AttnProcessor``).

``norm_q(query.float())`` with a ``torch.nn.RMSNorm`` whose weight is fp32 (``_keep_in_fp32_modules``) or of the
model's dtype, diffusers' fp32 ``apply_rotary_emb`` on the fp32 result, then ``.to(value.dtype)``: one rounding at the
end. The PyTorch tier is that expression (bit for bit); the Triton tier (the interpreter on the CPU) matches it
within one ulp of the output dtype at each rotated pair's magnitude (8 in fp32: another summation order).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import hyp, interleaved_tables, needs_triton, pair_norm, ulps
from test_qk_norm_rope import call_half
from torchpatches.ops._qk_norm_rope import force_tier, prechecked, qk_norm_rope


@st.composite
def cases(draw: Any) -> Dict[str, Any]:
    B, S, St, H = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.sampled_from([0, 0, 2])), \
        draw(st.integers(1, 3))
    D = draw(st.sampled_from([2, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    w_dtype = draw(st.sampled_from([torch.float32, dtype]))
    batched = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    proj = (torch.randn(B, S, 3 * H * D + 3, generator=g) * 3).to(dtype)  # chunks of a fused projection
    img = [t.unflatten(-1, (H, D)) for t in proj[..., : 3 * H * D].chunk(3, dim=-1)]
    txt = [(torch.randn(B, St, H, D, generator=g) * 3).to(dtype) for _ in range(3)] if St else None
    cos, sin = interleaved_tables(torch.rand(S + St, D // 2, generator=g, dtype=torch.float64) * 50)
    if batched:
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    return dict(img=img, txt=txt, dtype=dtype, cos=cos.float(), sin=sin.float(),
                weights=[(torch.rand(D, generator=g) + 0.5).to(w_dtype) for _ in range(4)])


def call(case: Dict[str, Any], tier: str):
    return call_half(dict(case, rounding="fp32", rope="interleaved"), tier)


def diffusers_chain(x: torch.Tensor, norm: torch.nn.RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 Flux3AttnProcessor's stretch for one of q, k (the rope patch off)."""
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(norm(x.float()), (cos, sin), sequence_dim=1).to(x.dtype)


@pytest.mark.parametrize("w_dtype", ["fp32", "model"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_tier_equals_flux3_processor_stretch(dtype: torch.dtype, w_dtype: str) -> None:
    import torchpatches

    g = torch.Generator().manual_seed(5)
    proj = (torch.randn(2, 6, 3 * 2 * 16, generator=g) * 3).to(dtype)
    q, k, v = (t.unflatten(-1, (2, 16)) for t in proj.chunk(3, dim=-1))
    norms = [torch.nn.RMSNorm(16, eps=1e-6).to(torch.float32 if w_dtype == "fp32" else dtype) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.rand(16, generator=g) + 0.5).to(n.weight.dtype)
    cos, sin = (t.float() for t in interleaved_tables(torch.rand(6, 8, generator=g) * 30))
    with torchpatches.disabled("rope"):
        rq, rk = diffusers_chain(q, norms[0], cos, sin), diffusers_chain(k, norms[1], cos, sin)
    oq, ok, ov = qk_norm_rope(q, k, cos, sin, q_weight=norms[0].weight, k_weight=norms[1].weight, eps_q=1e-6,
                              eps_k=1e-6, rounding="fp32", tier="torch")
    assert torch.equal(oq, rq) and torch.equal(ok, rk) and ov is None
    with force_tier("torch"):
        pq, pk, pv = prechecked(q, k, cos, sin, norms[0].weight, norms[1].weight, (1e-6,) * 4, v=None,
                                rounding="fp32")
    assert torch.equal(pq, rq) and torch.equal(pk, rk) and pv is None


@needs_triton
@settings(**hyp(20))
@given(cases())
def test_triton_tier_matches_torch_tier(case: Dict[str, Any]) -> None:
    """One rounding (after RoPE): one ulp of the output against the PyTorch tier (8 in fp32) at each rotated pair's
    magnitude."""
    got, ref = call(case, "triton"), call(case, "torch")
    dtype = case["dtype"]
    limit = 8.0 if dtype == torch.float32 else 1.0
    for g, r in zip(got[:2], ref[:2]):
        assert g.dtype == dtype and g.is_contiguous() and g.shape == r.shape
        assert ulps(g, r, pair_norm(r)) <= limit
    if case["txt"] is not None:
        assert torch.equal(got[2], ref[2])
    else:
        assert got[2] is None and ref[2] is None


def test_fp32_rounding_checks() -> None:
    q = torch.randn(1, 2, 1, 4, dtype=torch.bfloat16)
    w32 = torch.ones(4)
    cos = sin = torch.ones(2, 4)
    with pytest.raises(ValueError, match="q_weight"):  # other modes: weights of q's dtype
        qk_norm_rope(q, q.clone(), cos, sin, q_weight=w32, k_weight=w32, eps_q=1e-6, eps_k=1e-6, tier="torch")
    with pytest.raises(ValueError, match="interleaved"):
        qk_norm_rope(q, q.clone(), cos.bfloat16(), sin.bfloat16(), q_weight=w32, k_weight=w32, eps_q=1e-6,
                     eps_k=1e-6, rounding="fp32", rope="half_each", tier="torch")
    with pytest.raises(ValueError, match="q_weight"):  # not a float weight
        qk_norm_rope(q, q.clone(), cos, sin, q_weight=torch.ones(4, dtype=torch.int32), k_weight=w32, eps_q=1e-6,
                     eps_k=1e-6, rounding="fp32", tier="torch")
