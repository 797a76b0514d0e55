"""The SD3 eager fusion patterns: sd3_qk_norm (JointAttnProcessor2_0) and sd3_block (JointTransformerBlock).

On tiny SD3.5-style transformers (CPU; ``sd3-fused``: 2 blocks, the last ``context_pre_only``, RMSNorm q/k;
``sd3-dual``: block 0 with SD3.5-medium's dual attention): the fused path (a forced tier stands in for the
GPU) computes what diffusers computes, bit for bit with the PyTorch tier; every call form it does not cover
runs diffusers' code; under torch.compile the patterns step aside (same Inductor kernels). Op call counters
(``calls``, tests/patches/conftest.py) show which path ran. The registry's promises (fingerprints, revert by
identity) are checked for every pattern in ``FUSED`` by test_fused_patches.py, the step-aside cases shared by
every model (forward AD, vmap/jvp, autocast) by test_fused_step_aside.py, a prompt needing grad by
test_fused_patches_hostile.py.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import DEVICE, FUSED, exact_run, reverted, run, run_hooked, tiny  # noqa: E402
from diffusers.models import attention, attention_processor, normalization  # noqa: E402,F401
from harness import build_model, registry, tiny_inputs  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

#: Fused op calls per forward with every pattern on. sd3-fused: block 0 norm1, norm1_context, 2 x
#: (residual + norm2, residual) ; block 1 (context_pre_only) norm1, norm1_context (continuous),
#: residual + norm2, residual; norm_out. sd3-dual: block 0's SD35AdaLayerNormZeroX is two adaLN calls and
#: its attn + residual one more residual; attn2 is one more q/k call.
EXPECTED = {
    "sd3-fused": registry.FAMILIES["sd3"].calls,  # {"modulate": 11, "qk_norm_rope": 2}
    "sd3-dual": {"modulate": 13, "qk_norm_rope": 3},
}


def model_and_inputs(name: str, dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    if name == "sd3-fused":
        return tiny("sd3", dtype)
    inputs = tiny_inputs(name, dtype=dtype, device=DEVICE)
    inputs.pop("return_dict")
    return build_model(name, dtype=dtype, device=DEVICE), inputs


# ---- the fused path computes what diffusers computes ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["sd3-dual"])  # sd3-fused: test_fused_families.py
def test_fused_path_equals_diffusers(name: str, dtype: torch.dtype, calls: Dict[str, int]) -> None:
    """PyTorch tier forced: the rearranged code (one call for four norms and three concats, the attention
    on token-major views, the gate/residual/norm2 glue) gives diffusers' values bit for bit."""
    model, inputs = model_and_inputs(name, dtype)
    ref = reverted(model, inputs)
    assert not calls, "the vanilla run must not reach the fused ops"
    out = exact_run(model, inputs)
    assert dict(calls) == EXPECTED[name]
    assert torch.equal(out, ref)


@pytest.mark.parametrize(("name", "dtype"), [("sd3-fused", torch.float32), ("sd3-dual", torch.bfloat16)])
def test_triton_kernels_in_the_model(name: str, dtype: torch.dtype, calls: Dict[str, int]) -> None:
    """The Triton kernels (interpreter) inside the model: fp32 within 1e-5 (reduction order), bf16 within
    the one-ulp differences of the fused LayerNorm / RMSNorm carried through two blocks of bf16 GEMMs."""
    pytest.importorskip("triton")
    model, inputs = model_and_inputs(name, dtype)
    ref = reverted(model, inputs)
    with force_tier("triton"):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED[name]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_a_batch_of_two(calls: Dict[str, int]) -> None:
    """Batch 2 (classifier-free guidance): the attention output's image/text slices are not one block of
    rows any more; the PyTorch tier bit for bit (the kernels' batch strides: tests/ops, B in 1..2)."""
    model, inputs = tiny("sd3")
    g = torch.Generator().manual_seed(7)
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        x = inputs[key]
        inputs[key] = torch.cat([x, torch.randn(x.shape, generator=g).to(x)])
    inputs["timestep"] = torch.tensor([500, 20], device=DEVICE)
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED["sd3-fused"]
    assert torch.equal(out, ref)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU the automatic tier is the kernels'")
