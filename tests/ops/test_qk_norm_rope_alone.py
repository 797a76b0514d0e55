"""torchpatches.ops.qk_norm_rope's ``prechecked(q, None, ...)`` form: q alone, normalized and rotated by its own
tables (Kandinsky 6's cross-attentions, where q and k differ in length and table: one launch each).

Each tier must give exactly what it gives for q in the public op's two-tensor call (any q layout, with or without
RoPE, both roundings): the form adds no numerics of its own, only the launch without k.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import hyp, interleaved_tables, needs_triton
from torchpatches.ops._qk_norm_rope import force_tier, prechecked, qk_norm_rope


@st.composite
def alone(draw: Any) -> dict:
    B, S, H = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([2, 6, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    layout = draw(st.sampled_from(["plain", "chunk", "transposed"]))
    if layout == "chunk":  # a slice of a wider projection row
        q = (torch.randn(B, S, 2 * H * D + 3, generator=g) * 3).to(dtype)[..., : H * D].unflatten(-1, (H, D))
    else:
        q = (torch.randn(B, S, H, D, generator=g) * 3).to(dtype)
        if layout == "transposed":
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
    cos, sin = interleaved_tables(torch.rand(S, D // 2, generator=g, dtype=torch.float64) * 50)
    return dict(q=q, w=(torch.rand(D, generator=g) + 0.5).to(dtype), rope=draw(st.booleans()),
                rounding=draw(st.sampled_from(["once", "each"])), cos=cos.float(), sin=sin.float())


@needs_triton
@settings(**hyp(12))
@given(alone(), st.sampled_from(["torch", "triton"]))
def test_q_alone_is_the_public_ops_q(case: dict, tier: str) -> None:
    q, w = case["q"], case["w"]
    cos, sin = (case["cos"], case["sin"]) if case["rope"] else (None, None)
    with force_tier(tier):
        got_q, got_k, got_v = prechecked(q, None, cos, sin, w, None, (1e-6,) * 4, rounding=case["rounding"])
        want = qk_norm_rope(q, q, cos, sin, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, rounding=case["rounding"])
    assert got_k is None and got_v is None
    assert torch.equal(got_q, want[0]) and got_q.is_contiguous()


def test_q_alone_torch_tier_is_torchs_rms_norm_and_rotation() -> None:
    """The reference tier for q alone: ``F.rms_norm`` then the interleaved rotation, as for q beside k."""
    from torchpatches.ops._qk_norm_rope import _rope_torch

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 2, 8, generator=g).to(torch.bfloat16)
    w = (torch.rand(8, generator=g) + 0.5).to(torch.bfloat16)
    cos, sin = (t.float() for t in interleaved_tables(torch.rand(4, 4, generator=g, dtype=torch.float64) * 9))
    with force_tier("torch"):
        got = prechecked(q, None, cos, sin, w, None, (1e-5,) * 4)[0]
    assert torch.equal(got, _rope_torch(torch.nn.functional.rms_norm(q, (8,), w, 1e-5), cos, sin))


@pytest.mark.parametrize("tier", ["torch", pytest.param("triton", marks=needs_triton)])
def test_q_alone_of_no_rows(tier: str) -> None:
    q = torch.zeros(1, 0, 2, 8)
    with force_tier(tier):
        assert prechecked(q, None, None, None, torch.ones(8), None, (1e-6,) * 4)[0].shape == (1, 0, 2, 8)
