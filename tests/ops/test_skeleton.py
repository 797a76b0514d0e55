"""The op skeleton every op shares (``ops/_tiers``, ``_dispatch``, ``_memory``, ``_args``):

- the forced tier is per thread and per asyncio task, and one switch serves RoPE and the fused ops;
- a stubbed ``triton`` in ``sys.modules`` (a bare module, a MagicMock) reads as "no triton": the PyTorch
  tier runs;
- "autograd records" covers forward-mode AD and functorch transforms: the automatic tier gives the right
  tangents / batched values, a forced kernel tier refuses;
- a wrong kind of argument raises ``ValueError`` naming it;
- the modulate family's second rounding mode (Wan's fp32 compute, rounded once).
"""
from __future__ import annotations

import asyncio
import sys
import threading
import types
from typing import Any, Callable, Dict
from unittest import mock

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, HAS_TRITON, UNIT, hyp, needs_triton, ulps
from torchpatches.ops import (
    _rope_tiers,
    _linear_gelu as linear_gelu,
    _lse_merge as lse_merge,
    _modulate as modulate,
    _rms_modulate as rms_modulate,
    _qk_norm_rope as qk_norm_rope,
    _rms_norm_rope as rms_norm_rope,
    _rope as rope,
    _rope_tables as rope_tables,
    _slices as slices,
    _swiglu as swiglu,
)
from torchpatches.ops._runtime import tiers as _tiers


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rope_args(seed: int = 0) -> Dict[str, torch.Tensor]:
    angles = _randn(5, 4, seed=seed + 3)
    return dict(q=_randn(1, 5, 2, 8, seed=seed), k=_randn(1, 5, 2, 8, seed=seed + 1),
                cos=angles.cos().repeat_interleave(2, -1), sin=angles.sin().repeat_interleave(2, -1))


# ---- one forced-tier switch, per thread and task -------------------------------------------------------


def test_one_switch_for_rope_and_the_fused_ops() -> None:
    assert rope.force_tier is modulate.force_tier is qk_norm_rope.force_tier is swiglu.force_tier
    with rope.force_tier("torch"):
        assert _tiers.forced_tier() == "torch"
    assert _tiers.forced_tier() is None


def test_forced_tier_is_not_shared_between_threads() -> None:
    seen: Dict[str, Any] = {}
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with _tiers.force_tier("torch"):
            inside.set()
            release.wait(10)
            seen["other"] = _tiers.forced_tier()

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    seen["main"] = _tiers.forced_tier()  # while the other thread holds its block
    release.set()
    thread.join()
    assert seen == {"main": None, "other": "torch"}


def test_forced_tier_is_not_shared_between_tasks() -> None:
    async def task(tier: Any, started: asyncio.Event, go: asyncio.Event) -> Any:
        with _tiers.force_tier(tier):
            started.set()
            await go.wait()
            return _tiers.forced_tier()

    async def main() -> Any:
        started, go = asyncio.Event(), asyncio.Event()
        forced = asyncio.ensure_future(task("torch", started, go))
        await started.wait()
        plain = asyncio.ensure_future(task(None, asyncio.Event(), go))
        go.set()
        return await forced, await plain

    assert asyncio.run(main()) == ("torch", None)


