"""Where the fused patterns (and the rope patch) must step aside so diffusers' own code runs.

Each case compares the patched tiny FLUX.1 / FLUX.2 with the same model and the patches reverted, on CPU
with the PyTorch tier forced (the fused path allowed on CPU), and with the Triton tier (Triton's CPU
interpreter) where triton is installed:

- forward-mode AD (dual tensors): the tangent must be diffusers';
- functorch transforms (``vmap``, ``jvp``): no crash, diffusers' values;
- ``torch.jit.trace``: diffusers' graph, and no TracerWarning raised from torchpatches' code;
- autocast: diffusers' result dtype;
- a global the replaced stretch looks up at call time, rebound by a user: what diffusers computes with it.
"""
from __future__ import annotations

import re

import warnings
from typing import Any, Callable, Dict, Iterator

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import DEVICE, FUSED, MODELS, latents, output, reverted, run, tiny  # noqa: E402
from diffusers.models import embeddings, normalization  # noqa: E402
from diffusers.models.transformers import (  # noqa: E402
    transformer_ideogram4, transformer_kandinsky6, transformer_krea2, transformer_ltx2, transformer_qwenimage21,
)
from diffusers.models.transformers import transformer_flux, transformer_flux2, transformer_flux3  # noqa: E402
from torchpatches.ops._modulate import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

try:
    import triton  # noqa: F401

    TIERS = ["torch", "triton"]
except ImportError:  # pragma: no cover
    TIERS = ["torch"]


@pytest.fixture(autouse=True)
def rope_on() -> Iterator[None]:
    """The rope patch applied too (on by default on CUDA): its replacement runs inside the processors'
    fallbacks, and alone in the reverted fused patterns' code."""
    was = torchpatches.status()["rope"].state.value
    torchpatches.apply("rope")
    try:
        yield
    finally:
        if was != "applied":
            torchpatches.revert("rope")


# ---- forward-mode AD ------------------------------------------------------------------------------


def _math_attention() -> Any:
    """CPU's flash attention has no forward-AD formula; the math backend has."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _tangent(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    import torch.autograd.forward_ad as fwAD

    x, passing = latents(inputs)
    direction = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype).to(DEVICE)
    with torch.no_grad(), _math_attention(), fwAD.dual_level():
        dual = fwAD.make_dual(x, direction)
        out = output(model(**passing(dual), return_dict=False))
        primal, tangent = fwAD.unpack_dual(out)
        assert tangent is not None, "the output lost its tangent"
        return torch.cat([primal.flatten(), tangent.flatten()])


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("which", MODELS)
def test_forward_ad_gets_diffusers_tangent(which: str, tier: str, calls: Dict[str, int]) -> None:
    model, inputs = tiny(which)
    with torchpatches.disabled(*FUSED, "rope"):
        ref = _tangent(model, inputs)
    with force_tier(tier):
        got = _tangent(model, inputs)
    assert torch.equal(got, ref)
    assert not calls, dict(calls)


@pytest.mark.parametrize("tier", TIERS)
def test_rope_patch_alone_gets_diffusers_tangent(tier: str) -> None:
    """The rope patch's kernel writes results autograd's forward mode cannot see: diffusers' function runs."""
    from torchpatches.ops import _rope as rope

    model, inputs = tiny("flux2")
    with torchpatches.disabled(*FUSED, "rope"):
        ref = _tangent(model, inputs)
    with torchpatches.disabled(*FUSED), rope.force_tier(tier):
        got = _tangent(model, inputs)
    assert torch.equal(got, ref)


# ---- functorch transforms -------------------------------------------------------------------------


