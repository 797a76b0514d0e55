"""torchpatches.ops.qk_norm_rope: per-head RMSNorm + interleaved RoPE (+ text/image concat) in one op.

The PyTorch tier runs torch.nn.RMSNorm's function, torch.cat and diffusers' apply_rotary_emb math, and
must equal diffusers' own modules bit for bit. The Triton tier (Triton's interpreter on the CPU, tiny
shapes, hypothesis-drawn layouts: plain tensors and chunks of a fused projection) must match it to one
ulp at the magnitude of each rotated pair (fp32 reductions in another order), and float64 math within
a few unit roundoffs (two roundings: after the norm and after the rotation).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import (UNIT, assert_rotated_close, hyp, interleaved_tables, needs_triton, pair_norm, strided,
                          ulps)
from torchpatches.ops._qk_norm_rope import force_tier, qk_norm_rope

HYP = hyp(20)


@st.composite
def cases(draw: Any) -> Dict[str, Any]:
    B = draw(st.integers(1, 2))
    S = draw(st.integers(1, 4))
    St = draw(st.sampled_from([0, 0, 1, 3]))
    H = draw(st.integers(1, 3))
    D = draw(st.sampled_from([2, 6, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    fused_layout = draw(st.booleans())  # q, k, v as chunks of one projection row (FLUX.2 single block)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def qkv(s: int):
        if fused_layout:
            proj = (torch.randn(B, s, 3 * H * D + 5, generator=g) * 3).to(dtype)
            return [t.unflatten(-1, (H, D)) for t in proj[..., : 3 * H * D].chunk(3, dim=-1)]
        return [(torch.randn(B, s, H, D, generator=g) * 3).to(dtype) for _ in range(3)]

    cos, sin = interleaved_tables(torch.rand(S + St, D // 2, generator=g, dtype=torch.float64) * 50)
    return dict(img=qkv(S), txt=qkv(St) if St else None, dtype=dtype,
                weights=[(torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(4)],
                cos=cos.float(), sin=sin.float())


def call(case: Dict[str, Any], tier: str):
    """The op on a case; SD3's options (``sd3_cases``) where the case has them."""
    (q, k, v), w = case["img"], case["weights"]
    extra: Dict[str, Any] = {key: case[key] for key in ("text_first", "rounding") if key in case}
    if case["txt"] is not None:
        qt, kt, vt = case["txt"]
        extra.update(v=v, q_txt=qt, k_txt=kt, v_txt=vt, q_txt_weight=w[2], k_txt_weight=w[3],
                     eps_q_txt=1e-6, eps_k_txt=1e-5)
    cos, sin = (case["cos"], case["sin"]) if case.get("rope", True) else (None, None)
    return qk_norm_rope(q, k, cos, sin, q_weight=w[0], k_weight=w[1], eps_q=1e-6, eps_k=1e-5, tier=tier, **extra)


def reference64(case: Dict[str, Any]):
    def rms(x, w, eps):
        x = x.double()
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()

    def rot(x):
        if not case.get("rope", True):
            return x
        a, b = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        r = torch.stack([-b, a], dim=-1).flatten(-2)
        # [S, D] tables broadcast as [S, 1, D], per-sample [B, S, D] ones as [B, S, 1, D]
        return x * case["cos"].double().unsqueeze(-2) + r * case["sin"].double().unsqueeze(-2)

    def join(t, i):
        return torch.cat([t, i], 1) if case.get("text_first", True) else torch.cat([i, t], 1)

    (q, k, v), w = case["img"], case["weights"]
    q, k = rms(q, w[0], 1e-6), rms(k, w[1], 1e-5)
    if case["txt"] is not None:
        qt, kt, vt = case["txt"]
        q, k, v = join(rms(qt, w[2], 1e-6), q), join(rms(kt, w[3], 1e-5), k), join(vt, v)
    return rot(q), rot(k), v


@needs_triton
@settings(**HYP)
@given(cases())
def test_triton_tier_matches_torch_tier_and_float64(case: Dict[str, Any]) -> None:
    got = call(case, "triton")
    ref = call(case, "torch")
    exact = reference64(case)
    assert_rotated_close(got[:2], ref[:2], exact[:2], case["dtype"])
    if case["txt"] is not None:
        assert torch.equal(got[2], ref[2]) and torch.equal(got[2], exact[2].to(got[2].dtype))  # the v concat
    else:
        assert got[2] is None and ref[2] is None  # no v given, nothing to concat