# ---- a stub triton -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stub", [types.ModuleType("triton"), mock.MagicMock()], ids=["module", "magicmock"])
def test_a_stubbed_triton_runs_the_torch_tier(stub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # would pick the Triton tier on CPU if triton were there
    a = _rope_args()
    want = rope.apply_rope_qk(a["q"], a["k"], a["cos"], a["sin"], tier="torch")
    with mock.patch.dict(sys.modules, triton=stub):
        _rope_tiers.reset_caches()
        try:
            got = rope.apply_rope_qk(a["q"], a["k"], a["cos"], a["sin"])
            assert rope.last_tier() == "torch"
            assert not rope.describe_tiers("cpu")["triton"][0]
            x = _randn(2, 3, 8)
            assert torch.equal(modulate.layer_norm_modulate(x, x[:, 0], x[:, 1]),
                               modulate.layer_norm_modulate(x, x[:, 0], x[:, 1], tier="torch"))
            with pytest.raises(ValueError, match="stand-in"):
                modulate.layer_norm_modulate(x, x[:, 0], x[:, 1], tier="triton")
        finally:
            _rope_tiers.reset_caches()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# ---- every form of "autograd records" --------------------------------------------------------------------


def _lnmod(x: torch.Tensor, tier: Any) -> torch.Tensor:
    return modulate.layer_norm_modulate(x, x[:, 0] * 0.5, x[:, 1], tier=tier)


def _gate(x: torch.Tensor, tier: Any) -> torch.Tensor:
    return modulate.gate_residual(x, x[:, 0], x * 2, tier=tier)


def _rms_mod(x: torch.Tensor, tier: Any) -> torch.Tensor:
    w = _RMS_W[: x.shape[-1]]  # a constant weight: under vmap and jit.trace only x varies
    return torch.cat(rms_modulate.gate_rms_norm_residual_scale(x, x[:, 0].tanh(), x * 2, w, w, 1 + x[:, 1] * 0.5,
                                                              tier=tier))


_RMS_W = 1 + 0.1 * _randn(16, seed=7)


def _krea_mod(x: torch.Tensor, tier: Any) -> torch.Tensor:  # Krea 2's zero-centered RMSNorm, an fp32 weight
    w = (_RMS_W[: x.shape[-1]] - 1).float()
    return torch.cat(modulate.gate_residual_rms_norm_modulate(x, x[:, 0].tanh(), x * 2, w, x[:, 1] * 0.5, x[:, 2],
                                                              tier=tier))


def _swiglu(x: torch.Tensor, tier: Any) -> torch.Tensor:
    return swiglu.swiglu(x, tier=tier)


def _swiglu_two(x: torch.Tensor, tier: Any) -> torch.Tensor:
    return swiglu.swiglu(x, x * 2, tier=tier)


def _glu(x: torch.Tensor, tier: Any) -> torch.Tensor:  # Krea 2's attention output gate
    return swiglu.swiglu(x, x * 2, activation="sigmoid", tier=tier)


def _gelu_into(x: torch.Tensor, tier: Any) -> torch.Tensor:
    return slices.gelu_tanh_into(x, torch.empty_like(x), tier=tier)


_ANGLES = _randn(4, 4, seed=5)  # 4 tokens, head dim 8
_COS, _SIN = _ANGLES.cos().repeat_interleave(2, -1), _ANGLES.sin().repeat_interleave(2, -1)
_W = 1 + 0.1 * _randn(8, seed=6)


def _qk(x: torch.Tensor, tier: Any) -> torch.Tensor:
    q = x.reshape(x.shape[0], x.shape[1], 2, -1)
    return qk_norm_rope.qk_norm_rope(q, q * 2, _COS, _SIN, q_weight=_W, k_weight=_W, eps_q=1e-6, eps_k=1e-6,
                                     tier=tier)[0]


def _qk_half(x: torch.Tensor, tier: Any) -> torch.Tensor:  # Ideogram 4's form: tables of q's dtype
    q = x.reshape(x.shape[0], x.shape[1], 2, -1)
    return qk_norm_rope.qk_norm_rope(q, q * 2, _COS.to(x.dtype), _SIN.to(x.dtype), q_weight=_W.to(x.dtype),
                                     k_weight=_W.to(x.dtype), eps_q=1e-6, eps_k=1e-6, rounding="each",
                                     rope="half_each", tier=tier)[0]


def _qk_gqa(x: torch.Tensor, tier: Any) -> torch.Tensor:  # Krea 2's form: zero-centered norms, k of 1 head
    q = x.reshape(x.shape[0], x.shape[1], 2, -1)
    return torch.cat(qk_norm_rope.qk_norm_rope(q, q[:, :, :1] * 2, _COS, _SIN, q_weight=_W - 1, k_weight=_W - 1,
                                               eps_q=1e-5, eps_k=1e-5, rounding="zero_centered", k_repeat=2,
                                               tier=tier)[:2])


def _rms_rope(x: torch.Tensor, tier: Any) -> torch.Tensor:
    w = torch.cat([_W, _W])  # across 2 heads of 8
    return rms_norm_rope.rms_norm_rope(x, x * 2, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, cos=_COS, sin=_SIN,
                                       tier=tier)[0]


def _lse_merge(x: torch.Tensor, tier: Any) -> torch.Tensor:
    # x as two partial outputs [..., 8] and, from their first columns, their log-sum-exps
    a, b = x[..., :8], x[..., 8:]
    return lse_merge.lse_merge(a, a[..., 0] * 3, b, b[..., 1], tier=tier)[0]


def _rope(x: torch.Tensor, tier: Any) -> torch.Tensor:
    return rope.apply_rope_qk(x.reshape(x.shape[0], x.shape[1], 2, -1), None, _COS, _SIN, tier=tier)[0]


def _rope_tables(x: torch.Tensor, tier: Any) -> torch.Tensor:
    # x's first three columns as position ids [S, 3]; both tables in one result
    cos, sin = rope_tables.rope_tables(x.reshape(-1, x.shape[-1])[:, :3] * 10, (4, 6, 2), 100.0, tier=tier)
    return cos + 2 * sin


OPS: Dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "layer_norm_modulate": _lnmod, "gate_residual": _gate, "rms_modulate": _rms_mod, "swiglu": _swiglu, "swiglu two": _swiglu_two, "swiglu sigmoid": _glu,
    "gelu_tanh_into": _gelu_into,
    "qk_norm_rope": _qk, "qk_norm_rope half_each": _qk_half, "apply_rope_qk": _rope,
    "modulate zero-centered rms": _krea_mod, "qk_norm_rope zero_centered gqa": _qk_gqa,
    "rms_norm_rope": _rms_rope, "lse_merge": _lse_merge, "rope_tables": _rope_tables,
}