def _vmapped(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    x, passing = latents(inputs)
    batch = torch.stack([x, x * 0.5])

    def one(hidden_states: torch.Tensor) -> torch.Tensor:
        return output(model(**passing(hidden_states), return_dict=False))

    # The math backend: under vmap diffusers' QwenImage mask stays unbatched, which CUDA's memory-efficient SDPA
    # kernel refuses ("attn_bias: wrong shape") with every patch off too.
    with torch.no_grad(), _math_attention():
        return torch.func.vmap(one)(batch)


def _jvp(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    x, passing = latents(inputs)

    def f(hidden_states: torch.Tensor) -> torch.Tensor:
        return output(model(**passing(hidden_states), return_dict=False))

    with torch.no_grad(), _math_attention():
        out, tangent = torch.func.jvp(f, (x,), (torch.ones_like(x),))
    return torch.cat([out.flatten(), tangent.flatten()])


@pytest.mark.parametrize("transform", [_vmapped, _jvp], ids=["vmap", "jvp"])
@pytest.mark.parametrize("which", MODELS)
def test_functorch_transforms_get_diffusers_code(which: str, transform: Callable[..., torch.Tensor],
                                                 calls: Dict[str, int]) -> None:
    model, inputs = tiny(which)
    try:
        with torchpatches.disabled(*FUSED, "rope"):
            ref = transform(model, inputs)
    except RuntimeError as error:  # Z-Image under vmap: diffusers' pad_sequence has no batching rule
        with force_tier("torch"), pytest.raises(RuntimeError, match=re.escape(str(error).splitlines()[0])):
            transform(model, inputs)
    else:
        with force_tier("torch"):
            got = transform(model, inputs)
        assert torch.equal(got, ref)
    assert not calls, dict(calls)


# ---- torch.jit.trace ------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_jit_trace_gets_diffusers_code_and_no_tracer_warnings_from_torchpatches(tier: str,
                                                                                calls: Dict[str, int]) -> None:
    model, inputs = tiny("flux2")
    ref = reverted(model, inputs)
    names = sorted(inputs)

    def f(*args: torch.Tensor) -> torch.Tensor:
        return model(**dict(zip(names, args)), return_dict=False)[0]

    with force_tier(tier), torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        traced = torch.jit.trace(f, tuple(inputs[n] for n in names), check_trace=False)
    ours = [w for w in seen if issubclass(w.category, torch.jit.TracerWarning) and "torchpatches" in w.filename]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours[:5]]
    assert not calls, dict(calls)
    with torch.no_grad():
        assert torch.equal(traced(*(inputs[n] for n in names)), ref)


# ---- autocast -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_autocast_gets_diffusers_result_dtype(tier: str, calls: Dict[str, int]) -> None:
    """CPU autocast runs LayerNorm in fp32 (as CUDA autocast does): diffusers' adaLN returns fp32 there."""
    norm = normalization.AdaLayerNormZero(32).to(DEVICE, torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 32, generator=gen).to(DEVICE, torch.bfloat16)
    emb = torch.randn(2, 32, generator=gen).to(DEVICE, torch.bfloat16)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        with torchpatches.disabled("adaln"):
            ref = norm(x, emb=emb)
        with force_tier(tier):
            got = norm(x, emb=emb)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and torch.equal(g, r)
    assert not calls, dict(calls)


@pytest.mark.parametrize("which", MODELS)
def test_autocast_whole_model_equals_diffusers(which: str, calls: Dict[str, int]) -> None:
    model, inputs = tiny(which, torch.bfloat16)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        ref = reverted(model, inputs)
        with force_tier("torch"):
            got = run(model, inputs)
    assert got.dtype == ref.dtype and torch.equal(got, ref)
    assert not calls, dict(calls)


# ---- globals the replaced code looks up at call time ----------------------------------------------


