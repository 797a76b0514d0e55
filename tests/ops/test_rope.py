"""Tests for torchpatches.ops.rope: every tier against a float64 reference and diffusers.

Tolerances (max |out - ref| <= atol + rtol * |ref|, ref in float64 from the same rounded inputs):
the only error allowed is fp32 arithmetic plus the one final rounding to the output dtype.

- float32: rtol 1e-5, atol 1e-6
- bfloat16: rtol 2**-7 (one bf16 ulp), atol 1e-5
- float16: rtol 2**-10 (one fp16 ulp), atol 1e-5

Against diffusers' own ``apply_rotary_emb`` on CPU the math is the same operations in the same
order, so the PyTorch tier and the Triton tier (CPU interpreter, numpy fp32, no FMA) must match it
bit for bit.

The Triton tier runs on CPU through Triton's interpreter (``TRITON_INTERPRET=1`` for automatic
selection; ``tier="triton"`` forces it); it costs ~50 ms per program, so its cases stay tiny.
"""
from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchpatches
import harness as testing
from torchpatches.ops import _rope_tiers, _rope as rope

try:  # the Triton tier needs triton (the interpreter is part of it)
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (2.0**-7, 1e-5),
    torch.float16: (2.0**-10, 1e-5),
}
DTYPES = list(TOL)
HYP = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _clean_rope_state():
    _rope_tiers.reset_caches()
    yield
    _rope_tiers.reset_caches()


# ------------------------------------------------------------------------------------ helpers


def widen(half_rows, interleaved):
    """Per-pair values -> per-element values (diffusers' layout of cos/sin)."""
    if interleaved:
        return half_rows.repeat_interleave(2, dim=-1)
    return torch.cat([half_rows, half_rows], dim=-1)


def assert_close_to(out, ref, dtype):
    rtol, atol = TOL[dtype]
    assert out.dtype == dtype
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs()
    bound = atol + rtol * ref.abs()
    assert bool((err <= bound).all()), f"max err {err.max().item():.3g} (bound rtol={rtol}, atol={atol})"