def test_cpu_without_a_forced_tier_runs_diffusers(calls: Dict[str, int]) -> None:
    model, inputs = tiny("sd3")
    assert torch.equal(run(model, inputs), reverted(model, inputs))
    assert not calls


@pytest.mark.parametrize("off", ["sd3_qk_norm", "sd3_block", "adaln"])
def test_each_pattern_off_alone_still_equal(off: str, calls: Dict[str, int]) -> None:
    model, inputs = tiny("sd3")
    ref = reverted(model, inputs)
    with force_tier("torch"), torchpatches.disabled(off):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    # sd3_qk_norm off: no q/k calls; sd3_block off: the adaLN modules only (2 + 2 + norm_out);
    # adaln off: the block's residuals stay fused, norm2 + modulate run as torch ops (4 + 2).
    want = {"sd3_qk_norm": (11, 0), "sd3_block": (5, 2), "adaln": (6, 2)}[off]
    assert (calls["modulate"], calls["qk_norm_rope"]) == want


def test_sd3_without_qk_norm_keeps_its_concat(calls: Dict[str, int]) -> None:
    """SD3.0-style attention (no q/k norm): the processor runs diffusers' code, the blocks stay fused."""
    model = build_model("sd3", device=DEVICE)
    inputs = tiny_inputs("sd3", device=DEVICE)
    inputs.pop("return_dict")
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    assert calls["qk_norm_rope"] == 0 and calls["modulate"] == 5  # 1 context_pre_only block + norm_out


# ---- call forms the fused paths do not cover: diffusers' code -------------------------------------------


def _processor_call(extra: Dict[str, Any], calls: Dict[str, int]) -> None:
    model, _ = tiny("sd3")
    attn = model.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 6, 32, generator=g).to(DEVICE)
    e = torch.randn(1, 3, 32, generator=g).to(DEVICE)
    with torch.no_grad():
        with torchpatches.disabled(*FUSED):
            ref = attn.processor(attn, x, e, **extra)
        with force_tier("torch"):
            got = attn.processor(attn, x, e, **extra)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("extra", [
    dict(attention_mask=torch.ones(1, 9, dtype=torch.bool)),  # the original ignores masks: so it says
    dict(scale=0.5),  # an argument the processor takes through **kwargs
], ids=["mask", "extra kwarg"])
def test_arguments_it_does_not_handle_get_diffusers_code(extra: Dict[str, Any], calls: Dict[str, int]) -> None:
    _processor_call(extra, calls)
    assert not calls


def test_the_processor_alone_is_fused(calls: Dict[str, int]) -> None:
    _processor_call({}, calls)
    assert calls["qk_norm_rope"] == 1


def _spy(seen: collections.Counter, name: str) -> Callable[..., None]:
    return lambda module, args, out: seen.update([name])


def test_forward_hooks_get_diffusers_code(calls: Dict[str, int]) -> None:
    model, inputs = tiny("sd3")
    ref = reverted(model, inputs)
    seen: collections.Counter = collections.Counter()
    block = model.transformer_blocks[0]
    hooks = [block.attn.norm_added_k.register_forward_hook(_spy(seen, "norm_added_k")),
             block.norm2.register_forward_hook(_spy(seen, "norm2"))]
    out = run_hooked(model, inputs, hooks, force_tier("torch"))
    assert torch.equal(out, ref)
    assert seen == {"norm_added_k": 1, "norm2": 1}
    # The hooked processor fell back (block 1's did not); block 0's norm2 ran as a module (residual only).
    assert calls["qk_norm_rope"] == 1 and calls["modulate"] == 11


