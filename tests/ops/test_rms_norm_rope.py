"""torchpatches.ops.rms_norm_rope: q/k RMSNorm over the full width (across heads) + Wan's RoPE, one launch.

The PyTorch tier runs torch.nn.RMSNorm's function and Wan's own ``apply_rotary_emb`` math, and must equal
diffusers' modules bit for bit. The Triton tier (Triton's interpreter on the CPU, tiny shapes,
hypothesis-drawn layouts: plain tensors and chunks of a fused projection; RoPE or none, with k of another
length then) must match it to one ulp at the magnitude of each rotated pair (fp32 reductions in another
order; a few ulps for fp32 outputs), and float64 math within a few unit roundoffs (two roundings: after the
norm and after the rotation).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, HAS_TRITON, assert_rotated_close, hyp, interleaved_tables, needs_triton
from torchpatches.ops._rms_norm_rope import rms_norm_rope

HYP = hyp(20)


@st.composite
def cases(draw: Any) -> Dict[str, Any]:
    B = draw(st.integers(1, 2))
    S = draw(st.integers(1, 4))
    H = draw(st.integers(1, 5))
    D = draw(st.sampled_from([2, 6, 8, 16]))
    rope = draw(st.booleans())
    Sk = S if rope else draw(st.sampled_from([1, 3, 7]))
    dtype = draw(st.sampled_from(DTYPES))
    fused_layout = draw(st.booleans())  # q, k as chunks of one projection row (attn.fuse_projections())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    W = H * D

    def rows(s: int) -> torch.Tensor:
        if fused_layout:
            return (torch.randn(B, s, 3 * W + 5, generator=g) * 3).to(dtype)[..., W: 2 * W]
        return (torch.randn(B, s, W, generator=g) * 3).to(dtype)

    cos, sin = interleaved_tables(torch.rand(S, D // 2, generator=g, dtype=torch.float64) * 50)
    return dict(q=rows(S), k=rows(Sk), dtype=dtype, D=D,
                weights=[(torch.rand(W, generator=g) + 0.5).to(dtype) for _ in range(2)],
                cos=cos.float() if rope else None, sin=sin.float() if rope else None)


def call(case: Dict[str, Any], tier: str):
    wq, wk = case["weights"]
    return rms_norm_rope(case["q"], case["k"], q_weight=wq, k_weight=wk, eps_q=1e-6, eps_k=1e-5,
                         cos=case["cos"], sin=case["sin"], tier=tier)


def reference64(case: Dict[str, Any]):
    def rms(x, w, eps):
        x = x.double()
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()

    def rot(x):
        if case["cos"] is None:
            return x
        heads = x.unflatten(-1, (-1, case["D"]))
        a, b = heads.unflatten(-1, (-1, 2)).unbind(-1)
        c = case["cos"].double()[None, :, None, 0::2]
        s = case["sin"].double()[None, :, None, 1::2]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-3)

    wq, wk = case["weights"]
    return rot(rms(case["q"], wq, 1e-6)), rot(rms(case["k"], wk, 1e-5))


@needs_triton
@settings(**HYP)
@given(cases())
def test_triton_tier_matches_torch_tier_and_float64(case: Dict[str, Any]) -> None:
    got = call(case, "triton")
    ref = call(case, "torch")
    assert_rotated_close(got, ref, reference64(case), case["dtype"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_tier_equals_wans_processor_stretch(dtype: torch.dtype) -> None:
    """RMSNorm modules over the full width + WanAttnProcessor's nested apply_rotary_emb, bit for bit."""
    from torchpatches.patches._joint_attention import _rotate_wan as _apply_rotary_emb  # a copy of diffusers' nested function

    g = torch.Generator().manual_seed(3)
    q, k = ((torch.randn(1, 5, 3 * 8, generator=g) * 2).to(dtype) for _ in range(2))
    norms = [torch.nn.RMSNorm(24, eps=1e-6).to(dtype) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.rand(24, generator=g) + 0.5).to(dtype)
    ang = torch.rand(5, 4, generator=g, dtype=torch.float64) * 10
    cos, sin = (t.repeat_interleave(2, -1).float().reshape(1, 5, 1, 8) for t in (ang.cos(), ang.sin()))
    want_q = _apply_rotary_emb(norms[0](q).unflatten(2, (3, -1)), cos, sin).flatten(2)
    want_k = _apply_rotary_emb(norms[1](k).unflatten(2, (3, -1)), cos, sin).flatten(2)
    oq, ok = rms_norm_rope(q, k, q_weight=norms[0].weight, k_weight=norms[1].weight, eps_q=1e-6, eps_k=1e-6,
                           cos=cos[0, :, 0], sin=sin[0, :, 0], tier="torch")
    assert torch.equal(oq, want_q) and torch.equal(ok, want_k)
    oq, ok = rms_norm_rope(q, k[:, :2], q_weight=norms[0].weight, k_weight=norms[1].weight, eps_q=1e-6,
                           eps_k=1e-6, tier="torch")
    assert torch.equal(oq, norms[0](q)) and torch.equal(ok, norms[1](k[:, :2]))


