"""The RoPE op under hostile input: aliasing q/k, tensors that cannot be written, autograd,
and out-of-range positions under torch.compile. Nothing may be half-applied, and no gradient may be
wrong (the op is either differentiable or refuses with a clear error).

The Triton tier runs on CPU through Triton's interpreter (tier="triton" forces it); shapes are tiny.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
import torch

from torchpatches.ops import _rope_tiers, _rope as rope

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

REPO = Path(__file__).resolve().parents[2]
TIERS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"))]
B, S, H, D = 1, 4, 3, 8


@pytest.fixture(autouse=True)
def _clean_rope_state():
    _rope_tiers.reset_caches()
    yield
    _rope_tiers.reset_caches()


def _tables(s: int = S, r: int = D) -> "tuple[torch.Tensor, torch.Tensor]":
    g = torch.Generator().manual_seed(1)
    angles = torch.rand(s, r // 2, generator=g) * 6.0
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


def _qk(h_q: int = H, h_k: int = H, requires_grad: bool = False) -> "tuple[torch.Tensor, torch.Tensor]":
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, h_q, D, generator=g).requires_grad_(requires_grad)
    k = torch.randn(B, S, h_k, D, generator=g).requires_grad_(requires_grad)
    return q, k


# ---- aliasing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_k_a_view_overlapping_q_is_refused_in_place(tier: str) -> None:
    base = torch.randn(B, S, 4, D)
    q, k = base[:, :, 0:2], base[:, :, 1:3]  # head 1 is in both
    cos, sin = _tables()
    before = base.clone()
    with pytest.raises(ValueError, match="overlap"):
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier=tier)
    assert torch.equal(base, before)


@pytest.mark.parametrize("tier", TIERS)
def test_disjoint_views_of_one_buffer_are_fine_in_place(tier: str) -> None:
    """A fused QKV projection split into views: same storage, no overlap, must work."""
    qkv = torch.randn(B, S, 3, H, D)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    cos, sin = _tables()
    want_q, want_k = rope.apply_rope_qk(q, k, cos, sin, tier="torch")
    v_before = qkv[:, :, 2].clone()
    rope.apply_rope_qk_inplace(q, k, cos, sin, tier=tier)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(qkv[:, :, 2], v_before)


@pytest.mark.parametrize("tier", TIERS)
def test_overlapping_q_and_k_are_fine_out_of_place(tier: str) -> None:
    base = torch.randn(B, S, 4, D)
    q, k = base[:, :, 0:2], base[:, :, 1:3]
    cos, sin = _tables()
    before = base.clone()
    got_q, got_k = rope.apply_rope_qk(q, k, cos, sin, tier=tier)
    want_q, want_k = rope.apply_rope_qk(q.clone(), k.clone(), cos, sin, tier="torch")
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    assert torch.equal(base, before)


@pytest.mark.parametrize("tier", TIERS)
def test_q_with_internal_overlap_is_refused_in_place(tier: str) -> None:
    storage = torch.randn(64)
    q = storage.as_strided((B, S, H, D), (0 + 64, 8, 4, 1))  # heads overlap each other (stride 4 < D)
    k = torch.randn(B, S, H, D)
    cos, sin = _tables()
    before, k_before = storage.clone(), k.clone()
    with pytest.raises(ValueError, match="overlap"):
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier=tier)
    assert torch.equal(storage, before) and torch.equal(k, k_before)


@pytest.mark.parametrize("tier", TIERS)
def test_cos_sin_inside_q_are_refused_in_place(tier: str) -> None:
    """Writing q would change the table the rest of q is still rotated with."""
    q, k = _qk()
    cos = q.reshape(-1)[: S * D].view(S, D)  # a view of q's own memory
    sin = torch.zeros(S, D)
    before = q.clone()
    with pytest.raises(ValueError, match="overlap"):
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier=tier)
    assert torch.equal(q, before)


# ---- nothing half-applied --------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_k_a_leaf_requiring_grad_is_refused_before_q_is_written(tier: str) -> None:
    q, _ = _qk()
    k = torch.randn(B, S, H, D, requires_grad=True)
    cos, sin = _tables()
    before = q.clone()
    with pytest.raises(ValueError, match="k"):
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier=tier)
    assert torch.equal(q, before)


@pytest.mark.parametrize("tier", TIERS)
def test_k_an_inference_tensor_outside_inference_mode_is_refused_before_q_is_written(tier: str) -> None:
    q, _ = _qk()
    with torch.inference_mode():
        k = torch.randn(B, S, H, D)
    cos, sin = _tables()
    before = q.clone()
    with pytest.raises(ValueError, match="inference"):
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier=tier)
    assert torch.equal(q, before)


@pytest.mark.parametrize("tier", TIERS)
def test_inference_tensors_inside_inference_mode_are_fine(tier: str) -> None:
    cos, sin = _tables()
    with torch.inference_mode():
        q, k = _qk()
        want_q, want_k = rope.apply_rope_qk(q, k, cos, sin, tier="torch")
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier=tier)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)


# ---- autograd: differentiable or refused, never wrong ------------------------------------------


def _reference_grads(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     weight_q: torch.Tensor, weight_k: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """Gradients through diffusers' own formula (plain autograd), in float64."""
    q64 = q.detach().double().requires_grad_(True)
    k64 = k.detach().double().requires_grad_(True)

    def rot(x: torch.Tensor) -> torch.Tensor:
        a, b = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        return torch.stack([-b, a], dim=-1).flatten(-2)

    c, s = cos.double()[None, :, None], sin.double()[None, :, None]
    out_q, out_k = q64 * c + rot(q64) * s, k64 * c + rot(k64) * s
    ((out_q * weight_q.double()).sum() + (out_k * weight_k.double()).sum()).backward()
    return q64.grad, k64.grad