def make_qk(layout, B, S, HQ, HK, D, dtype, noncontig, gen):
    """q, k in the given layout; noncontig: views into a fused qkv buffer (or a transpose)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    if layout == "tok":  # [T, H, D], seq_dim 0
        if noncontig:
            qkv = rnd(S, (HQ + 2 * HK) * D)
            return qkv[:, : HQ * D].view(S, HQ, D), qkv[:, HQ * D:(HQ + HK) * D].view(S, HK, D), 0
        return rnd(S, HQ, D), rnd(S, HK, D), 0
    if layout == "bshd":  # [B, S, H, D], seq_dim 1
        if noncontig:  # transposes of contiguous [B, H, S, D]
            return rnd(B, HQ, S, D).transpose(1, 2), rnd(B, HK, S, D).transpose(1, 2), 1
        return rnd(B, S, HQ, D), rnd(B, S, HK, D), 1
    # [B, H, S, D], seq_dim 2
    if noncontig:  # slices of a fused [B, S, (HQ+2HK), D] projection, transposed
        qkv = rnd(B, S, HQ + 2 * HK, D)
        return qkv[:, :, :HQ].transpose(1, 2), qkv[:, :, HQ:HQ + HK].transpose(1, 2), 2
    return rnd(B, HQ, S, D), rnd(B, HK, S, D), 2


def run_case(tier, layout, B, S, HQ, HK, half_d, r_half, dtype, interleaved, form, inplace,
             noncontig, seed):
    gen = torch.Generator().manual_seed(seed)
    D, r = 2 * half_d, 2 * r_half
    q, k, sd = make_qk(layout, B, S, HQ, HK, D, dtype, noncontig, gen)
    if layout == "tok":
        B = 1
    if form == "per_token":
        ang = torch.rand(S, r_half, generator=gen) * 20
        cos, sin = widen(ang.cos(), interleaved), widen(ang.sin(), interleaved)
        rq = testing.rope_reference(q, cos, sin, interleaved=interleaved, seq_dim=sd)
        rk = testing.rope_reference(k, cos, sin, interleaved=interleaved, seq_dim=sd)
        args = (cos, sin)
        fn_in, fn_out = rope.apply_rope_qk_inplace, rope.apply_rope_qk
    else:
        P = S + 3
        ang = torch.rand(P, r_half, generator=gen) * 20
        cache = torch.cat([ang.cos(), ang.sin()], dim=-1)
        pos = torch.randint(0, P, (S,) if (layout == "tok" or seed % 2) else (B, S), generator=gen)
        rows = cache[pos]
        cf, sf = widen(rows[..., :r_half], interleaved), widen(rows[..., r_half:], interleaved)
        rq = testing.rope_reference(q, cf, sf, interleaved=interleaved, seq_dim=sd)
        rk = testing.rope_reference(k, cf, sf, interleaved=interleaved, seq_dim=sd)
        args = (cache, pos)
        fn_in, fn_out = rope.apply_rope_qk_with_cache_inplace, rope.apply_rope_qk_with_cache
    q0, k0 = q.clone(), k.clone()
    if inplace:
        fn_in(q, k, *args, interleaved=interleaved, sequence_dim=sd, tier=tier)
        qo, ko = q, k
    else:
        qo, ko = fn_out(q, k, *args, interleaved=interleaved, sequence_dim=sd, tier=tier)
        assert torch.equal(q, q0) and torch.equal(k, k0), "out-of-place call modified its inputs"
        assert qo.shape == q.shape and ko.shape == k.shape
    assert rope.last_tier() == tier
    assert_close_to(qo, rq, dtype)
    assert_close_to(ko, rk, dtype)
    # the tail beyond rotary_dim passes through bit for bit
    assert torch.equal(qo[..., r:], q0[..., r:]) and torch.equal(ko[..., r:], k0[..., r:])


case = st.fixed_dictionaries(dict(
    layout=st.sampled_from(["tok", "bshd", "bhsd"]),
    dtype=st.sampled_from(DTYPES),
    interleaved=st.booleans(),
    form=st.sampled_from(["per_token", "cache"]),
    inplace=st.booleans(),
    noncontig=st.booleans(),
    seed=st.integers(0, 2**16),
))


# ------------------------------------------------------------------------ numerical agreement


@settings(max_examples=60, **HYP)
@given(c=case, B=st.integers(1, 2), S=st.sampled_from([1, 2, 7, 33]), HQ=st.integers(1, 5),
       HK=st.integers(1, 3), dims=st.integers(1, 128).flatmap(
           lambda h: st.tuples(st.just(h), st.integers(1, h))))
def test_torch_tier_matches_float64_reference(c, B, S, HQ, HK, dims):
    run_case("torch", B=B, S=S, HQ=HQ, HK=HK, half_d=dims[0], r_half=dims[1], **c)


@needs_triton
@settings(max_examples=25, **HYP)
@given(c=case, S=st.sampled_from([1, 3]), HQ=st.integers(1, 4), HK=st.integers(1, 3),
       dims=st.integers(1, 64).flatmap(lambda h: st.tuples(st.just(h), st.integers(1, h))))
def test_triton_tier_interpreted_matches_float64_reference(c, S, HQ, HK, dims):
    run_case("triton", B=1, S=S, HQ=HQ, HK=HK, half_d=dims[0], r_half=dims[1], **c)


@needs_triton
@pytest.mark.parametrize("overrides", [
    dict(BLOCK_H=1, HEAD_PROGS=0),
    dict(BLOCK_H=2, HEAD_PROGS=2),
    dict(BLOCK_H=4, HEAD_PROGS=1),
])
@pytest.mark.parametrize("interleaved", [True, False])
def test_triton_launch_configs_agree(monkeypatch, overrides, interleaved):
    """The GPU launch variants (head blocking, programs per token) compute the same."""
    from torchpatches.ops import _rope_triton

    picked = _rope_triton.pick_config
    monkeypatch.setattr(_rope_triton, "pick_config", lambda *args, **kwargs: {**picked(*args, **kwargs), **overrides})
    for form in ("per_token", "cache"):
        run_case("triton", "bshd", 1, 2, 5, 3, 8, 6, torch.bfloat16, interleaved, form, False, False, 7)
        run_case("triton", "tok", 1, 2, 3, 1, 8, 8, torch.float32, interleaved, form, True, True, 8)


diffusers_embeddings = pytest.importorskip("diffusers.models.embeddings")


def _tiers():
    return ["torch"] + (["triton"] if HAS_TRITON else [])


@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unbind_dim", [-1, -2])
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_matches_diffusers_apply_rotary_emb(tier, dtype, unbind_dim, sequence_dim):
    """Same operations in the same order as diffusers: bit-for-bit equal on CPU."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    S, H, D = (5, 3, 16) if tier == "triton" else (37, 4, 64)
    gen = torch.Generator().manual_seed(D + S)
    interleaved = unbind_dim == -1
    cos, sin = get_1d_rotary_pos_embed(D, torch.arange(S).double() * 1.7, use_real=True,
                                       repeat_interleave_real=interleaved, freqs_dtype=torch.float64)
    cos, sin = cos.float(), sin.float()
    shape = (2, S, H, D) if sequence_dim == 1 else (2, H, S, D)
    q = torch.randn(shape, generator=gen).to(dtype)
    k = torch.randn(shape, generator=gen).to(dtype)
    with torchpatches.disabled("rope"):  # diffusers' own function (the patch's tier follows TRITON_INTERPRET)
        want_q = diffusers_embeddings.apply_rotary_emb(q, (cos, sin), True, unbind_dim, sequence_dim)
        want_k = diffusers_embeddings.apply_rotary_emb(k, (cos, sin), True, unbind_dim, sequence_dim)
    got_q, got_k = rope.apply_rope_qk(q, k, cos, sin, interleaved=interleaved,
                                      sequence_dim=sequence_dim, tier=tier)
    # Exact, except: Triton's CPU interpreter (3.6) rounds fp32 -> bf16 toward zero (its cast_impl
    # passes no rounding mode), where the GPU and PyTorch round to nearest even: 1 bf16 ulp.
    rtol = 2.0**-7 if (tier == "triton" and dtype == torch.bfloat16) else 0
    torch.testing.assert_close(got_q, want_q, rtol=rtol, atol=0)
    torch.testing.assert_close(got_k, want_k, rtol=rtol, atol=0)
    got_one, none = rope.apply_rope_qk(q, None, cos, sin, interleaved=interleaved,
                                       sequence_dim=sequence_dim, tier=tier)
    assert none is None
    torch.testing.assert_close(got_one, want_q, rtol=rtol, atol=0)


