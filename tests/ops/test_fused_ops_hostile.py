"""The fused DiT ops (modulate, qk_norm_rope, swiglu, slices, linear_gelu) under hostile input, held to
what the RoPE op promises (tests/ops/test_rope_hostile.py): gradients are right or refused with a
clear error, an ``out=`` that cannot be written or overlaps the input is refused before anything is
written, bad arguments raise ``ValueError`` naming the argument, zero-size tensors work in every tier.

The Triton tier runs on CPU through Triton's interpreter (tier="triton" forces it); shapes are tiny.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
import torch
import torch.nn.functional as F

from torchpatches.ops import (
    _linear_gelu as linear_gelu,
    _modulate as modulate,
    _qk_norm_rope as qk_norm_rope,
    _slices as slices,
    _swiglu as swiglu,
)
from torchpatches.ops import force_tier

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="no triton")
TIERS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qk_args(requires_grad: str = "") -> Dict[str, Any]:
    q, k = _randn(1, 4, 2, 8, seed=1), _randn(1, 4, 2, 8, seed=2)
    angles = _randn(4, 4, seed=3)
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    w = 1 + 0.1 * _randn(8, seed=4)
    args = dict(q=q, k=k, cos=cos, sin=sin, q_weight=w, k_weight=w.clone())
    for name in requires_grad.split():
        args[name] = args[name].requires_grad_(True)
    return args


def _qk(args: Dict[str, Any], tier: Any) -> torch.Tensor:
    q, k, _ = qk_norm_rope.qk_norm_rope(args["q"], args["k"], args["cos"], args["sin"], q_weight=args["q_weight"],
                                        k_weight=args["k_weight"], eps_q=1e-6, eps_k=1e-6, tier=tier)
    return q.square().sum() + (2 * k).sum()


def _lnmod(args: Dict[str, Any], tier: Any) -> torch.Tensor:
    return modulate.layer_norm_modulate(args["x"], args["scale"], args["shift"], tier=tier).square().sum()


def _gate_lnmod(args: Dict[str, Any], tier: Any) -> torch.Tensor:
    h, out = modulate.gate_residual_layer_norm_modulate(args["x"], args["gate"], args["y"], args["scale"],
                                                        args["shift"], tier=tier)
    return h.square().sum() + out.square().sum()


def _swiglu(args: Dict[str, Any], tier: Any) -> torch.Tensor:
    return swiglu.swiglu(args["x"], tier=tier).square().sum()


def _gelu_into(args: Dict[str, Any], tier: Any) -> torch.Tensor:
    buf = torch.zeros(3, 10)
    slices.gelu_tanh_into(args["x"], buf[:, 2:], tier=tier)
    return buf.square().sum()


def _mod_args(requires_grad: str) -> Dict[str, Any]:
    args = dict(x=_randn(2, 3, 8, seed=1), gate=_randn(2, 8, seed=2), y=_randn(2, 3, 8, seed=3),
                scale=_randn(2, 8, seed=4), shift=_randn(2, 8, seed=5))
    for name in requires_grad.split():
        args[name] = args[name].requires_grad_(True)
    return args


GRAD_CASES: Dict[str, "tuple[Callable[..., torch.Tensor], Callable[[], Dict[str, Any]], str]"] = {
    "qk_norm_rope q": (_qk, lambda: _qk_args("q"), "q"),
    "qk_norm_rope weight": (_qk, lambda: _qk_args("k_weight"), "k_weight"),
    "layer_norm_modulate x": (_lnmod, lambda: _mod_args("x"), "x"),
    "layer_norm_modulate shift": (_lnmod, lambda: _mod_args("shift"), "shift"),
    "gate_residual_layer_norm_modulate gate": (_gate_lnmod, lambda: _mod_args("gate"), "gate"),
    "swiglu x": (_swiglu, lambda: dict(x=_randn(3, 16).requires_grad_(True)), "x"),
    "gelu_tanh_into x": (_gelu_into, lambda: dict(x=_randn(3, 8).requires_grad_(True)), "x"),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_automatic_tier_gives_right_gradients(case: str) -> None:
    """Autograd-recorded calls get the differentiable PyTorch tier, also where Triton is the default (CUDA,
    here stood in for by a forced tier around the reference)."""
    fn, make, name = GRAD_CASES[case]
    ref_args = make()
    fn(ref_args, "torch").backward()
    args = make()
    with force_tier(None):
        fn(args, None).backward()
    assert args[name].grad is not None
    torch.testing.assert_close(args[name].grad, ref_args[name].grad, rtol=0, atol=0)


@NEEDS_TRITON
@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_triton_tier_refuses_calls_autograd_records(case: str) -> None:
    fn, make, _ = GRAD_CASES[case]
    with pytest.raises(ValueError, match="not differentiable"):
        fn(make(), "triton")
    with pytest.raises(ValueError, match="not differentiable"), force_tier("triton"):
        fn(make(), None)
    with torch.no_grad():  # nothing recorded: the kernel is fine
        fn(make(), "triton")


@NEEDS_TRITON
def test_triton_default_with_grad_goes_to_torch_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the automatic tier is Triton; with a tensor needing grad it must pick the PyTorch tier."""
    from torchpatches.ops._runtime import tiers as _tiers

    monkeypatch.setattr(_tiers, "_automatic", lambda device_type: "triton")
    x = _randn(2, 3, 8).requires_grad_(True)
    out = modulate.layer_norm_modulate(x, _randn(2, 8), _randn(2, 8))
    assert out.grad_fn is not None
    y = swiglu.swiglu(_randn(3, 16).requires_grad_(True))
    assert y.grad_fn is not None