@needs_triton
@settings(**hyp(10))
@given(cases(), st.sampled_from(["triton", "torch"]), st.booleans())
def test_prechecked_is_the_public_op(case: Dict[str, Any], tier: str, transposed_k: bool) -> None:
    """The pattern's entry without the checks gives the public op's result bit for bit in each tier, with q, k,
    v of different strides (one set per group is made, as the public op makes it) and a head dim that is not
    unit-stride."""
    from torchpatches.ops._qk_norm_rope import prechecked

    (q, k, v), w = case["img"], case["weights"]
    if transposed_k:
        k = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    extra: Dict[str, Any] = {}
    if case["txt"] is not None:
        qt, kt, vt = case["txt"]
        extra = dict(v=v, q_txt=qt, k_txt=kt, v_txt=vt, q_txt_weight=w[2], k_txt_weight=w[3])
    eps = (1e-6, 1e-5, 1e-6, 1e-5)  # q, k, q_txt, k_txt (the text ones unused without text)
    with force_tier(tier):
        got = prechecked(q, k, case["cos"], case["sin"], w[0], w[1], eps, **extra)
        want = qk_norm_rope(q, k, case["cos"], case["sin"], q_weight=w[0], k_weight=w[1], eps_q=1e-6, eps_k=1e-5,
                            **(dict(extra, eps_q_txt=1e-6, eps_k_txt=1e-5) if extra else {}))
    for g, h in zip(got, want):
        assert (g is None and h is None) or torch.equal(g, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_tier_equals_diffusers_modules(dtype: torch.dtype) -> None:
    """RMSNorm modules + torch.cat + diffusers' apply_rotary_emb (the rope patch off), bit for bit."""
    import torchpatches
    from diffusers.models import embeddings

    g = torch.Generator().manual_seed(3)
    q, k, v, qt, kt, vt = ((torch.randn(1, n, 2, 8, generator=g) * 2).to(dtype) for n in (5, 5, 5, 3, 3, 3))
    norms = [torch.nn.RMSNorm(8, eps=1e-6).to(dtype) for _ in range(4)]
    for n in norms:
        n.weight.data = (torch.rand(8, generator=g) + 0.5).to(dtype)
    ang = torch.rand(8, 4, generator=g) * 10
    cos, sin = interleaved_tables(ang)
    with torchpatches.disabled("rope"):
        rq = embeddings.apply_rotary_emb(torch.cat([norms[2](qt), norms[0](q)], 1), (cos, sin), sequence_dim=1)
        rk = embeddings.apply_rotary_emb(torch.cat([norms[3](kt), norms[1](k)], 1), (cos, sin), sequence_dim=1)
    oq, ok, ov = qk_norm_rope(q, k, cos, sin, q_weight=norms[0].weight, k_weight=norms[1].weight, eps_q=1e-6,
                              eps_k=1e-6, v=v, q_txt=qt, k_txt=kt, v_txt=vt, q_txt_weight=norms[2].weight,
                              k_txt_weight=norms[3].weight, eps_q_txt=1e-6, eps_k_txt=1e-6, tier="torch")
    assert torch.equal(oq, rq) and torch.equal(ok, rk) and torch.equal(ov, torch.cat([vt, v], 1))


def test_bad_input_raises_before_computing() -> None:
    q = torch.randn(1, 4, 2, 8)
    cos = sin = torch.randn(4, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="fp32"):
        qk_norm_rope(q, q.clone(), cos.double(), sin, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6)
    with pytest.raises(ValueError, match=r"\[S_txt \+ S, D\]"):
        qk_norm_rope(q, q.clone(), cos[:3], sin[:3], q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rope(q, q.clone(), cos, sin, q_weight=w.half(), k_weight=w, eps_q=1e-6, eps_k=1e-6)
    with pytest.raises(ValueError, match="joint attention needs"):
        qk_norm_rope(q, q.clone(), cos, sin, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, q_txt=q)
    with pytest.raises(ValueError, match="even"):
        odd = torch.randn(1, 4, 2, 7)
        qk_norm_rope(odd, odd.clone(), cos[:, :7], sin[:, :7], q_weight=w[:7], k_weight=w[:7], eps_q=1e-6,
                     eps_k=1e-6)


def test_compiles_fullgraph_as_a_custom_op() -> None:
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    ang = torch.rand(4, 4)
    cos, sin = interleaved_tables(ang)
    w = torch.rand(8) + 0.5

    def fn(q, k):
        return qk_norm_rope(q, k, cos, sin, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, tier="torch")[:2]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, ref in zip(compiled(q, k), fn(q, k)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch._dynamo.reset()
    assert F.rms_norm  # the torch tier relies on F.rms_norm (torch >= 2.4)


# ---- SD3's form: no RoPE, image rows first, diffusers' RMSNorm rounding (rounding="each") -------------


@st.composite
def sd3_cases(draw: Any) -> Dict[str, Any]:
    """Like ``cases`` plus the options SD3's processor uses, each drawn (odd head dims without RoPE)."""
    case = draw(cases())
    rope = draw(st.booleans())
    case.update(rope=rope, text_first=draw(st.booleans()), rounding=draw(st.sampled_from(["once", "each"])))
    if not rope and draw(st.booleans()):  # an odd head dim: cut every tensor to D - 1
        cut = lambda t: t[..., :-1] if t.shape[-1] > 2 else t  # noqa: E731
        case["img"] = [cut(t) for t in case["img"]]
        case["txt"] = None if case["txt"] is None else [cut(t) for t in case["txt"]]
        case["weights"] = [cut(w).contiguous() for w in case["weights"]]
    return case


@needs_triton
@settings(**HYP)
@given(sd3_cases())
def test_sd3_options_triton_tier_matches_torch_tier_and_float64(case: Dict[str, Any]) -> None:
    """rounding="each" rounds twice (after the norm, after the weight): two ulps against the PyTorch tier
    where the fp32 statistic differs in its last bit; float64 within a few unit roundoffs of each head's
    largest element (pairs with RoPE)."""
    got = call(case, "triton")
    ref = call(case, "torch")
    exact = reference64(case)
    limit = 8.0 if case["dtype"] == torch.float32 else 2.0
    for g, r, e in zip(got[:2], ref[:2], exact[:2]):
        assert g.shape == r.shape and g.is_contiguous()
        scale = pair_norm(r) if case["rope"] else r.abs().amax(-1, keepdim=True).expand_as(r)
        assert ulps(g, r, scale) <= limit
        e_scale = (pair_norm(e) if case["rope"] else e.abs().amax(-1, keepdim=True)) + 1e-30
        assert float(((g.double() - e).abs() / e_scale).max()) <= 6 * UNIT[case["dtype"]] + 1e-5
    if case["txt"] is not None:
        assert torch.equal(got[2], ref[2]) and torch.equal(got[2], exact[2].to(got[2].dtype))
    else:
        assert got[2] is None and ref[2] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sd3_torch_tier_equals_diffusers_joint_attention_stretch(dtype: torch.dtype) -> None:
    """JointAttnProcessor2_0's stretch: diffusers' RMSNorm modules on [B, H, S, D], cat image first on the
    sequence dim; the op on [B, S, H, D] gives the same tensors transposed, bit for bit."""
    from diffusers.models.normalization import RMSNorm

    g = torch.Generator().manual_seed(4)
    q, k, v = ((torch.randn(2, 5, 3, 8, generator=g) * 2).to(dtype) for _ in range(3))
    qt, kt, vt = ((torch.randn(2, 3, 3, 8, generator=g) * 2).to(dtype) for _ in range(3))
    norms = [RMSNorm(8, eps=1e-6).to(dtype).requires_grad_(False) for _ in range(4)]
    for n in norms:
        n.weight.data = (torch.rand(8, generator=g) + 0.5).to(dtype)
    heads_first = lambda t: t.transpose(1, 2)  # noqa: E731
    want = (torch.cat([norms[0](heads_first(q)), norms[2](heads_first(qt))], dim=2),
            torch.cat([norms[1](heads_first(k)), norms[3](heads_first(kt))], dim=2),
            torch.cat([heads_first(v), heads_first(vt)], dim=2))
    got = qk_norm_rope(q, k, q_weight=norms[0].weight, k_weight=norms[1].weight, eps_q=1e-6, eps_k=1e-6, v=v,
                       q_txt=qt, k_txt=kt, v_txt=vt, q_txt_weight=norms[2].weight, k_txt_weight=norms[3].weight,
                       eps_q_txt=1e-6, eps_k_txt=1e-6, text_first=False, rounding="each", tier="torch")
    for o, r in zip(got, want):
        assert torch.equal(heads_first(o), r)


def test_sd3_options_bad_input_raises() -> None:
    q, w = torch.randn(1, 4, 2, 7), torch.ones(7)
    with pytest.raises(ValueError, match="both be given"):
        qk_norm_rope(q, q.clone(), torch.ones(4, 7), None, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6)
    with pytest.raises(ValueError, match="rounding"):
        qk_norm_rope(q, q.clone(), q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, rounding="twice")
    out = qk_norm_rope(q, q.clone(), q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6)  # odd D: fine without RoPE
    assert out[0].shape == q.shape


def test_sd3_form_compiles_fullgraph_as_a_custom_op() -> None:
    """No RoPE (cos/sin None in the custom op's schema), image first, diffusers' rounding: one traced op."""
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    qt, kt, vt = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    w = torch.rand(8) + 0.5

    def fn(q, k, v, qt, kt, vt):
        return qk_norm_rope(q, k, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, v=v, q_txt=qt, k_txt=kt, v_txt=vt,
                            q_txt_weight=w, k_txt_weight=w, eps_q_txt=1e-6, eps_k_txt=1e-6, text_first=False,
                            rounding="each", tier="torch")

    torch._dynamo.reset()
    args = (q, k, v, qt, kt, vt)
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0
    assert any("torchpatches.qk_norm_rope" in str(n.target) for g in explained.graphs for n in g.graph.nodes)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, ref in zip(compiled(*args), fn(*args)):
        assert torch.equal(got, ref)
    torch._dynamo.reset()


# ---- QwenImage's form: complex RoPE as cos/sin tables, text first, diffusers' RMSNorm (rounding="each") ------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qwenimage_torch_tier_equals_diffusers_modules(dtype: torch.dtype) -> None:
    """diffusers' RMSNorm modules + QwenImage's complex ``apply_rotary_emb_qwen`` + torch.cat, bit for bit,
    with the complex freqs as ``cos = Re``, ``sin = Im`` repeated per pair. Head dim 16: with 4 complex
    values per head (D = 8) torch's CPU complex product takes another loop that differs by an fp32 ulp
    (a fused multiply-add), as CUDA's may."""
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    g = torch.Generator().manual_seed(5)
    q, k, v, qt, kt, vt = ((torch.randn(1, n, 2, 16, generator=g) * 2).to(dtype) for n in (5, 5, 5, 3, 3, 3))
    norms = [RMSNorm(16, eps=1e-6).to(dtype) for _ in range(4)]
    for n in norms:
        n.weight.data = (torch.rand(16, generator=g) + 0.5).to(dtype)
    freqs = torch.polar(torch.ones(8, 8), torch.rand(8, 8, generator=g) * 10)  # [txt rows; image rows]
    with torch.no_grad():
        rq = torch.cat([apply_rotary_emb_qwen(norms[2](qt), freqs[:3], use_real=False),
                        apply_rotary_emb_qwen(norms[0](q), freqs[3:], use_real=False)], 1)
        rk = torch.cat([apply_rotary_emb_qwen(norms[3](kt), freqs[:3], use_real=False),
                        apply_rotary_emb_qwen(norms[1](k), freqs[3:], use_real=False)], 1)
        pairs = torch.view_as_real(freqs)
        cos, sin = pairs[..., 0].repeat_interleave(2, -1), pairs[..., 1].repeat_interleave(2, -1)
        oq, ok, ov = qk_norm_rope(q, k, cos, sin, q_weight=norms[0].weight, k_weight=norms[1].weight, eps_q=1e-6,
                                  eps_k=1e-6, v=v, q_txt=qt, k_txt=kt, v_txt=vt, q_txt_weight=norms[2].weight,
                                  k_txt_weight=norms[3].weight, eps_q_txt=1e-6, eps_k_txt=1e-6, tier="torch",
                                  rounding="each")
    assert torch.equal(oq, rq) and torch.equal(ok, rk) and torch.equal(ov, torch.cat([vt, v], 1))
    if dtype != torch.float32:  # the rounding before the weight matters: torch's fused RMSNorm differs
        fused = qk_norm_rope(q, k, cos[3:], sin[3:], q_weight=norms[0].weight, k_weight=norms[1].weight,
                             eps_q=1e-6, eps_k=1e-6, tier="torch")[0]
        assert not torch.equal(fused, oq[:, 3:])


# ---- per-sample RoPE tables: [B, S_txt + S, D] (a batch of 1 or a batch stride of 0 shares one table) ----------


def batched_case(B: int, S: int, St: int, dtype: torch.dtype, text_first: bool = True, rounding: str = "once",
                 seed: int = 7) -> Dict[str, Any]:
    """A case of ``call``'s form with per-sample tables ``[B, St + S, D]`` (other angles in each sample)."""
    H, D = 2, 8
    g = torch.Generator().manual_seed(seed)
    qkv = lambda s: [(torch.randn(B, s, H, D, generator=g) * 3).to(dtype) for _ in range(3)]  # noqa: E731
    cos, sin = interleaved_tables(torch.rand(B, S + St, D // 2, generator=g, dtype=torch.float64) * 50)
    return dict(img=qkv(S), txt=qkv(St) if St else None, dtype=dtype, text_first=text_first, rounding=rounding,
                weights=[(torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(4)],
                cos=cos.float(), sin=sin.float())


def sample(case: Dict[str, Any], b: int, **tables: torch.Tensor) -> Dict[str, Any]:
    """Sample ``b`` of a case as a batch of one, with its own ``[S, D]`` tables (or ``tables``)."""
    one = lambda ts: None if ts is None else [t[b:b + 1] for t in ts]  # noqa: E731
    return dict(case, img=one(case["img"]), txt=one(case["txt"]),
                **(tables or dict(cos=case["cos"][b], sin=case["sin"][b])))


#: (S_txt, text_first, rounding, dtype): self-only (S_txt 0) and joint, FLUX's text-first and SD3's image-first.
BATCHED = [pytest.param(St, first, rounding, dtype, id=f"{form}-{rounding}-{str(dtype)[6:]}")
           for St, first, form in ((0, True, "self"), (2, True, "text-first"), (2, False, "image-first"))
           for rounding in ("once", "each")
           for dtype in (torch.bfloat16, torch.float32)]


@needs_triton
@pytest.mark.parametrize("St, text_first, rounding, dtype", BATCHED)
def test_per_sample_tables_rotate_each_sample_by_its_own(St: int, text_first: bool, rounding: str,
                                                         dtype: torch.dtype) -> None:
    """[B, S_txt + S, D] tables: each tier gives every sample what the [S, D] form gives it alone, bit for bit;
    the Triton tier is held to the PyTorch tier and float64 math as in the [S, D] tests."""
    case = batched_case(2, 3, St, dtype, text_first, rounding)
    got = {tier: call(case, tier) for tier in ("triton", "torch")}
    for tier, outs in got.items():
        for b in range(2):
            alone = call(sample(case, b), tier)
            for o, a in zip(outs, alone):
                assert (o is None and a is None) or torch.equal(o[b:b + 1], a)
    exact = reference64(case)
    limit = (8.0 if dtype == torch.float32 else 1.0) * (2 if rounding == "each" else 1)
    for g, r, e in zip(got["triton"][:2], got["torch"][:2], exact[:2]):
        assert g.shape == r.shape and g.is_contiguous()
        assert ulps(g, r, pair_norm(r)) <= limit
        assert float(((g.double() - e).abs() / (pair_norm(e) + 1e-30)).max()) <= 6 * UNIT[dtype] + 1e-5


#: Views of one [S, D] table as [B, S, D]: copied rows, an expanded view (batch stride 0), a batch of 1, and
#: padded rows (row stride > D, batch stride not S * D).
SHARED = {
    "rows": lambda t, B: t.repeat(B, 1, 1),
    "expanded": lambda t, B: t.expand(B, *t.shape),
    "batch-of-1": lambda t, B: t[None],
    "padded": lambda t, B: strided(t.repeat(B, 1, 1), pad=5),
}


@needs_triton
@pytest.mark.parametrize("tier", ["triton", "torch"])
@pytest.mark.parametrize("form", list(SHARED))
def test_one_table_as_batched_equals_the_2d_table(form: str, tier: str) -> None:
    """The same table as [S, D] or in any [B, S, D] form: the same outputs bit for bit (joint, bf16)."""
    case = batched_case(2, 3, 2, torch.bfloat16)
    flat = dict(case, cos=case["cos"][1], sin=case["sin"][1])
    batched = dict(case, cos=SHARED[form](flat["cos"], 2), sin=SHARED[form](flat["sin"], 2))
    for o, r in zip(call(batched, tier), call(flat, tier)):
        assert torch.equal(o, r)


@needs_triton
@pytest.mark.parametrize("tier", ["triton", "torch"])
def test_prechecked_takes_per_sample_tables(tier: str) -> None:
    """The patches' entry passes [B, S, D] tables through as the public op does (it checks no shapes)."""
    from torchpatches.ops._qk_norm_rope import prechecked

    case = batched_case(2, 3, 2, torch.bfloat16)
    (q, k, v), (qt, kt, vt), w = case["img"], case["txt"], case["weights"]
    with force_tier(tier):
        got = prechecked(q, k, case["cos"], case["sin"], w[0], w[1], (1e-6, 1e-5, 1e-6, 1e-5), v=v, q_txt=qt,
                         k_txt=kt, v_txt=vt, q_txt_weight=w[2], k_txt_weight=w[3])
    for g, r in zip(got, call(case, tier)):
        assert torch.equal(g, r)


def _bad_tables(B: int, S_all: int, D: int) -> Dict[str, Any]:
    """(cos, sin, the message) for q [B, S, H, D] with S_txt + S = S_all: shapes the op refuses."""
    t = torch.rand
    return {
        "other-batch": (t(B + 1, S_all, D), t(B + 1, S_all, D), r"cos must be .* got \(3, 5, 8\)"),
        "other-rows": (t(B, S_all + 1, D), t(B, S_all + 1, D), r"cos must be .* got \(2, 6, 8\)"),
        "other-head-dim": (t(B, S_all, D + 2), t(B, S_all, D + 2), r"cos must be .* got \(2, 5, 10\)"),
        "4-D": (t(1, B, S_all, D), t(1, B, S_all, D), r"cos must be .* got \(1, 2, 5, 8\)"),
        "1-D": (t(D), t(D), r"cos must be .* got \(8,\)"),
        "sin-only": (t(B, S_all, D), t(B + 1, S_all, D), r"sin must be .* got \(3, 5, 8\)"),
        "3-D-cos-2-D-sin": (t(B, S_all, D), t(S_all, D), r"same shape"),
        "batch-B-and-1": (t(B, S_all, D), t(1, S_all, D), r"same shape"),
        "strided-last-dim": (t(B, S_all, 2 * D)[..., ::2], t(B, S_all, D),
                             r"cos must be .*unit-stride last dim, got \(2, 5, 8\) with strides \(80, 16, 2\)"),
        "fp64": (t(B, S_all, D).double(), t(B, S_all, D), r"cos must be an fp32 tensor"),
    }


@pytest.mark.parametrize("bad", list(_bad_tables(2, 5, 8)))
def test_bad_tables_raise_naming_the_shapes(bad: str) -> None:
    """q [2, 3, 2, 8] with 2 text rows: tables [5, 8] or [2 (or 1), 5, 8] only, cos and sin of one shape; the
    message names the table and both accepted shapes."""
    case = batched_case(2, 3, 2, torch.float32)
    cos, sin, message = _bad_tables(2, 5, 8)[bad]
    with pytest.raises(ValueError, match=message) as raised:
        call(dict(case, cos=cos, sin=sin), "torch")
    if "must be [" in str(raised.value):
        assert "[S_txt + S, D] = [5, 8] or [B, S_txt + S, D] = [2, 5, 8]" in str(raised.value)


def test_compiles_fullgraph_with_per_sample_tables() -> None:
    """[B, S, D] tables go through the custom op and its fake (the outputs' shapes are q's)."""
    case = batched_case(2, 3, 0, torch.float32)
    (q, k, _), w, cos, sin = case["img"], case["weights"], case["cos"], case["sin"]

    def fn(q, k, cos, sin):
        return qk_norm_rope(q, k, cos, sin, q_weight=w[0], k_weight=w[1], eps_q=1e-6, eps_k=1e-6, tier="torch")[:2]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, ref in zip(compiled(q, k, cos, sin), fn(q, k, cos, sin)):
        assert torch.equal(got, ref)
    torch._dynamo.reset()


# ---- Ideogram 4's form: rope="half_each" (half-split pairs, tables and every op in q's dtype, each rounded) ------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``transformer_ideogram4._rotate_half``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ideogram_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``Ideogram4AttnProcessor``'s rotation of ``x`` ``[B, L, H, D]`` by ``[B, L, D]`` (or ``[L, D]``) tables of
    x's dtype: ``cos.unsqueeze(2)`` there, ``unsqueeze(-2)`` here (the same for 3-D tables, and a broadcast over
    the batch for 2-D ones)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x * cos) + (rotate_half(x) * sin)


def diffusers_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, rounding: str) -> torch.Tensor:
    """``normalization.RMSNorm`` (``"each"``: ``round(round(x * rstd) * w)``) or torch.nn.RMSNorm (``"once"``)."""
    if rounding == "once":
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    n = x * torch.rsqrt(variance + eps)
    return (n.to(w.dtype) if w.dtype in (torch.float16, torch.bfloat16) else n) * w


def ideogram_case(dtype: torch.dtype, tables: str, H: int, D: int, St: int = 0, rounding: str = "each",
                  seed: int = 11) -> Dict[str, Any]:
    """A case of ``call``'s form with ``rope="half_each"``: tables of the dtype, ``[S_txt + S, D]`` (``"2d"``) or
    per-sample ``[B, S_txt + S, D]`` (``"3d"``), angles up to 50 rad."""
    B, S = 2, 3
    g = torch.Generator().manual_seed(seed)
    qkv = lambda s: [(torch.randn(B, s, H, D, generator=g) * 3).to(dtype) for _ in range(3)]  # noqa: E731
    shape = (S + St, D) if tables == "2d" else (B, S + St, D)
    angles = torch.rand(*shape, generator=g, dtype=torch.float64) * 50
    return dict(img=qkv(S), txt=qkv(St) if St else None, dtype=dtype, rounding=rounding, rope="half_each",
                weights=[(torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(4)],
                cos=angles.cos().to(dtype), sin=angles.sin().to(dtype))


def call_half(case: Dict[str, Any], tier: str, **overrides: Any):
    """``call`` with the case's ``rope`` (and ``overrides``: other tables, ``rope``)."""
    case = dict(case, **overrides)
    (q, k, v), w = case["img"], case["weights"]
    extra: Dict[str, Any] = {}
    if case["txt"] is not None:
        qt, kt, vt = case["txt"]
        extra = dict(v=v, q_txt=qt, k_txt=kt, v_txt=vt, q_txt_weight=w[2], k_txt_weight=w[3], eps_q_txt=1e-6,
                     eps_k_txt=1e-5)
    return qk_norm_rope(q, k, case["cos"], case["sin"], q_weight=w[0], k_weight=w[1], eps_q=1e-6, eps_k=1e-5,
                        rounding=case["rounding"], rope=case["rope"], tier=tier, **extra)


def ideogram_reference(case: Dict[str, Any]):
    """diffusers' expressions op for op: the RMSNorm, then Ideogram 4's rotation (text rows first if any)."""
    (q, k, v), w, r = case["img"], case["weights"], case["rounding"]
    q, k = diffusers_rms_norm(q, w[0], 1e-6, r), diffusers_rms_norm(k, w[1], 1e-5, r)
    if case["txt"] is not None:
        qt, kt, vt = case["txt"]
        q = torch.cat([diffusers_rms_norm(qt, w[2], 1e-6, r), q], 1)
        k = torch.cat([diffusers_rms_norm(kt, w[3], 1e-5, r), k], 1)
        v = torch.cat([vt, v], 1)
    return ideogram_rope(q, case["cos"], case["sin"]), ideogram_rope(k, case["cos"], case["sin"]), v


#: (dtype, tables, H, D, S_txt, rounding): Ideogram's own form (self-attention, "each") in each dtype with both
#: table shapes, odd and even head counts, head dims whose half is and is not a power of two; then the option
#: mixes the op allows (joint rows, rounding="once").
HALF_EACH = [pytest.param(dtype, tables, H, D, 0, "each", id=f"{str(dtype)[6:]}-{tables}-H{H}-D{D}")
             for dtype in (torch.bfloat16, torch.float16, torch.float32)
             for tables in ("2d", "3d")
             for H, D in ((3, 12), (2, 8))] + [
    pytest.param(torch.bfloat16, "3d", 3, 8, 2, "each", id="bfloat16-3d-joint"),
    pytest.param(torch.float16, "2d", 1, 6, 0, "once", id="float16-2d-once"),
]


@pytest.mark.parametrize("dtype, tables, H, D, St, rounding", HALF_EACH)
def test_half_each_torch_tier_is_ideograms_expression(dtype: torch.dtype, tables: str, H: int, D: int, St: int,
                                                      rounding: str) -> None:
    """The PyTorch tier is diffusers' RMSNorm + Ideogram4AttnProcessor's rotation, bit for bit."""
    case = ideogram_case(dtype, tables, H, D, St, rounding)
    got, want = call_half(case, "torch"), ideogram_reference(case)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[2] is None) if St == 0 else torch.equal(got[2], want[2])
    if dtype != torch.float32:  # the per-op rounding matters: the fp32 interleaved-style math differs somewhere
        n = diffusers_rms_norm(case["img"][0], case["weights"][0], 1e-6, rounding)
        cos, sin = (t[..., St:, :].float().unsqueeze(-2) for t in (case["cos"], case["sin"]))  # the image rows
        once = (n.float() * cos + rotate_half(n).float() * sin).to(dtype)
        assert not torch.equal(once, want[0][:, St:])


@needs_triton
@pytest.mark.parametrize("dtype, tables, H, D, St, rounding", HALF_EACH)
def test_half_each_triton_tier_rounds_where_torch_does(dtype: torch.dtype, tables: str, H: int, D: int, St: int,
                                                       rounding: str) -> None:
    """The kernel's rotation is Ideogram's expression on its own normed values bit for bit (in fp32 too: no fused
    multiply-add); against the PyTorch tier it differs only where the norm's fp32 statistic does (2 ulps at the
    head's largest value in bf16 / fp16, 8 in fp32, as the SD3 form)."""
    case = ideogram_case(dtype, tables, H, D, St, rounding)
    got, ref = call_half(case, "triton"), call_half(case, "torch")
    normed = call_half(case, "triton", cos=None, sin=None)  # the kernel's own norm, no RoPE
    limit = 8.0 if dtype == torch.float32 else 2.0
    for g, r, n in zip(got[:2], ref[:2], normed[:2]):
        assert g.shape == r.shape and g.dtype == dtype and g.is_contiguous()
        assert torch.equal(g, ideogram_rope(n, case["cos"], case["sin"]))
        assert ulps(g, r, r.abs().amax(-1, keepdim=True)) <= limit
    assert (got[2] is None) if St == 0 else torch.equal(got[2], ref[2])


@needs_triton
@pytest.mark.parametrize("tier", ["triton", "torch"])
def test_half_each_per_sample_tables_rotate_each_sample_by_its_own(tier: str) -> None:
    """[B, S, D] tables of q's dtype: each sample gets what its own [S, D] table gives it alone; an expanded
    [S, D] table equals the 2-D one."""
    case = ideogram_case(torch.bfloat16, "3d", 3, 12)
    outs = call_half(case, tier)
    for b in range(2):
        alone = call_half(sample(case, b), tier)
        for o, a in zip(outs[:2], alone[:2]):
            assert torch.equal(o[b:b + 1], a)
    flat = dict(case, cos=case["cos"][1], sin=case["sin"][1])
    expanded = dict(case, cos=flat["cos"].expand(2, *flat["cos"].shape), sin=flat["sin"].expand(2, *flat["sin"].shape))
    for o, r in zip(call_half(expanded, tier)[:2], call_half(flat, tier)[:2]):
        assert torch.equal(o, r)


@needs_triton
@pytest.mark.parametrize("tier", ["triton", "torch"])
def test_half_each_prechecked_is_the_public_op(tier: str) -> None:
    """The patches' entry takes ``rounding`` and ``rope`` as the public op does."""
    from torchpatches.ops._qk_norm_rope import prechecked

    case = ideogram_case(torch.bfloat16, "3d", 3, 12)
    (q, k, _), w = case["img"], case["weights"]
    with force_tier(tier):
        got = prechecked(q, k, case["cos"], case["sin"], w[0], w[1], (1e-6, 1e-5, 1e-6, 1e-5), rounding="each",
                         rope="half_each")
    want = call_half(case, tier)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] is None


def test_interleaved_is_the_default() -> None:
    """``rope="interleaved"`` spelled out is the call without it, bit for bit."""
    case = batched_case(2, 3, 2, torch.bfloat16)
    for o, r in zip(call(dict(case), "torch"), call_half(dict(case, rope="interleaved"), "torch")):
        assert torch.equal(o, r)


def test_half_each_compiles_fullgraph_as_a_custom_op() -> None:
    """``rope`` goes through the custom op's schema (a string, as ``rounding``) and its fake."""
    case = ideogram_case(torch.bfloat16, "3d", 3, 12)
    (q, k, _), w = case["img"], case["weights"]

    def fn(q, k, cos, sin):
        return qk_norm_rope(q, k, cos, sin, q_weight=w[0], k_weight=w[1], eps_q=1e-6, eps_k=1e-5, rounding="each",
                            rope="half_each", tier="torch")[:2]

    torch._dynamo.reset()
    args = (q, k, case["cos"], case["sin"])
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0
    assert any("torchpatches.qk_norm_rope" in str(n.target) for g in explained.graphs for n in g.graph.nodes)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, ref in zip(compiled(*args), fn(*args)):
        assert torch.equal(got, ref)
    torch._dynamo.reset()


def _bad_half(case: Dict[str, Any]) -> Dict[str, Any]:
    """name -> (overrides of ``call_half``, the message): what the op refuses about ``rope``."""
    cos, sin = case["cos"], case["sin"]
    odd = dict(case, img=[t[..., :-1] for t in case["img"]], weights=[w[:-1].contiguous() for w in case["weights"]])
    return {
        "unknown-form": (dict(rope="half"), r"rope must be one of \('interleaved', 'half_each'\), got 'half'"),
        "not-a-string": (dict(rope=None), r"rope must be one of"),
        "fp32-cos": (dict(cos=cos.float()), r"cos must be a tensor of q's dtype torch.bfloat16"),
        "fp16-sin": (dict(sin=sin.half()), r"sin must be a tensor of q's dtype torch.bfloat16"),
        "list-cos": (dict(cos=cos.tolist()), r"cos must be a tensor of q's dtype"),
        "odd-head-dim": (dict(odd, cos=cos[..., :-1], sin=sin[..., :-1]), r"head dim 11 must be even"),
        "other-rows": (dict(cos=cos[:, :-1], sin=sin[:, :-1]), r"cos must be \[S_txt \+ S, D\]"),
        "interleaved-bf16-tables": (dict(rope="interleaved"), r"cos must be an fp32 tensor"),
    }


@pytest.mark.parametrize("bad", list(_bad_half(ideogram_case(torch.bfloat16, "3d", 1, 12))))
def test_half_each_bad_input_raises_naming_it(bad: str) -> None:
    case = ideogram_case(torch.bfloat16, "3d", 1, 12)
    overrides, message = _bad_half(case)[bad]
    with pytest.raises(ValueError, match=message):
        call_half(case, "torch", **overrides)