def test_nested_rope_copy_is_diffusers_code() -> None:
    """The patch's copy of the nested function reads like diffusers 0.42.1's (the processor's fingerprint
    pins the original; this pins the copy to it)."""
    import inspect
    import textwrap

    from diffusers.models.transformers import transformer_wan
    from torchpatches.patches import _joint_attention

    call = transformer_wan.WanAttnProcessor.__call__
    original = inspect.getsource(getattr(call, "__torchpatches_original__", call))  # the patch may be applied
    body = textwrap.dedent(inspect.getsource(_joint_attention._rotate_wan)).splitlines()[2:]
    assert all(line.strip() in original for line in body)


@needs_triton
def test_outputs_are_fully_written_and_zero_sizes() -> None:
    q, k = torch.randn(2, 3, 40), torch.randn(2, 5, 40)
    w = torch.rand(40) + 0.5
    oq, ok = rms_norm_rope(q, k, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, tier="triton")
    assert torch.isfinite(oq).all() and torch.isfinite(ok).all()
    for tier in ("torch", "triton"):
        z = torch.randn(2, 0, 40)
        oq, ok = rms_norm_rope(z, k, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, tier=tier)
        assert oq.shape == z.shape and ok.shape == k.shape


def test_bad_input_raises_before_computing() -> None:
    q = torch.randn(1, 4, 16)
    cos = sin = torch.randn(4, 8)
    w = torch.ones(16)
    kw = dict(q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6)
    with pytest.raises(ValueError, match="fp32"):
        rms_norm_rope(q, q.clone(), cos=cos.double(), sin=sin, **kw)
    with pytest.raises(ValueError, match="S = 3"):
        rms_norm_rope(q, q.clone(), cos=cos[:3], sin=sin[:3], **kw)
    with pytest.raises(ValueError, match="even head dim"):
        rms_norm_rope(q, q.clone(), cos=cos[:, :6], sin=sin[:, :6], **kw)
    with pytest.raises(ValueError, match="q_weight"):
        rms_norm_rope(q, q.clone(), **dict(kw, q_weight=w.half()))
    with pytest.raises(ValueError, match="3-D"):
        rms_norm_rope(q[0], q.clone(), **kw)
    with pytest.raises(ValueError, match="does not match q"):
        rms_norm_rope(q, torch.randn(1, 4, 8), **kw)
    with pytest.raises(ValueError, match="eps_k"):
        rms_norm_rope(q, q.clone(), **dict(kw, eps_k="1e-6"))


def test_gradients_take_the_torch_tier_and_a_kernel_tier_refuses() -> None:
    q = torch.randn(1, 4, 16, requires_grad=True)
    k = torch.randn(1, 4, 16)
    w = torch.rand(16) + 0.5
    ang = torch.rand(4, 4)
    cos, sin = interleaved_tables(ang)
    oq, ok = rms_norm_rope(q, k, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, cos=cos, sin=sin)
    assert oq.grad_fn is not None
    oq.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    if HAS_TRITON:
        with pytest.raises(ValueError, match="requires grad"):
            rms_norm_rope(q, k, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, tier="triton")


def test_compiles_fullgraph_as_a_custom_op() -> None:
    q, k = torch.randn(1, 4, 16), torch.randn(1, 4, 16)
    ang = torch.rand(4, 4)
    cos, sin = interleaved_tables(ang)
    w = torch.rand(16) + 0.5

    def fn(q, k):
        return rms_norm_rope(q, k, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, cos=cos, sin=sin, tier="torch")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, ref in zip(compiled(q, k), fn(q, k)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch._dynamo.reset()