def _identity_rope(x: torch.Tensor, freqs_cis: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x  # a user's ablation: no rotary embedding


def _half_layer_norm(real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda *args, **kwargs: real(*args, **kwargs) * 0.5


REBINDS = {
    "flux1 apply_rotary_emb": ("flux1", transformer_flux, "apply_rotary_emb", lambda real: _identity_rope),
    "flux2 apply_rotary_emb": ("flux2", transformer_flux2, "apply_rotary_emb", lambda real: _identity_rope),
    "F.layer_norm": ("flux1", torch.nn.functional, "layer_norm", _half_layer_norm),
    "F.rms_norm": ("flux2", torch.nn.functional, "rms_norm", _half_layer_norm),
    "F.gelu": ("flux1", torch.nn.functional, "gelu", lambda real: lambda x, approximate="none": real(x)),
    "torch.cat": ("flux1", torch, "cat", lambda real: lambda tensors, dim=0: real(list(tensors), dim=dim) + 1),
    "wan F.layer_norm": ("wan", torch.nn.functional, "layer_norm", _half_layer_norm),
    "wan F.rms_norm": ("wan", torch.nn.functional, "rms_norm", _half_layer_norm),
    "wan22-ti2v F.layer_norm": ("wan22-ti2v", torch.nn.functional, "layer_norm", _half_layer_norm),
    "zimage RMSNorm.forward": ("zimage", normalization.RMSNorm, "forward", _half_layer_norm),
    "ideogram4 F.silu": ("ideogram4", torch.nn.functional, "silu", lambda real: lambda x, inplace=False: real(x) * 0.5),
    "ideogram4 _rotate_half": ("ideogram4", transformer_ideogram4, "_rotate_half", lambda real: lambda x: real(x) * 0.5),
    # the rope patch's own target, where HunyuanVideo 1.5's processor reads it: reverted (reverted()) under the user's
    # function, the rope patch must leave FLUX's alias of it the original, not the user's function (tests after this
    # one once found FLUX without RoPE)
    "hunyuanvideo15 apply_rotary_emb": ("hunyuanvideo15", embeddings, "apply_rotary_emb", lambda real: _identity_rope),
    # a pad of another value: the mask's image positions masked out
    "hunyuanvideo15 F.pad": ("hunyuanvideo15", torch.nn.functional, "pad",
                             lambda real: lambda x, pad, mode="constant", value=None: real(
                                 x, pad, mode, False if value is True else value)),
    "krea2 apply_rotary_emb": ("krea2", transformer_krea2, "apply_rotary_emb", lambda real: _identity_rope),
    "krea2 Krea2RMSNorm.forward": ("krea2", transformer_krea2.Krea2RMSNorm, "forward", _half_layer_norm),
    "krea2 F.silu": ("krea2", torch.nn.functional, "silu", lambda real: lambda x, inplace=False: real(x) * 0.5),
    "kandinsky6 apply_rotary": ("kandinsky6", transformer_kandinsky6, "apply_rotary", lambda real: lambda x, rope: x),
    "kandinsky6 apply_gate_sum": ("kandinsky6", transformer_kandinsky6, "apply_gate_sum",
                                  lambda real: lambda x, out, gate: real(x, out, gate * 0.5)),
    "kandinsky6 apply_scale_shift": ("kandinsky6", transformer_kandinsky6, "apply_scale_shift",
                                     lambda real: lambda normed, x, scale, shift: real(normed, x, scale, shift * 0)),
    "kandinsky6 F.rms_norm": ("kandinsky6", torch.nn.functional, "rms_norm", _half_layer_norm),
    "kandinsky6 F.layer_norm": ("kandinsky6", torch.nn.functional, "layer_norm", _half_layer_norm),
    "flux3 apply_rotary_emb": ("flux3", transformer_flux3, "apply_rotary_emb", lambda real: _identity_rope),
    "flux3 F.rms_norm": ("flux3", torch.nn.functional, "rms_norm", _half_layer_norm),
    "flux3 F.layer_norm": ("flux3", torch.nn.functional, "layer_norm", _half_layer_norm),
    "flux3 F.silu": ("flux3", torch.nn.functional, "silu", lambda real: lambda x, inplace=False: real(x) * 0.5),
    "flux3 torch.cat": ("flux3", torch, "cat", lambda real: lambda tensors, dim=0: real(list(tensors), dim=dim) + 1),
    "qwenimage21 apply_rotary_emb_qwen": ("qwenimage21", transformer_qwenimage21, "apply_rotary_emb_qwen",
                                          lambda real: lambda x, freqs, use_real=True, use_real_unbind_dim=-1: x),
    "qwenimage21 _select_modulation_rows": ("qwenimage21", transformer_qwenimage21, "_select_modulation_rows",
                                            lambda real: lambda params, mask: real(params, mask) * 0.5),
    "qwenimage21 F.silu": ("qwenimage21", torch.nn.functional, "silu",
                           lambda real: lambda x, inplace=False: real(x) * 0.5),
    "ltx2 apply_split_rotary_emb": ("ltx2", transformer_ltx2, "apply_split_rotary_emb", lambda real: lambda x, f: x),
    "ltx2 RMSNorm.forward": ("ltx2", normalization.RMSNorm, "forward", _half_layer_norm),
    "ltx2 F.rms_norm": ("ltx2", torch.nn.functional, "rms_norm", _half_layer_norm),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", sorted(REBINDS))
def test_a_rebound_global_is_what_runs(case: str, tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PyTorch tier calls some of the same functions (so it may agree by accident); the kernels do not.
    With the kernels the patterns the rebinding does not concern still run: fp32 kernels differ from torch's
    ops in the last bits (reduction order, fused multiply-adds), a skipped user function by 1e-2 or more."""
    which, owner, name, make = REBINDS[case]
    model, inputs = tiny(which)
    monkeypatch.setattr(owner, name, make(getattr(owner, name)))
    ref = reverted(model, inputs)
    with force_tier(tier), torchpatches.disabled("rope"):  # the rope kernel may differ by an fp32 fma
        got = run(model, inputs)
    if tier == "torch":
        assert torch.equal(got, ref), case
    else:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_globals_put_back_fuse_again(monkeypatch: pytest.MonkeyPatch, calls: Dict[str, int]) -> None:
    """The check is per call: with the user's function gone, the fused path runs again."""
    model, inputs = tiny("flux1")
    with monkeypatch.context() as m:
        m.setattr(transformer_flux, "apply_rotary_emb", _identity_rope)
        with force_tier("torch"):
            run(model, inputs)
    assert calls["qk_norm_rope"] == 0
    with force_tier("torch"):
        assert torch.equal(run(model, inputs), reverted(model, inputs))
    assert calls["qk_norm_rope"] == 3


@pytest.mark.parametrize("which", MODELS)
def test_training_gets_diffusers_code(which: str, calls: Dict[str, int]) -> None:
    """Parameters that want gradients (training, a LoRA being trained): every fused pattern hands the call back."""
    model, inputs = tiny(which)
    model.requires_grad_(True)
    try:
        with torch.enable_grad(), force_tier("torch"):
            got = output(model(**inputs, return_dict=False))
        with torch.enable_grad(), torchpatches.disabled(*FUSED, "rope"):
            ref = output(model(**inputs, return_dict=False))
    finally:
        model.requires_grad_(False)
    assert got.requires_grad and torch.equal(got.detach(), ref.detach())
    assert not calls, dict(calls)


@pytest.mark.parametrize("name", ["flux1", "flux2", "sd3"])
def test_a_removed_q_norm_fails_or_runs_as_diffusers_does(name: str) -> None:
    """``attn.norm_q = None``: FLUX's processors call their norms unconditionally (a TypeError there), SD3's skip a
    None norm; the shared attention body's fallback stretch does what each one does."""
    model, inputs = tiny(name, torch.float32)
    model.transformer_blocks[0].attn.norm_q = None
    outcomes = []
    for context in (torchpatches.disabled(), force_tier("torch")):
        with context:
            try:
                outcomes.append(run(model, inputs))
            except TypeError as error:
                outcomes.append(type(error))
    if name == "sd3":
        assert torch.equal(outcomes[0], outcomes[1])
    else:
        assert outcomes == [TypeError, TypeError]