def test_gradients_under_torch_compile() -> None:
    x = _randn(2, 3, 8).requires_grad_(True)
    scale, shift = _randn(2, 8, seed=1), _randn(2, 8, seed=2)
    fn = torch.compile(lambda x: modulate.layer_norm_modulate(x, scale, shift), fullgraph=True, backend="aot_eager")
    fn(x).square().sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    modulate.layer_norm_modulate(ref, scale, shift, tier="torch").square().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_linear_gelu_with_grad_never_uses_the_epilogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch._addmm_activation has no derivative: a call autograd records takes F.linear + F.gelu."""
    monkeypatch.setattr(linear_gelu, "lt_tier_fits", lambda *args: True)
    x, w, b = _randn(3, 4).requires_grad_(True), _randn(5, 4), _randn(5)
    out = linear_gelu.linear_gelu_tanh(x, w, b)
    out.sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    F.gelu(F.linear(ref, w, b), approximate="tanh").sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)
    with pytest.raises(ValueError, match="not differentiable"):
        linear_gelu.linear_gelu_tanh(x, w, b, tier="cublaslt")


# ---- out= that cannot be written, or that overlaps the input ---------------------------------------


def _inference_out(shape: "tuple[int, ...]") -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(shape)


OUT_OPS = {
    "swiglu": lambda x, out, tier: swiglu.swiglu(x, out=out, tier=tier),
    "gelu_tanh_into": lambda x, out, tier: slices.gelu_tanh_into(x, out, tier=tier),
    "copy_into": lambda x, out, tier: slices.copy_into(x, out, tier=tier),
}
IN_COLS = {"swiglu": 8, "gelu_tanh_into": 4, "copy_into": 4}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("op", sorted(OUT_OPS))
@pytest.mark.parametrize("bad", ["leaf requiring grad", "inference tensor", "expanded", "view of a leaf"])
def test_out_that_cannot_be_written_is_refused_before_writing(op: str, bad: str, tier: str) -> None:
    x = _randn(4, IN_COLS[op])
    if bad == "leaf requiring grad":
        out = torch.zeros(4, 4, requires_grad=True)
    elif bad == "inference tensor":
        out = _inference_out((4, 4))
    elif bad == "expanded":
        out = torch.zeros(1, 4).expand(4, 4)
    else:
        out = torch.zeros(4, 6, requires_grad=True)[:, 1:5]
    before = out.detach().clone()
    with pytest.raises(ValueError, match="^out "):
        OUT_OPS[op](x, out, tier)
    assert torch.equal(out.detach(), before)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("op", sorted(OUT_OPS))
def test_out_overlapping_the_input_is_refused_before_writing(op: str, tier: str) -> None:
    cols = IN_COLS[op]
    base = _randn(4, cols + 1)
    x, out = base[:, :cols], base[:, 1:5]  # shifted by one column: every row overlaps
    before = base.clone()
    with pytest.raises(ValueError, match="overlaps x"):
        OUT_OPS[op](x, out, tier)
    assert torch.equal(base, before)


@pytest.mark.parametrize("tier", TIERS)
def test_in_place_elementwise_is_fine(tier: str) -> None:
    x = _randn(4, 8)
    ref = F.gelu(x, approximate="tanh")
    slices.gelu_tanh_into(x, x, tier=tier)
    torch.testing.assert_close(x, ref, rtol=0, atol=1e-6)
    assert slices.copy_into(x, x, tier=tier) is x


@pytest.mark.parametrize("tier", TIERS)
def test_inference_tensors_inside_inference_mode_are_fine(tier: str) -> None:
    with torch.inference_mode():
        x, out = _randn(4, 8), torch.zeros(4, 4)
        swiglu.swiglu(x, out=out, tier=tier)
        torch.testing.assert_close(out, F.silu(x[:, :4]) * x[:, 4:], rtol=0, atol=1e-6)


# ---- arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_zero_size_tensors_in_every_tier(tier: str) -> None:
    w = torch.ones(8)
    for B, S in ((1, 0), (0, 4)):
        q = torch.zeros(B, S, 2, 8)
        cos = torch.zeros(S, 8)
        out_q, out_k, _ = qk_norm_rope.qk_norm_rope(q, q.clone(), cos, cos, q_weight=w, k_weight=w, eps_q=1e-6,
                                                    eps_k=1e-6, tier=tier)
        assert out_q.shape == out_k.shape == (B, S, 2, 8)


@pytest.mark.parametrize("call, message", [
    (lambda: modulate.gate_residual(torch.ones(2, 3, 8), None, torch.ones(2, 3, 8)), "gate"),
    (lambda: modulate.gate_residual_layer_norm_modulate(torch.ones(2, 3, 8), None, torch.ones(2, 3, 8),
                                                        torch.ones(2, 8), torch.ones(2, 8)), "gate"),
    (lambda: qk_norm_rope.qk_norm_rope(*[_qk_args()[n] for n in ("q", "k", "cos", "sin")],
                                       q_weight=torch.ones(8), k_weight=torch.ones(8), eps_q=None, eps_k=1e-6),
     "eps_q"),
    (lambda: qk_norm_rope.qk_norm_rope(*[_qk_args()[n] for n in ("q", "k", "cos", "sin")],
                                       q_weight=torch.ones(8), k_weight=torch.ones(8), eps_q=1e-6, eps_k=1e-6,
                                       v="v"), "v must be"),
])
def test_bad_arguments_raise_value_error_naming_them(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