@pytest.fixture
def kernels_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The automatic tier picks the kernels, as on a GPU (the interpreter stands in for it)."""
    if HAS_TRITON:
        monkeypatch.setattr(_tiers, "_automatic", lambda device_type: "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # RoPE's automatic tier on CPU


@pytest.mark.usefixtures("kernels_by_default")
@pytest.mark.parametrize("name", sorted(OPS))
def test_forward_ad_gets_the_reference_tangent(name: str) -> None:
    op = OPS[name]
    x, t = _randn(2, 4, 16), _randn(2, 4, 16, seed=9)
    with fwAD.dual_level():
        want = fwAD.unpack_dual(op(fwAD.make_dual(x, t), "torch")).tangent
        got = fwAD.unpack_dual(op(fwAD.make_dual(x, t), None)).tangent
    assert want is not None and got is not None
    assert torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("name", sorted(OPS))
def test_forward_ad_refuses_a_requested_kernel_tier(name: str) -> None:
    x, t = _randn(2, 4, 16), _randn(2, 4, 16, seed=9)
    with fwAD.dual_level(), pytest.raises(ValueError, match="forward-mode AD"):
        OPS[name](fwAD.make_dual(x, t), "triton")


@pytest.mark.usefixtures("kernels_by_default")
@pytest.mark.parametrize("name", sorted(OPS))
def test_vmap_gets_the_reference_values(name: str) -> None:
    op = OPS[name]
    batch = _randn(3, 2, 4, 16)
    want = torch.stack([op(sample, "torch") for sample in batch])
    got = torch.func.vmap(lambda sample: op(sample, None))(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_needs_grad_sees_every_form() -> None:
    x = torch.ones(2)
    assert not _tiers.needs_grad(x)
    assert _tiers.needs_grad(x.clone().requires_grad_(True))
    with fwAD.dual_level():
        assert _tiers.needs_grad(x)
    torch.func.vmap(lambda s: _assert(_tiers.needs_grad(s)))(torch.ones(2, 2))
    torch.func.grad(lambda s: _assert(_tiers.needs_grad(s)) + s.sum())(torch.ones(2))


def _assert(value: bool) -> torch.Tensor:
    assert value
    return torch.zeros(())


# ---- argument kinds --------------------------------------------------------------------------------------


def _bad_rope(**change: Any) -> Callable[[], Any]:
    a = dict(_rope_args(), interleaved=True)
    a.update(change)
    return lambda: rope.apply_rope_qk(a["q"], a["k"], a["cos"], a["sin"], interleaved=a["interleaved"],
                                      **{k: v for k, v in change.items() if k in ("sequence_dim", "rotary_dim")})


BAD_ARGUMENTS = {
    "rope q": (_bad_rope(q=[[1.0]]), "q"),
    "rope k": (_bad_rope(k=[[1.0]]), "k"),
    "rope cos": (_bad_rope(cos=[[1.0]]), "cos"),
    "rope interleaved": (_bad_rope(interleaved="yes"), "interleaved"),
    "rope sequence_dim": (_bad_rope(sequence_dim="1"), "sequence_dim"),
    "rope rotary_dim": (_bad_rope(rotary_dim="8"), "rotary_dim"),
    "rope tier": (lambda: rope.apply_rope_qk(*_rope_args().values(), tier=["torch"]), "tier"),
    "rope in place q": (lambda: rope.apply_rope_qk_inplace([1.0], None, *list(_rope_args().values())[2:]), "q"),
    "rope cache positions": (lambda: rope.apply_rope_qk_with_cache(
        _randn(4, 2, 8), None, _randn(6, 8), [0, 1, 2, 3], interleaved=True), "positions"),
    "modulate x": (lambda: modulate.layer_norm_modulate([1.0], _randn(1, 4), _randn(1, 4)), "x"),
    "modulate eps": (lambda: modulate.layer_norm_modulate(_randn(1, 2, 4), _randn(1, 4), _randn(1, 4), eps="1"),
                     "eps"),
    "modulate rounding": (lambda: modulate.gate_residual(_randn(1, 2, 4), _randn(1, 4), _randn(1, 2, 4),
                                                         rounding="never"), "rounding"),
    "swiglu x": (lambda: swiglu.swiglu([1.0, 2.0]), "x"),
    "swiglu up": (lambda: swiglu.swiglu(_randn(2, 4), [1.0]), "up"),
    "gelu_tanh_into out": (lambda: slices.gelu_tanh_into(_randn(2, 4), [0.0]), "out"),
    "linear_gelu x": (lambda: linear_gelu.linear_gelu_tanh([1.0], _randn(3, 4), None), "x"),
    "linear_gelu bias": (lambda: linear_gelu.linear_gelu_tanh(_randn(2, 4), _randn(3, 4), [0.0]), "bias"),
    "lse_merge lse_b": (lambda: lse_merge.lse_merge(_randn(2, 4), _randn(2), _randn(2, 4), 0.0), "lse_b"),
    "lse_merge out_dtype": (lambda: lse_merge.lse_merge(_randn(2, 4), _randn(2), _randn(2, 4), _randn(2),
                                                        out_dtype="bf16"), "out_dtype"),
    "qk_norm_rope eps": (lambda: qk_norm_rope.qk_norm_rope(
        _randn(1, 2, 1, 4), _randn(1, 2, 1, 4), _randn(2, 4), _randn(2, 4), q_weight=_randn(4),
        k_weight=_randn(4), eps_q=None, eps_k=1e-6), "eps_q"),
    "qk_norm_rope rope": (lambda: qk_norm_rope.qk_norm_rope(
        _randn(1, 2, 1, 4), _randn(1, 2, 1, 4), _randn(2, 4), _randn(2, 4), q_weight=_randn(4),
        k_weight=_randn(4), eps_q=1e-6, eps_k=1e-6, rope="half"), "rope"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_wrong_kinds_of_arguments_raise_value_error_naming_them(case: str) -> None:
    call, name = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()


# ---- the second rounding mode (Wan's .type_as) -------------------------------------------------------


def _wan_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    # diffusers' WanTransformerBlock: (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(...)
    norm = torch.nn.LayerNorm(x.shape[-1], eps=eps, elementwise_affine=False)
    return (norm(x.float()) * (1 + scale) + shift).type_as(x)


def _wan_gate(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
    return (x.float() + y * gate).type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_once_torch_tier_is_wans_expression(dtype: torch.dtype) -> None:
    x, y = _randn(2, 5, 24, dtype=dtype), _randn(2, 5, 24, seed=1, dtype=dtype)
    table = _randn(2, 1, 3 * 24, seed=2)  # fp32, as Wan's scale_shift_table + temb
    shift, scale, gate = table.chunk(3, dim=-1)
    assert torch.equal(modulate.layer_norm_modulate(x, scale, shift, rounding="once", tier="torch"),
                       _wan_norm(x, scale, shift, 1e-6))
    assert torch.equal(modulate.gate_residual(x, gate, y, rounding="once", tier="torch"), _wan_gate(x, gate, y))
    h, out = modulate.gate_residual_layer_norm_modulate(x, gate, y, scale, shift, rounding="once", tier="torch")
    assert torch.equal(h, _wan_gate(x, gate, y)) and torch.equal(out, _wan_norm(h, scale, shift, 1e-6))
    assert h.dtype == out.dtype == dtype
    if dtype != torch.float32:  # diffusers' form rounds in x's dtype: its vectors must have it
        with pytest.raises(ValueError, match="rounding='once'"):
            modulate.layer_norm_modulate(x, scale, shift)


@st.composite
def wan_cases(draw: Any) -> Dict[str, Any]:
    B, S, D = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.sampled_from([2, 7, 16, 33]))
    dtype = draw(st.sampled_from(DTYPES))
    vec_dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mag = draw(st.sampled_from([0.5, 4.0, 100.0]))
    vec = (B, draw(st.sampled_from([1, S])), D)
    return dict(x=(torch.randn(B, S, D, generator=g) * mag).to(dtype), y=torch.randn(B, S, D, generator=g).to(dtype),
                gate=torch.randn(*vec, generator=g).to(vec_dtype),
                scale=(torch.randn(*vec, generator=g) * 0.5).to(vec_dtype),
                shift=torch.randn(*vec, generator=g).to(vec_dtype))


def _ln_mod_64(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * (1 + scale.double()) + shift.double()


@settings(**hyp(15))
@given(wan_cases())
def test_rounding_once_against_float64_and_between_tiers(case: Dict[str, Any]) -> None:
    """One rounding: within one unit roundoff of the float64 value (plus fp32 noise) in every tier; the
    Triton tier (interpreter) within one ulp of the PyTorch tier in bf16/fp16."""
    x, y, gate, scale, shift = (case[k] for k in ("x", "y", "gate", "scale", "shift"))
    tiers = ["torch"] + (["triton"] if HAS_TRITON else [])
    for tier in tiers:
        h, out = modulate.gate_residual_layer_norm_modulate(x, gate, y, scale, shift, rounding="once", tier=tier)
        h64 = x.double() + gate.double() * y.double()
        mag_h = x.double().abs() + (gate.double() * y.double()).abs()
        assert ((h.double() - h64).abs() <= UNIT[h.dtype] * h64.abs() + 1e-6 * mag_h + 1e-30).all(), tier
        ref = _ln_mod_64(h, scale, shift)
        mag = (_ln_mod_64(h, scale, torch.zeros_like(shift)).abs() + shift.double().abs())
        assert ((out.double() - ref).abs() <= UNIT[out.dtype] * ref.abs() + 1e-5 * mag + 1e-6).all(), tier
        if tier == "triton":
            want_h, want = modulate.gate_residual_layer_norm_modulate(x, gate, y, scale, shift, rounding="once",
                                                                      tier="torch")
            # fp32 outputs carry the LayerNorm statistics' own few-ulp differences (as in test_modulate)
            assert ulps(h, want_h) <= 1.0 and ulps(out, want, mag) <= (8.0 if out.dtype == torch.float32 else 1.0)


# ---- torch.jit.trace -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("kernels_by_default")
@pytest.mark.parametrize("name", sorted(OPS))
def test_jit_trace_records_the_reference_tier_without_tracer_warnings(name: str) -> None:
    import warnings

    op = OPS[name]
    x = _randn(2, 4, 16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        traced = torch.jit.trace(lambda t: op(t, None), (x,), check_trace=False)
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if "torchpatches" in w.filename]
    assert not ours, ours[:3]
    other = _randn(2, 4, 16, seed=4)
    assert torch.equal(traced(other), op(other, "torch"))