@pytest.mark.parametrize("tier", [None, *TIERS])
def test_out_of_place_gradients_are_right_or_refused(tier: Optional[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # automatic selection would pick Triton on CPU
    q, k = _qk(requires_grad=True)
    cos, sin = _tables()
    weight_q, weight_k = torch.randn_like(q), torch.randn_like(k)
    try:
        out_q, out_k = rope.apply_rope_qk(q, k, cos, sin, tier=tier)
    except ValueError as refusal:
        assert tier not in (None, "torch"), "the automatic and torch tiers must be differentiable"
        assert "grad" in str(refusal)
        return
    assert out_q.requires_grad and out_k.requires_grad, "outputs are detached: gradients would be lost"
    ((out_q * weight_q).sum() + (out_k * weight_k).sum()).backward()
    want_q, want_k = _reference_grads(q, k, cos, sin, weight_q, weight_k)
    torch.testing.assert_close(q.grad.double(), want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k.grad.double(), want_k, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tier", [None, *TIERS])
def test_in_place_gradients_are_right_or_refused(tier: Optional[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    leaf_q, leaf_k = _qk(requires_grad=True)
    q, k = leaf_q * 1.0, leaf_k * 1.0  # non-leaf tensors that require grad: in place is allowed by autograd
    cos, sin = _tables()
    weight_q, weight_k = torch.randn_like(q), torch.randn_like(k)
    before_q, before_k = q.detach().clone(), k.detach().clone()
    try:
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier=tier)
    except ValueError as refusal:
        assert tier not in (None, "torch"), "the automatic and torch tiers must be differentiable"
        assert "grad" in str(refusal)
        assert torch.equal(q.detach(), before_q) and torch.equal(k.detach(), before_k)
        return
    ((q * weight_q).sum() + (k * weight_k).sum()).backward()
    want_q, want_k = _reference_grads(leaf_q, leaf_k, cos, sin, weight_q, weight_k)
    torch.testing.assert_close(leaf_q.grad.double(), want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf_k.grad.double(), want_k, rtol=1e-5, atol=1e-6)


def test_no_grad_mode_needs_no_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors that require grad inside torch.no_grad() are plain data: every tier takes them."""
    q, k = _qk(requires_grad=True)
    cos, sin = _tables()
    with torch.no_grad():
        want = rope.apply_rope_qk(q, k, cos, sin, tier="torch")
        if HAS_TRITON:
            got = rope.apply_rope_qk(q, k, cos, sin, tier="triton")
            torch.testing.assert_close(got[0], want[0])


# ---- out-of-range positions under torch.compile -----------------------------------------------


_OOR_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from torchpatches import ops
    tier = sys.argv[1]
    rows, r = 6, 8
    cache = torch.randn(rows, r)
    q = torch.randn(4, 2, r)
    k = torch.randn(4, 1, r)
    positions = torch.tensor([0, rows, -1, 2])   # two rows out of range

    def f(q, k, positions):
        return ops.apply_rope_qk_with_cache(q, k, cache, positions, interleaved=False, tier=tier)

    out_q, out_k = torch.compile(f, fullgraph=True)(q, k, positions)
    good = torch.tensor([0, 3])
    want_q, want_k = ops.apply_rope_qk_with_cache(q[good], k[good], cache, positions[good],
                                                   interleaved=False, tier="torch")
    print(json.dumps({
        "bad_rows_nan": bool(out_q[1:3].isnan().all() and out_k[1:3].isnan().all()),
        "good_rows_right": bool(torch.allclose(out_q[good], want_q) and torch.allclose(out_k[good], want_k)),
    }))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
def test_out_of_range_positions_under_compile_give_nan_rows(tier: str) -> None:
    """Stated behaviour: under torch.compile (no data-dependent check is possible without a graph
    break or a sync) an out-of-range or negative position gives NaN in that token's rotated
    elements; the memory outside the cache is never read. In a child: before, the interpreter could
    crash the process."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TRITON_INTERPRET="1", TORCHPATCHES_DISABLE="all")
    result = subprocess.run([sys.executable, "-c", _OOR_CHILD, tier], capture_output=True, text=True, env=env,
                            timeout=500)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert result.stdout.strip().splitlines()[-1] == '{"bad_rows_nan": true, "good_rows_right": true}'


def test_out_of_range_positions_in_eager_cpu_raise() -> None:
    q, k = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    cache = torch.randn(4, 8)
    for bad in ([0, 4], [-1, 0]):
        with pytest.raises(ValueError, match="outside cos_sin_cache rows"):
            rope.apply_rope_qk_with_cache(q, k, cache, torch.tensor(bad), interleaved=True)