@pytest.mark.parametrize("how", ["hooked", "adaln off"])
def test_dual_attention_norm1_runs_diffusers_code_when_not_served(how: str, calls: Dict[str, int]) -> None:
    """SD35AdaLayerNormZeroX is rewritten by sd3_block only while adaln is on and it is stock and unhooked."""
    model, inputs = model_and_inputs("sd3-dual")
    seen: collections.Counter = collections.Counter()
    norm1 = model.transformer_blocks[0].norm1
    if how == "hooked":
        norm1.register_forward_hook(_spy(seen, "norm1"))
    ref = reverted(model, inputs)
    seen.clear()
    with force_tier("torch"), (torchpatches.disabled("adaln") if how == "adaln off" else contextlib.nullcontext()):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    if how == "hooked":
        assert seen == {"norm1": 1} and calls["modulate"] == EXPECTED["sd3-dual"]["modulate"] - 2
    else:  # no adaLN / LayerNorm kernels; residuals fused: block 0 five (dual: one more), block 1 two
        assert calls["modulate"] == 7


@pytest.mark.parametrize("case", ["attention subclass", "norm subclass", "parallel config", "chunked ff"])
def test_modules_it_would_skip_or_forms_it_does_not_serve(case: str, calls: Dict[str, int]) -> None:
    model, inputs = tiny("sd3")
    block = model.transformer_blocks[0]
    if case == "attention subclass":
        block.attn.__class__ = type("MyAttention", (attention_processor.Attention,), {})
    elif case == "norm subclass":
        block.attn.norm_q.__class__ = type("MyRMSNorm", (normalization.RMSNorm,), {})
    elif case == "parallel config":
        block.attn.processor = attention_processor.JointAttnProcessor2_0()
        block.attn.processor._parallel_config = object()
    else:
        block.set_chunk_feed_forward(2, dim=1)
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    if case == "chunked ff":
        assert calls["modulate"] == 2 + 4 + 1 and calls["qk_norm_rope"] == 2  # block 0's glue: diffusers'
    else:
        assert calls["qk_norm_rope"] == 1 and calls["modulate"] == 11


def _half(real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda *args, **kwargs: real(*args, **kwargs) * 0.5


REBINDS = {
    "RMSNorm.forward": (normalization.RMSNorm, "forward", _half),
    "F.layer_norm": (torch.nn.functional, "layer_norm", _half),
    "torch.cat": (torch, "cat", lambda real: lambda tensors, dim=0: real(list(tensors), dim=dim) + 1),
}


@pytest.mark.parametrize("case", sorted(REBINDS))
def test_a_rebound_global_is_what_runs(case: str, monkeypatch: pytest.MonkeyPatch, calls: Dict[str, int]) -> None:
    """A user's replacement of a function the fused stretch skips: the stretch runs diffusers' code with it."""
    owner, name, make = REBINDS[case]
    model, inputs = tiny("sd3")
    with monkeypatch.context() as rebound:
        rebound.setattr(owner, name, make(getattr(owner, name)))
        ref = reverted(model, inputs)  # re-applying skips what verifies the rebound function (sd3_qk_norm)
        with force_tier("torch"):
            out = run(model, inputs)
    assert torch.equal(out, ref)
    if case == "F.layer_norm":  # the block's glue and the adaLN modules step aside; the q/k stretch does not
        assert calls["modulate"] == 0 and calls["qk_norm_rope"] == 2
    else:
        assert calls["qk_norm_rope"] == 0 and calls["modulate"] == 11
    torchpatches.apply()  # with the user's function gone, every pattern applies again (and later tests see them)
    assert all(torchpatches.status()[name].state.value == "applied" for name in ("sd3_qk_norm", "sd3_block", "adaln"))


# ---- torch.compile: the patterns step aside -------------------------------------------------------------


@pytest.mark.slow
def test_compile_same_kernels_and_outputs(calls: Dict[str, int], record_property: Callable[[str, Any], None],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUX's compile case (test_fused_patches.py) on tiny sd3-fused: same Inductor kernels, same outputs."""
    import test_fused_patches as flux

    monkeypatch.setitem(flux.MODELS, "sd3", lambda: tiny("sd3"))
    flux.test_compile_same_kernels_and_outputs("sd3", calls, record_property)