def test_flux_style_embedding_from_diffusers():
    """FLUX builds cos/sin by concatenating several axes' get_1d_rotary_pos_embed outputs."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    ids = torch.stack([torch.zeros(12), torch.arange(12) // 4, torch.arange(12) % 4], -1).double()
    parts = [get_1d_rotary_pos_embed(d, ids[:, i], theta=10000, repeat_interleave_real=True,
                                     use_real=True, freqs_dtype=torch.float64)
             for i, d in enumerate((8, 12, 12))]
    cos = torch.cat([p[0] for p in parts], -1).float()
    sin = torch.cat([p[1] for p in parts], -1).float()
    q = torch.randn(1, 12, 2, 32, dtype=torch.bfloat16)
    want = diffusers_embeddings.apply_rotary_emb(q, (cos, sin), sequence_dim=1)
    got, _ = rope.apply_rope_qk(q, None, cos, sin, interleaved=True, sequence_dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("tier", _tiers())
@pytest.mark.parametrize("interleaved", [True, False])
def test_cache_form_equals_per_token_form(tier, interleaved):
    gen = torch.Generator().manual_seed(3)
    T, HQ, HK, D, r = 4, 2, 1, 16, 12
    q = torch.randn(T, HQ, D, generator=gen, dtype=torch.float32).half()
    k = torch.randn(T, HK, D, generator=gen, dtype=torch.float32).half()
    cache = torch.randn(9, r, generator=gen)
    pos = torch.tensor([8, 0, 3, 3])
    rows = cache[pos]
    cos, sin = widen(rows[:, : r // 2], interleaved), widen(rows[:, r // 2:], interleaved)
    a = rope.apply_rope_qk_with_cache(q, k, cache, pos, interleaved=interleaved, tier=tier)
    b = rope.apply_rope_qk(q, k, cos, sin, interleaved=interleaved, tier=tier)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("tier", _tiers())
def test_inplace_equals_out_of_place_and_only_q_k_are_written(tier):
    gen = torch.Generator().manual_seed(5)
    T, HQ, HK, D = 3, 4, 2, 32
    qkv = torch.randn(T, (HQ + 2 * HK) * D, generator=gen).bfloat16()
    before = qkv.clone()
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HK) * D].view(T, HK, D)
    cache = torch.randn(T, 16, generator=gen)
    pos = torch.arange(T)
    qo, ko = rope.apply_rope_qk_with_cache(q, k, cache, pos, interleaved=False, tier=tier)
    assert torch.equal(qkv, before)
    rope.apply_rope_qk_with_cache_inplace(q, k, cache, pos, interleaved=False, tier=tier)
    assert torch.equal(q, qo) and torch.equal(k, ko)
    assert torch.equal(qkv[:, (HQ + HK) * D:], before[:, (HQ + HK) * D:]), "v was written"
    assert torch.equal(q[..., 16:], before[:, : HQ * D].view(T, HQ, D)[..., 16:])


@pytest.mark.parametrize("tier", _tiers())
def test_strided_head_dim_goes_through_a_copy(tier):
    """A head dim with stride != 1 still works (documented copy for the Triton tier)."""
    gen = torch.Generator().manual_seed(6)
    big = torch.randn(1, 3, 2, 32, generator=gen)
    q = big[..., ::2]  # [1, 3, 2, 16], last-dim stride 2
    ang = torch.rand(3, 8, generator=gen)
    cos, sin = widen(ang.cos(), True), widen(ang.sin(), True)
    want = testing.rope_reference(q, cos, sin, interleaved=True, seq_dim=1)
    out, _ = rope.apply_rope_qk(q, None, cos, sin, tier=tier)
    assert_close_to(out, want, torch.float32)
    other = big[..., 1::2].clone()
    rope.apply_rope_qk_inplace(q, None, cos, sin, tier=tier)
    assert_close_to(q, want, torch.float32)
    assert torch.equal(big[..., 1::2], other), "interleaved neighbours were written"


def test_empty_sequence_is_a_no_op():
    q = torch.randn(0, 2, 8)
    cos = torch.randn(0, 8)
    for tier in _tiers():
        rope.apply_rope_qk_inplace(q, None, cos, cos, tier=tier)
        out, _ = rope.apply_rope_qk(q, None, cos, cos, tier=tier)
        assert out.shape == q.shape


# ------------------------------------------------------------------------------ bad input


def _good():
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 4, 1, 8)
    cos = torch.randn(4, 8)
    sin = torch.randn(4, 8)
    return q, k, cos, sin


BAD_PER_TOKEN = {
    "rank": (lambda q, k, c, s: (q[0, 0], k, c, s, {}), "rank"),
    "odd rotary": (lambda q, k, c, s: (q, k, c[:, :7], s[:, :7], {}), "even"),
    "rotary > head": (lambda q, k, c, s: (q[..., :4], k[..., :4], c, s, {}), "larger than the head dim"),
    "rotary_dim mismatch": (lambda q, k, c, s: (q, k, c, s, {"rotary_dim": 6}), "rotary_dim=6"),
    "seq len": (lambda q, k, c, s: (q, k, c[:3], s[:3], {}), "sequence length"),
    "cos/sin shapes": (lambda q, k, c, s: (q, k, c, s[:, :6], {}), "shapes differ"),
    "int q": (lambda q, k, c, s: (q.to(torch.int32), k.to(torch.int32), c, s, {}), "dtype"),
    "fp64 q": (lambda q, k, c, s: (q.double(), k.double(), c, s, {}), "dtype"),
    "int cos": (lambda q, k, c, s: (q, k, c.to(torch.int64), s, {}), "floating"),
    "q/k dtype": (lambda q, k, c, s: (q, k.half(), c, s, {}), "dtypes differ"),
    "k batch": (lambda q, k, c, s: (q, torch.randn(2, 4, 1, 8), c, s, {}), "does not match"),
    "k head dim": (lambda q, k, c, s: (q, torch.randn(1, 4, 1, 6), c, s, {}), "does not match"),
    "k rank": (lambda q, k, c, s: (q, k[0], c, s, {}), "ranks differ"),
    "k is q": (lambda q, k, c, s: (q, q, c, s, {}), "same tensor"),
    "expanded q": (lambda q, k, c, s: (q[:, :, :1].expand(1, 4, 3, 8), k, c, s, {}), "overlapping"),
    "cos rank": (lambda q, k, c, s: (q, k, c[None], s[None], {}), "2-D"),
    "sequence_dim": (lambda q, k, c, s: (q, k, c, s, {"sequence_dim": 3}), "sequence_dim"),
    "device": (lambda q, k, c, s: (q, k, c.to("meta"), s, {}), "meta"),
    "unknown tier": (lambda q, k, c, s: (q, k, c, s, {"tier": "cuda"}), "unknown RoPE tier"),
    "flashinfer needs cache": (lambda q, k, c, s: (q, k, c, s, {"tier": "flashinfer"}), "flashinfer"),
}


@pytest.mark.parametrize("name", sorted(BAD_PER_TOKEN))
@pytest.mark.parametrize("inplace", [True, False])
def test_bad_input_raises_value_error_and_leaves_q_k_untouched(name, inplace):
    make, needle = BAD_PER_TOKEN[name]
    q, k, cos, sin, kw = make(*_good())
    q0, k0 = q.clone(), k.clone()
    fn = rope.apply_rope_qk_inplace if inplace else rope.apply_rope_qk
    with pytest.raises(ValueError, match=needle):
        fn(q, k, cos, sin, **kw)
    assert torch.equal(q, q0) and torch.equal(k, k0)


BAD_CACHE = {
    "positions dtype": (lambda q, k, c, p: (q, k, c, p.float()), "int32 or int64"),
    "positions shape": (lambda q, k, c, p: (q, k, c, p[:3]), "positions shape"),
    "positions range": (lambda q, k, c, p: (q, k, c, p + 10), "outside"),
    "negative positions": (lambda q, k, c, p: (q, k, c, p - 1), "outside"),
    "odd cache width": (lambda q, k, c, p: (q, k, c[:, :5], p), "even"),
    "cache too wide": (lambda q, k, c, p: (q, k, torch.randn(12, 10), p), "larger than the head dim"),
    "cache not a tensor": (lambda q, k, c, p: (q, k, c.tolist(), p), "must be a torch.Tensor"),
}


@pytest.mark.parametrize("name", sorted(BAD_CACHE))
def test_bad_cache_input_raises_value_error(name):
    make, needle = BAD_CACHE[name]
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    q, k, cache, pos = make(q, k, torch.randn(12, 8), torch.arange(4))
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(ValueError, match=needle):
        rope.apply_rope_qk_with_cache_inplace(q, k, cache, pos, interleaved=False)
    assert torch.equal(q, q0) and torch.equal(k, k0)


# ------------------------------------------------------------------------- tiers and warnings


@needs_triton  # without triton the Triton tier's reason is that, not TRITON_INTERPRET
def test_tier_selection_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tiers = rope.describe_tiers("cpu")
    assert tiers["torch"][0] and not tiers["flashinfer"][0]
    assert not tiers["triton"][0] and "TRITON_INTERPRET" in tiers["triton"][1]
    q, k, cos, sin = _good()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU -> PyTorch is the design, not a fallback: no warning
        rope.apply_rope_qk_inplace(q, k, cos, sin)
    assert rope.last_tier() == "torch"
    if HAS_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert rope.describe_tiers("cpu")["triton"][0]
        rope.apply_rope_qk_inplace(q, k, cos, sin)
        assert rope.last_tier() == "triton"
        with rope.force_tier("torch"):
            rope.apply_rope_qk_inplace(q, k, cos, sin)
        assert rope.last_tier() == "torch"
    with pytest.raises(ValueError, match="unknown tier"):
        with rope.force_tier("bogus"):
            pass


def test_cuda_fallback_warns_once(monkeypatch):
    """No FlashInfer and no Triton on CUDA: one warning per missing tier, then silence."""
    monkeypatch.setattr(_rope_tiers, "flashinfer_rope", lambda: (None, "flashinfer is not installed"))
    monkeypatch.setattr(_rope_tiers, "triton_import", lambda: (False, "triton is not installed"))
    with pytest.warns(RuntimeWarning) as rec:
        assert _rope_tiers.select_tier("cuda", "auto", True, True) == ("torch", None)
    msgs = [str(w.message) for w in rec]
    assert any("FlashInfer" in m for m in msgs) and any("Triton" in m for m in msgs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _rope_tiers.select_tier("cuda", "auto", True, True) == ("torch", None)
        assert _rope_tiers.select_tier("cuda", "auto", False, False) == ("torch", None)


def test_import_does_not_import_triton_or_flashinfer():
    code = ("import sys, torchpatches.ops._rope as r; "
            "print(sorted(m for m in ('triton', 'flashinfer') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TRITON_INTERPRET": ""})
    assert out.stdout.strip() == "[]"


# -------------------------------------------------------------------------- FlashInfer stand-in


class FakeFlashInferRope(types.ModuleType):
    """Records calls; computes with the library-independent float64 reference."""

    def __init__(self):
        super().__init__("flashinfer.rope")
        self.calls = []

    def _compute(self, positions, query, key, head_size, cos_sin_cache, is_neox):
        assert query.dim() == 2 and key.dim() == 2 and cos_sin_cache.dtype == torch.float32
        half = cos_sin_cache.shape[1] // 2
        rows = cos_sin_cache[positions.long()]
        cos = widen(rows[:, :half], not is_neox)
        sin = widen(rows[:, half:], not is_neox)
        outs = []
        for x in (query, key):
            x3 = x.view(x.shape[0], -1, head_size)
            outs.append(testing.rope_reference(x3, cos[None], sin[None], interleaved=not is_neox, seq_dim=0)
                        .to(x.dtype).view(x.shape[0], -1))
        return outs

    def apply_rope_with_cos_sin_cache_inplace(self, positions, query, key, head_size, cos_sin_cache,
                                              is_neox=True):
        self.calls.append(("inplace", positions, query, key, head_size, cos_sin_cache, is_neox))
        qo, ko = self._compute(positions, query, key, head_size, cos_sin_cache, is_neox)
        query.copy_(qo)
        key.copy_(ko)

    def apply_rope_with_cos_sin_cache(self, positions, query, key, head_size, cos_sin_cache,
                                      is_neox=True):
        self.calls.append(("out", positions, query, key, head_size, cos_sin_cache, is_neox))
        qo, ko = self._compute(positions, query, key, head_size, cos_sin_cache, is_neox)
        return qo.contiguous(), ko.contiguous()


@pytest.fixture
def fake_flashinfer(monkeypatch):
    pkg = types.ModuleType("flashinfer")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None, is_package=True)
    pkg.__path__ = []
    mod = FakeFlashInferRope()
    mod.__spec__ = importlib.machinery.ModuleSpec("flashinfer.rope", None)
    pkg.rope = mod
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.rope", mod)
    _rope_tiers.reset_caches()
    yield mod
    _rope_tiers.reset_caches()


@needs_triton  # without triton the CUDA fallback warns (about the missing tier)
def test_flashinfer_is_chosen_on_cuda_when_it_fits(fake_flashinfer):
    assert rope.describe_tiers("cuda")["flashinfer"][0]
    assert not rope.describe_tiers("cpu")["flashinfer"][0]
    assert _rope_tiers.select_tier("cuda", "auto", True, True) == ("flashinfer", None)
    # per-token form, or a layout FlashInfer cannot take: the next tier, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _rope_tiers.select_tier("cuda", "auto", False, False) in (("triton", None), ("torch", None))
        assert _rope_tiers.select_tier("cuda", "auto", True, False) in (("triton", None), ("torch", None))


@pytest.mark.parametrize("layout", ["tok", "bshd-batch-positions", "qkv-slice"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inplace", [True, False])
def test_flashinfer_argument_mapping(fake_flashinfer, layout, interleaved, inplace):
    gen = torch.Generator().manual_seed(11)
    HQ, HK, D = 4, 2, 64
    if layout == "tok":
        q = torch.randn(5, HQ, D, generator=gen).half()
        k = torch.randn(5, HK, D, generator=gen).half()
        pos = torch.tensor([0, 4, 2, 9, 1], dtype=torch.int32)
    elif layout == "bshd-batch-positions":
        q = torch.randn(2, 3, HQ, D, generator=gen).bfloat16()
        k = torch.randn(2, 3, HK, D, generator=gen).bfloat16()
        pos = torch.tensor([[0, 1, 2], [7, 8, 9]])
    else:
        qkv = torch.randn(5, (HQ + 2 * HK) * D, generator=gen).bfloat16()
        q = qkv[:, : HQ * D].view(5, HQ, D)
        k = qkv[:, HQ * D:(HQ + HK) * D].view(5, HK, D)
        pos = torch.arange(5)
    cache = torch.randn(10, 48, generator=gen)  # rotary 48 of head dim 64
    assert _rope_tiers.flashinfer_takes(q, k, 1 if q.dim() == 4 else 0, D, pos)
    want = rope.apply_rope_qk_with_cache(q, k, cache, pos, interleaved=interleaved, tier="torch")
    if inplace:
        rope.apply_rope_qk_with_cache_inplace(q, k, cache, pos, interleaved=interleaved,
                                              tier="flashinfer")
        got = (q, k)
    else:
        got = rope.apply_rope_qk_with_cache(q, k, cache, pos, interleaved=interleaved,
                                            tier="flashinfer")
    assert rope.last_tier() == "flashinfer"
    (kind, fpos, query, key, head_size, fcache, is_neox), = fake_flashinfer.calls
    assert kind == ("inplace" if inplace else "out")
    assert is_neox is (not interleaved) and head_size == D and fcache is cache
    assert fpos.shape == (q.numel() // (HQ * D),) and torch.equal(fpos, pos.reshape(-1))
    assert query.shape == (fpos.shape[0], HQ * D) and key.shape == (fpos.shape[0], HK * D)
    if inplace:  # FlashInfer wrote through views of the caller's memory
        assert query.data_ptr() == q.data_ptr() and key.data_ptr() == k.data_ptr()
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=TOL[g.dtype][0], atol=1e-3)


def test_flashinfer_refuses_what_it_cannot_take(fake_flashinfer):
    q, k = torch.randn(2, 3, 4, 64).half(), torch.randn(2, 3, 2, 64).half()
    cache, pos = torch.randn(8, 64), torch.arange(3)
    assert not _rope_tiers.flashinfer_takes(q, k, 2, 64, pos)              # [B, H, S, D]
    assert not _rope_tiers.flashinfer_takes(q, k, 1, 64, pos)              # [S] positions, batch 2
    assert not _rope_tiers.flashinfer_takes(q.float(), k.float(), 1, 64, pos.expand(2, 3))  # fp32
    assert not _rope_tiers.flashinfer_takes(q, None, 1, 64, pos.expand(2, 3))  # no k
    assert not _rope_tiers.flashinfer_takes(q[..., :48], k[..., :48], 1, 48, pos.expand(2, 3))
    with pytest.raises(ValueError, match="FlashInfer only takes"):
        rope.apply_rope_qk_with_cache_inplace(q, k, cache, pos, interleaved=False,
                                              sequence_dim=1, tier="flashinfer")
    assert fake_flashinfer.calls == []


def test_flashinfer_under_compile(fake_flashinfer):
    q, k = torch.randn(6, 2, 64).half(), torch.randn(6, 1, 64).half()
    cache, pos = torch.randn(8, 64), torch.arange(6)

    def f(q, k):
        q = q * 2
        rope.apply_rope_qk_with_cache_inplace(q, k, cache, pos, interleaved=False, tier="flashinfer")
        return q

    k1, k2 = k.clone(), k.clone()
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k1)
    want = f(q, k2)
    assert torch.equal(got, want) and torch.equal(k1, k2)


# ---------------------------------------------------------------------------- torch.compile


def _graph_breaks(fn, *args):
    return testing.graph_report(fn, *args).breaks


def _compile_case():
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(1, 3, 2, 16, generator=gen)
    k = torch.randn(1, 3, 1, 16, generator=gen)
    ang = torch.rand(3, 8, generator=gen)
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    pos = torch.tensor([2, 0, 1])

    def f(q, k):
        q = q * 2  # a neighbour op, so the graph has more than the RoPE in it
        k = k.clone()
        rope.apply_rope_qk_inplace(q, k, widen(ang.cos(), True), widen(ang.sin(), True))
        q2, k2 = rope.apply_rope_qk_with_cache(q, k, cache, pos, interleaved=False)
        q3, _ = rope.apply_rope_qk(q2, None, widen(ang.cos(), False), widen(ang.sin(), False),
                                   interleaved=False)
        return q3 + 1, k2, k
    return f, q, k


@pytest.mark.slow
@pytest.mark.parametrize("tier", _tiers())
def test_compile_fullgraph_zero_graph_breaks(tier):
    f, q, k = _compile_case()
    with rope.force_tier(tier):
        assert _graph_breaks(f, q, k) == 0
        want = f(q, k)
        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True)(q, k)
        assert rope.last_tier() == tier
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tier_query_runs_once_at_trace_time_not_per_call(monkeypatch):
    """The availability query is folded to a constant by Dynamo: called when tracing, not after."""
    calls = []
    real = _rope_tiers.choose

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_rope_tiers, "choose", counting)
    q, k, cos, sin = _good()

    def f(q, k):
        q = q + 0
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier="torch")
        return q

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    for _ in range(3):
        cf(q, k.clone())
    assert calls == [("cpu", "torch", False, False, False)]  # device, tier, cache form, fits, needs grad


def _fake_cuda_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            q = torch.empty(1, 6, 4, 16, device="cuda", dtype=torch.bfloat16)
            k = torch.empty(1, 6, 2, 16, device="cuda", dtype=torch.bfloat16)
            cos = torch.empty(6, 16, device="cuda")
            sin = torch.empty(6, 16, device="cuda")
    except Exception as e:  # a CPU-only torch build cannot fake CUDA tensors
        pytest.skip(f"cannot make fake CUDA tensors here: {e}")
    return q, k, cos, sin


@needs_triton
def test_cuda_triton_ops_trace_without_a_gpu():
    """make_fx over fake CUDA tensors: the Triton tier's ops (registered lazily) are in the graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, cos, sin = _fake_cuda_inputs()

    def f(q, k, cos, sin):
        q = q * 2
        rope.apply_rope_qk_inplace(q, k, cos, sin, tier="triton")
        a, b = rope.apply_rope_qk(q, k, cos, sin, interleaved=False, tier="triton")
        return q, a, b

    code = make_fx(f, tracing_mode="fake")(q, k, cos, sin).code
    assert "torchpatches.rope_qk_triton_.default" in code
    assert "torchpatches.rope_qk_triton.default" in code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_triton_op_compiles_with_cuda_graphs(mode):  # pragma: no cover - GPU only
    f, q, k = _compile_case()
    q, k = q.cuda(), k.cuda()
    with rope.force_tier("triton"):
        want = f(q, k)
        torch._dynamo.reset()
        c = torch.compile(f, fullgraph=True, mode=None if mode == "default" else mode)
        for _ in range(3):
            got = c(q, k)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
