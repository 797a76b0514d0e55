"""The eager fusion patches: adaln, qk_norm_rope, gate_residual, gelu_gemm, swiglu.

On tiny FLUX.1 / FLUX.2 transformers (CPU): the fused path (a forced tier stands in for the GPU)
computes what diffusers computes; without a forced tier the CPU runs diffusers' own code; LoRA layers,
forward hooks (torch's, diffusers' hook registry, accelerate's), gradients and torch.compile get
diffusers' code; the registry's promises hold per pattern (fingerprints, revert by identity,
``disabled()``, ``TORCHPATCHES_DISABLE``). Op call counters show which path ran.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, Iterator, Tuple

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import (DEVICE, FUSED, LORA, exact, repeatable_inductor, reverted, run, run_hooked, same,  # noqa: E402
                           tiny)
from diffusers.models import activations, normalization  # noqa: E402,F401  (the patch targets load)
from diffusers.models.transformers import transformer_flux, transformer_flux2  # noqa: E402,F401
from torchpatches._core import gates as _gates  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402
from torchpatches.patches import _single_stream  # noqa: E402
from harness import count_kernels, registry  # noqa: E402

VERIFIED = "0.42.1"


def _patch(name: str):
    import importlib

    return importlib.import_module(f"torchpatches.patches.{name}").PATCH


pytestmark = pytest.mark.usefixtures("fused_on")


def tiny_flux1(dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    return tiny("flux1", dtype)


def tiny_flux2(dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    return tiny("flux2", dtype)


MODELS = {"flux1": tiny_flux1, "flux2": tiny_flux2}
#: Fused op calls per forward of the tiny models (1 double + 2 single blocks) with every pattern on (the registry's;
#: modulate: double 2 adaLN + 2 residual+LN + 2 residual, single 2 x (adaLN + residual), norm_out).
EXPECTED = {name: registry.FAMILIES[name].calls for name in MODELS}


def vanilla(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    """diffusers with the patches reverted: the fused patterns and ``rope`` (whose automatic tier would
    otherwise differ from the forced one the patched run gets: one forced-tier switch serves all ops)."""
    return reverted(model, inputs)


# ---- declarations and registry promises -------------------------------------------------------


@pytest.mark.parametrize("name", FUSED)
def test_applied_with_verified_fingerprints_and_revert_by_identity(name: str) -> None:
    import importlib

    patch = _patch(name)
    assert torchpatches.status()[name].state.value == "applied", str(torchpatches.status()[name])
    for target in patch.targets:
        module_name, qualname = target.path.split(":")
        cls_name, attr = qualname.split(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        replacement = vars(cls)[attr]
        original = replacement.__torchpatches_original__
        assert replacement.__torchpatches_patch__ == name
        if diffusers.__version__ == VERIFIED:
            assert _gates.fingerprint(original) in target.fingerprints
        with torchpatches.disabled(name):
            assert vars(cls)[attr] is original
        assert vars(cls)[attr] is replacement  # re-applied: the same replacement object
        torchpatches.revert(name)
        assert vars(cls)[attr] is original
        torchpatches.apply(name)
        assert vars(cls)[attr] is replacement


# TORCHPATCHES_DISABLE read in a fresh process: the registry's, the same on every torch release
@pytest.mark.once
def test_env_disables_single_patterns() -> None:
    code = textwrap.dedent(
        """
        import torchpatches
        from diffusers.models import normalization
        from diffusers.models.transformers import transformer_flux2
        s = torchpatches.status()
        assert s["adaln"].state.value == "disabled", s["adaln"]
        assert s["swiglu"].state.value == "disabled", s["swiglu"]
        for name in ("qk_norm_rope", "gate_residual", "gelu_gemm"):
            assert s[name].state.value == "applied", s[name]
        assert not hasattr(normalization.AdaLayerNormZero.forward, "__torchpatches_patch__")
        assert not hasattr(transformer_flux2.Flux2SwiGLU.forward, "__torchpatches_patch__")
        assert transformer_flux2.Flux2TransformerBlock.forward.__torchpatches_patch__ == "gate_residual"
        """
    )
    env = dict(os.environ, TORCHPATCHES_DISABLE="adaln, swiglu", PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_patch_modules_import_nothing_heavy() -> None:
    code = textwrap.dedent(
        """
        import sys
        import torch
        import torchpatches
        import torchpatches.patches.adaln, torchpatches.patches.qk_norm_rope, torchpatches.patches.gate_residual
        import torchpatches.patches.gelu_gemm, torchpatches.patches.swiglu
        import torchpatches.patches.qwenimage_block, torchpatches.patches.qwenimage_qk_norm_rope
        heavy = [m for m in ("diffusers", "triton", "torch._dynamo", "torch._inductor") if m in sys.modules]
        assert not heavy, heavy
        # the ops register torch.library ops when imported (~18 ms): they load with a patch's target; the
        # skeleton's tier switch (torch and the standard library only, registers nothing) loads with the patches
        ops = [m for m in sys.modules if m.startswith("torchpatches.ops") and m not in (
            "torchpatches.ops", "torchpatches.ops._runtime", "torchpatches.ops._runtime.tiers")]
        assert not ops, ops
        assert not hasattr(torch.ops.torchpatches, "modulate")
        # replacement code loads with its target (patches/_bodies): none of it is compiled by the import
        bodies = [m for m in sys.modules if m.startswith("torchpatches.patches._bodies.")]
        assert not bodies, bodies
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---- the fused path computes what diffusers computes ------------------------------------------


# Bit for bit with the PyTorch tier, within an ulp with the kernels, the op calls: test_fused_families.py.


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU the automatic tier is the kernels'")
@pytest.mark.parametrize("which", sorted(MODELS))
def test_cpu_without_a_forced_tier_runs_diffusers(which: str, calls: Dict[str, int]) -> None:
    model, inputs = MODELS[which]()
    assert torch.equal(run(model, inputs), vanilla(model, inputs))
    assert not calls


@pytest.mark.parametrize("off", FUSED)
def test_each_pattern_off_alone_still_equal(off: str, calls: Dict[str, int]) -> None:
    for which in sorted(MODELS):
        model, inputs = MODELS[which]()
        ref = vanilla(model, inputs)
        with force_tier("torch"), torchpatches.disabled(off):
            out = run(model, inputs)
        assert torch.equal(out, ref), (which, off)
    if off == "adaln":
        # gate_residual still fuses gate + residual, but no LayerNorm: FLUX.1's and FLUX.2's inline
        # LN + modulate run as torch ops, so only residual-only calls remain (2 + 2 + 2 per model).
        assert calls["modulate"] == 12


def test_gate_residual_off_leaves_adaln_modules_only(calls: Dict[str, int]) -> None:
    model, inputs = tiny_flux1()
    with force_tier("torch"), torchpatches.disabled("gate_residual"):
        run(model, inputs)
    # AdaLayerNormZero x2, AdaLayerNormZeroSingle x2, AdaLayerNormContinuous x1; no residual kernels
    assert calls["modulate"] == 5 and calls["slices"] == 0


# ---- never in the way ------------------------------------------------------------------------


def test_forward_hooks_get_diffusers_code(calls: Dict[str, int]) -> None:
    model, inputs = tiny_flux1()
    ref = vanilla(model, inputs)
    seen = collections.Counter()
    block, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    hooks = [
        block.norm2.register_forward_hook(lambda m, a, o: seen.update(["norm2"])),
        block.attn.norm_q.register_forward_hook(lambda m, a, o: seen.update(["norm_q"])),
        single.act_mlp.register_forward_pre_hook(lambda m, a: seen.update(["act_mlp"])),
        single.norm.norm.register_forward_hook(lambda m, a, o: seen.update(["single_norm"])),
    ]
    out = run_hooked(model, inputs, hooks, force_tier("torch"))
    assert torch.equal(out, ref)
    assert seen == {"norm2": 1, "norm_q": 1, "act_mlp": 1, "single_norm": 1}
    # The hooked block / processor / norm fell back; the other single block and the norm_out did not.
    assert calls["qk_norm_rope"] == 2 and calls["slices"] == 2


def test_global_hooks_get_diffusers_code(calls: Dict[str, int]) -> None:
    model, inputs = tiny_flux2()
    ref = vanilla(model, inputs)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        with force_tier("torch"):
            out = run(model, inputs)
    finally:
        handle.remove()
    assert torch.equal(out, ref) and not calls and "RMSNorm" in seen


def test_diffusers_hook_registry_gets_diffusers_code(calls: Dict[str, int]) -> None:
    """diffusers' own hooks (group offloading, layerwise casting, caches) replace the instance's forward."""
    from diffusers.hooks import HookRegistry, ModelHook

    model, inputs = tiny_flux2()
    ref = vanilla(model, inputs)
    seen = []

    class Spy(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(type(module).__name__)
            return args, kwargs

    block = model.transformer_blocks[0]
    HookRegistry.check_if_exists_or_initialize(block.norm2).register_hook(Spy(), "spy")
    HookRegistry.check_if_exists_or_initialize(block.ff.act_fn).register_hook(Spy(), "spy")
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    assert seen == ["LayerNorm", "Flux2SwiGLU"]
    # A hook on the module whose forward *is* the replacement runs around it (diffusers' registry wraps
    # the bound forward), so that SwiGLU stays fused: all 4 calls. The hooked norm2 fell back.
    assert calls["swiglu"] == 4


def test_accelerate_hooks_get_diffusers_code(calls: Dict[str, int]) -> None:
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    model, inputs = tiny_flux1()
    ref = vanilla(model, inputs)
    block = model.transformer_blocks[0]
    accelerate_hooks.add_hook_to_module(block.norm2, accelerate_hooks.ModelHook())
    accelerate_hooks.add_hook_to_module(block.attn.norm_added_k, accelerate_hooks.ModelHook())
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    assert calls["qk_norm_rope"] == 2  # the double block's processor fell back


def test_lora_layers_get_their_own_code(calls: Dict[str, int]) -> None:
    """A LoRA-loaded model (peft): outputs identical to diffusers', and the LoRA really acts."""
    peft = pytest.importorskip("peft")
    model, inputs = tiny_flux1()
    base = vanilla(model, inputs)
    config = peft.LoraConfig(
        r=4, lora_alpha=4, init_lora_weights=False,
        target_modules=["to_q", "to_k", "to_v", "add_q_proj", "to_out.0", "proj_mlp", "proj_out", "ff.net.0.proj",
                        "ff.net.2", "norm1.linear", "norm.linear"],
    )
    model.add_adapter(config)
    ref = vanilla(model, inputs)
    assert not torch.equal(ref, base), "the adapter must change the output"
    with exact():
        out = run(model, inputs)
        scaled = model(**inputs, joint_attention_kwargs={"scale": 0.5}, return_dict=False)[0].detach()
    assert torch.equal(out, ref)
    with torchpatches.disabled(*FUSED):
        scaled_ref = model(**inputs, joint_attention_kwargs={"scale": 0.5}, return_dict=False)[0].detach()
    assert torch.equal(scaled, scaled_ref)
    assert calls["qk_norm_rope"] > 0  # projections are called as modules, so the fused stretch still runs


@pytest.mark.parametrize("which", sorted(LORA))
def test_lora_layers_get_their_own_code_in_every_model(which: str, calls: Dict[str, int]) -> None:
    """SD3, Wan, QwenImage with peft adapters on their usual LoRA targets: diffusers' values, the LoRA acts, and
    the fused glue still runs around the adapted projections."""
    peft = pytest.importorskip("peft")
    targets, expected = LORA[which]
    model, inputs = tiny(which)
    base = reverted(model, inputs)
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=targets))
    ref = reverted(model, inputs)
    assert not torch.equal(ref, base), "the adapter must change the output"
    with exact():
        out = run(model, inputs)
    assert same(out, ref, which)
    assert {name: calls[name] for name in expected} == expected


@pytest.mark.parametrize("which, parameter", [("flux2", "x_embedder.weight"), ("qwenimage", "img_in.weight"),
                                              ("sd3", "pos_embed.proj.weight"), ("wan", "blocks.0.scale_shift_table")])
def test_gradients_get_diffusers_code(which: str, parameter: str, calls: Dict[str, int]) -> None:
    model, inputs = tiny(which)
    model.requires_grad_(True)
    with torchpatches.disabled(*FUSED):
        ref = model(**inputs, return_dict=False)[0]
    with force_tier("torch"):
        out = model(**inputs, return_dict=False)[0]
    assert torch.equal(out, ref) and not calls
    out.sum().backward()
    assert model.get_parameter(parameter).grad is not None


# ---- the attention call without diffusers' signature lookup ------------------------------------


class _SignatureSpy:
    """Stands for the ``inspect`` module in a diffusers transformer module: counts ``signature`` calls (the
    attention ``forward``'s per-call lookup) and answers with the real one."""

    def __init__(self) -> None:
        import inspect

        self.inspect, self.calls = inspect, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inspect, name)

    def signature(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inspect.signature(*args, **kwargs)


def _spied(monkeypatch: pytest.MonkeyPatch) -> _SignatureSpy:
    spy = _SignatureSpy()
    for module in (transformer_flux, transformer_flux2):
        monkeypatch.setattr(module, "inspect", spy)
    return spy


@pytest.mark.parametrize("which", sorted(MODELS))
def test_stock_attention_called_without_its_signature_lookup(which: str, calls: Dict[str, int],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """No keyword arguments and stock attention modules: the blocks call each processor as the attention's
    forward would (3 attention calls per tiny forward, none through the forward), with diffusers' result."""
    model, inputs = MODELS[which]()
    spy = _spied(monkeypatch)
    ref = vanilla(model, inputs)
    assert spy.calls == 3  # diffusers: one lookup per attention call
    spy.calls = 0
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and calls["qk_norm_rope"] == 3
    assert spy.calls == 0


@pytest.mark.parametrize("which", sorted(MODELS))
def test_attention_keyword_arguments_go_through_its_forward(which: str, calls: Dict[str, int],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``joint_attention_kwargs`` with a key the processor does not take: diffusers' forward filters it (and
    warns), in every block; the fused glue around it still runs."""
    model, inputs = MODELS[which]()
    inputs = dict(inputs, joint_attention_kwargs={"not_a_processor_argument": 1})
    spy = _spied(monkeypatch)
    ref = vanilla(model, inputs)
    spy.calls = 0
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and calls["qk_norm_rope"] == 3
    assert spy.calls == 3


def test_hooked_or_replaced_attention_goes_through_its_forward(calls: Dict[str, int],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook on one attention module fires (that block calls the module, the others do not); a replaced
    ``FluxAttention.forward`` is called by every block (the blocks run diffusers' forwards)."""
    model, inputs = tiny_flux1()
    ref = vanilla(model, inputs)
    spy = _spied(monkeypatch)
    seen = collections.Counter()
    hook = model.single_transformer_blocks[1].attn.register_forward_hook(lambda m, a, o: seen.update(["attn"]))
    out = run_hooked(model, inputs, [hook], exact())
    assert torch.equal(out, ref) and seen == {"attn": 1} and spy.calls == 1
    assert calls["qk_norm_rope"] == 3 and calls["slices"] == 4  # the hooked block's glue stays fused

    original = transformer_flux.FluxAttention.forward
    entered = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        entered.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformer_flux.FluxAttention, "forward", forward)
    calls.clear()
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and len(entered) == 3
    assert calls["slices"] == 0  # the blocks' assumption failed: diffusers' block forwards ran


def test_compiled_or_wrapped_attention_module_is_called(calls: Dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """``attn.compile()`` (its calls go to ``_compiled_call_impl``) and a ``forward`` set on the instance
    (accelerate's and diffusers' hooks) are module calls the blocks make; the other attentions still go direct."""
    model, inputs = tiny_flux1()
    ref = vanilla(model, inputs)
    spy = _spied(monkeypatch)
    compiled_attn = model.single_transformer_blocks[0].attn
    wrapped_attn = model.transformer_blocks[0].attn
    entered = []

    def compiled_call(*args: Any, **kwargs: Any) -> Any:  # stands in for torch.compile(self._call_impl)
        entered.append("compiled")
        return compiled_attn._call_impl(*args, **kwargs)

    def instance_forward(*args: Any, **kwargs: Any) -> Any:
        entered.append("instance forward")
        return type(wrapped_attn).forward(wrapped_attn, *args, **kwargs)

    monkeypatch.setattr(compiled_attn, "_compiled_call_impl", compiled_call, raising=False)
    monkeypatch.setattr(wrapped_attn, "forward", instance_forward, raising=False)
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and sorted(entered) == ["compiled", "instance forward"]
    assert spy.calls == 2 and calls["qk_norm_rope"] == 3


def test_attention_subclass_goes_through_its_forward(calls: Dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = tiny_flux1()
    ref = vanilla(model, inputs)

    class Traced(transformer_flux.FluxAttention):
        entered = 0

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            Traced.entered += 1
            return super().forward(*args, **kwargs)

    model.transformer_blocks[0].attn.__class__ = Traced
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and Traced.entered == 1


# ---- stock Linear and Dropout layers without the module call path --------------------------------

#: The layers a fused FLUX path calls as their ``forward`` would, when stock (``_fused_common.linear`` /
#: ``dropout``): the adaLN embedding linears, the attention projections and output layers, the single blocks'
#: MLP in and out (FLUX.1) and fused projection (FLUX.2), the output norm's linear.
_DIRECT = re.compile(r"^norm_out\.linear$|(transformer_blocks|single_transformer_blocks)\.\d+\."
                     r"(norm1(_context)?\.linear|norm\.linear|"
                     r"attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out(\.[01])?|to_add_out|"
                     r"to_qkv_mlp_proj)|proj_mlp|proj_out)$")


@pytest.fixture
def layer_calls() -> Iterator[collections.Counter]:
    """How often each ``nn.Linear`` / ``nn.Dropout`` ran its ``forward`` (a module call does; the direct path does
    not), by module id: observed with ``sys.setprofile``, which changes nothing a patch checks."""
    seen: collections.Counter = collections.Counter()
    forwards = {torch.nn.Linear.forward.__code__, torch.nn.Dropout.forward.__code__}

    def observe(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in forwards:
            seen[id(frame.f_locals["self"])] += 1

    previous = sys.getprofile()
    sys.setprofile(observe)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def _called(model: torch.nn.Module, seen: collections.Counter) -> set:
    return {name for name, module in model.named_modules() if seen[id(module)]}


@pytest.mark.parametrize("which", sorted(MODELS))
def test_stock_linear_and_dropout_layers_skip_the_module_call(which: str, calls: Dict[str, int],
                                                              layer_calls: collections.Counter) -> None:
    """Every layer :data:`_DIRECT` names is called as a module by diffusers and not by the fused path, which computes
    diffusers' bits; the layers the patterns leave to diffusers (embedders, feed-forwards) are still called."""
    model, inputs = MODELS[which]()
    ref = vanilla(model, inputs)
    before = _called(model, layer_calls)
    direct = {name for name in before if _DIRECT.search(name)}
    assert len(direct) == {"flux1": 24, "flux2": 14}[which], sorted(direct)
    layer_calls.clear()
    with exact():
        out = run(model, inputs)
    after = _called(model, layer_calls)
    assert torch.equal(out, ref) and calls["qk_norm_rope"] == 3
    assert after == before - direct and after  # the embedders' and feed-forwards' layers


def test_hooked_wrapped_or_subclassed_linear_is_called(calls: Dict[str, int], layer_calls: collections.Counter,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward hook, a forward pre-hook (on a Dropout), a ``forward`` on the instance, ``nn.Module.compile()`` and a
    subclass each make that layer a module call (and only that one)."""
    model, inputs = tiny_flux1()
    ref = vanilla(model, inputs)
    block = model.transformer_blocks[0]
    entered = []
    hooks = [block.attn.to_q.register_forward_hook(lambda m, a, o: entered.append("hook")),
             block.attn.to_out[1].register_forward_pre_hook(lambda m, a: entered.append("pre-hook"))]

    def instance_forward(x: torch.Tensor, _layer: Any = block.attn.to_k) -> torch.Tensor:
        entered.append("instance forward")
        return torch.nn.Linear.forward(_layer, x)

    monkeypatch.setattr(block.attn.to_k, "forward", instance_forward, raising=False)
    compiled = model.single_transformer_blocks[0].proj_out

    def compiled_call(*args: Any, **kwargs: Any) -> Any:  # stands in for torch.compile(self._call_impl)
        entered.append("compiled")
        return compiled._call_impl(*args, **kwargs)

    monkeypatch.setattr(compiled, "_compiled_call_impl", compiled_call, raising=False)

    class Traced(torch.nn.Linear):
        pass

    block.norm1.linear.__class__ = Traced
    layer_calls.clear()
    out = run_hooked(model, inputs, hooks, exact())
    assert torch.equal(out, ref) and calls["qk_norm_rope"] == 3
    assert sorted(entered) == ["compiled", "hook", "instance forward", "pre-hook"]
    assert {n for n in _called(model, layer_calls) if _DIRECT.search(n)} == {
        "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_out.1",
        "single_transformer_blocks.0.proj_out", "transformer_blocks.0.norm1.linear"}


def test_linear_with_a_plain_tensor_weight_is_called(calls: Dict[str, int], layer_calls: collections.Counter) -> None:
    """A weight deleted and set again as a plain attribute (no longer in ``_parameters``) and a bias shadowed by an
    instance attribute (what ``forward``'s ``self.bias`` reads) each make that layer a module call."""
    model, inputs = tiny_flux1()
    moved = model.single_transformer_blocks[1].proj_mlp
    weight = moved.weight.detach().clone()
    del moved.weight
    moved.weight = weight
    shadowed = model.single_transformer_blocks[0].proj_mlp
    object.__setattr__(shadowed, "bias", shadowed.bias.detach() + 1)  # forward reads this one
    ref = vanilla(model, inputs)
    layer_calls.clear()
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and calls["qk_norm_rope"] == 3
    assert {n for n in _called(model, layer_calls) if _DIRECT.search(n)} == {
        "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.1.proj_mlp"}


def _in_training(model: torch.nn.Module, inputs: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(diffusers' output, the fused path's) with the model in training mode (no grad), each after the same seed: a
    Dropout there draws random numbers, the same ones when both call it. The model is in eval mode again after."""
    model.train()
    try:
        torch.manual_seed(0)
        diffusers_out = vanilla(model, inputs)
        torch.manual_seed(0)
        with exact():
            return diffusers_out, run(model, inputs)
    finally:
        model.eval()


#: SD3 / Wan / QwenImage: the first block's attention module, whose output layers the direct path serves.
_OTHER = {"sd3": "transformer_blocks.0.attn", "wan": "blocks.0.attn1", "qwenimage": "transformer_blocks.0.attn"}


@pytest.mark.parametrize("which", sorted(_OTHER))
def test_other_models_direct_calls_hooks_and_training_dropout(which: str, layer_calls: collections.Counter) -> None:
    """SD3, Wan, QwenImage: on the fused path ``to_out[0]`` / ``to_out[1]`` are not module calls (diffusers' output);
    hooked (a forward hook, a forward pre-hook) they are, and each hook fires once; a Dropout in training mode is
    called (the same random draws as diffusers')."""
    model, inputs = tiny(which)
    ref = vanilla(model, inputs)
    attn = model.get_submodule(_OTHER[which])
    outs = {f"{_OTHER[which]}.to_out.0", f"{_OTHER[which]}.to_out.1"}
    layer_calls.clear()
    with exact():
        out = run(model, inputs)
    assert same(out, ref, which) and not outs & _called(model, layer_calls)
    entered: list = []
    hooks = [attn.to_out[0].register_forward_hook(lambda m, a, o: entered.append("hook")),
             attn.to_out[1].register_forward_pre_hook(lambda m, a: entered.append("pre-hook"))]
    layer_calls.clear()
    out = run_hooked(model, inputs, hooks, exact())
    assert same(out, ref, which) and sorted(entered) == ["hook", "pre-hook"] and outs <= _called(model, layer_calls)
    attn.to_out[1].p = 0.5
    trained, out = _in_training(model, inputs)
    assert same(out, trained, which) and not torch.equal(out, ref)


def test_dropout_in_training_mode_is_called(calls: Dict[str, int]) -> None:
    model, inputs = tiny_flux1()
    model.transformer_blocks[0].attn.to_out[1].p = 0.5
    evaluated = vanilla(model, inputs)
    ref, out = _in_training(model, inputs)
    assert torch.equal(out, ref) and not torch.equal(out, evaluated) and calls["qk_norm_rope"] == 3


def _counting(real: Callable[..., Any], seen: list) -> Callable[..., Any]:
    def replacement(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return real(*args, **kwargs)

    return replacement


#: What the direct calls stand in for: (owner, attribute) of each.
_SKIPPED_PAST = {"F.linear": (torch.nn.functional, "linear"), "Linear.forward": (torch.nn.Linear, "forward"),
                 "F.dropout": (torch.nn.functional, "dropout"), "Dropout.forward": (torch.nn.Dropout, "forward"),
                 "Linear.__call__": (torch.nn.Linear, "__call__")}


@pytest.mark.parametrize("what", sorted(_SKIPPED_PAST))
def test_replaced_call_path_is_called_as_by_diffusers(what: str, calls: Dict[str, int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A replaced ``F.linear`` / ``F.dropout`` / ``Linear.forward`` / ``Dropout.forward`` (the patterns assume them:
    diffusers' code runs) or ``Linear.__call__`` (the direct calls check it) runs as often as in diffusers' code, with
    diffusers' result."""
    model, inputs = tiny_flux1()
    ref = vanilla(model, inputs)
    owner, name = _SKIPPED_PAST[what]
    seen: list = []
    monkeypatch.setattr(owner, name, _counting(getattr(owner, name), seen), raising=False)
    vanilla(model, inputs)
    expected, seen[:] = len(seen), []
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and expected > 0 and len(seen) == expected


@pytest.mark.parametrize("what", ["Linear.forward", "Linear.__call__", "Linear._call_impl", "Dropout.forward",
                                  "Dropout.__call__"])
def test_direct_calls_only_where_the_call_path_is_torchs(what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``linear`` / ``dropout`` make the module call when the class's call path is not torch's own: replaced on the
    class (here), or replaced before torchpatches was imported (then ``_torch_own`` keeps a sentinel, and the
    patterns' assumptions hold the replacement)."""
    from torchpatches.patches import _fused_common

    cls_name, name = what.split(".")
    cls = getattr(torch.nn, cls_name)
    seen: list = []
    monkeypatch.setattr(cls, name, _counting(getattr(cls, name), seen), raising=False)
    layer = cls(4, 4) if cls is torch.nn.Linear else cls(0.5).eval()
    x = torch.randn(2, 4)
    direct = _fused_common.linear if cls is torch.nn.Linear else _fused_common.dropout
    assert torch.equal(direct(layer, x), layer(x)) and len(seen) == 2
    assert _fused_common._torch_own(seen.append, "torch.nn.modules.linear") is not seen.append
    assert _fused_common._torch_own(torch.nn.Linear.__init__, "torch.nn.modules.linear") is torch.nn.Linear.__init__


def test_replaced_projection_function_gets_diffusers_code(calls: Dict[str, int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A replaced ``_get_projections`` of the FLUX module is called by diffusers' processors (qk_norm_rope steps
    aside there: it assumes the function it stands in for)."""
    model, inputs = tiny_flux1()
    ref = vanilla(model, inputs)
    entered: list = []
    monkeypatch.setattr(transformer_flux, "_get_projections", _counting(transformer_flux._get_projections, entered))
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and len(entered) == 3 and calls["qk_norm_rope"] == 0


def test_fused_qkv_projections_take_diffusers_function(calls: Dict[str, int]) -> None:
    """After diffusers' ``fuse_qkv_projections()`` the processors read ``to_qkv`` (diffusers' own function): the
    unfused ``to_q`` weights, zeroed, change nothing; the stretch after the projections is still fused."""
    model, inputs = tiny_flux1()
    model.fuse_qkv_projections()
    ref = vanilla(model, inputs)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("attn.to_q"):
                module.weight.zero_()
    assert torch.equal(vanilla(model, inputs), ref)
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and calls["qk_norm_rope"] == 3


@pytest.mark.skipif(diffusers.__version__ != VERIFIED, reason=f"fingerprints taken on diffusers {VERIFIED}")
def test_qk_norm_rope_verifies_the_projection_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The functions ``_projections`` stands in for are fingerprinted: the installed ones match, and another source
    of one (here FLUX.2's ``_get_projections``, replaced before the patch applies) skips the whole patch."""
    verifies = _patch("qk_norm_rope").verifies
    modules = {m.__name__: m for m in (transformer_flux, transformer_flux2)}
    assert set(verifies) == {f"{m}:{f}" for m in modules for f in ("_get_qkv_projections", "_get_projections")}
    for path, fingerprints in verifies.items():
        module_name, name = path.split(":")
        assert _gates.fingerprint(getattr(modules[module_name], name)) in fingerprints, path

    def _get_projections(attn: Any, hidden_states: Any, encoder_hidden_states: Any = None) -> Any:
        return None  # another source

    torchpatches.revert("qk_norm_rope")
    monkeypatch.setattr(transformer_flux2, "_get_projections", _get_projections)
    try:
        torchpatches.apply("qk_norm_rope")
        status = torchpatches.status()["qk_norm_rope"]
        assert status.state.value == "skipped" and "_get_projections" in str(status), str(status)
    finally:
        monkeypatch.undo()
        torchpatches.apply("qk_norm_rope")
    assert torchpatches.status()["qk_norm_rope"].state.value == "applied"


# ---- rope_tables ---------------------------------------------------------------------------------


@pytest.fixture
def table_calls(monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """How often ``ops.rope_tables`` ran, by tier."""
    from torchpatches.ops import _rope_tables as rope_tables

    counts: Dict[str, int] = collections.Counter()
    real = rope_tables._impl

    def counting(ids: torch.Tensor, axes_dim: Any, theta: float, tier: str) -> Any:
        counts[tier] += 1
        return real(ids, axes_dim, theta, tier)

    monkeypatch.setattr(rope_tables, "_impl", counting)
    return counts


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("which", sorted(MODELS))
def test_rope_tables_in_the_model(which: str, tier: str, table_calls: Dict[str, int]) -> None:
    """One call per embedder call (FLUX.2 embeds image and text positions apart), both tiers; the model's output is
    diffusers' bit for bit (the tables are)."""
    if tier == "triton":
        pytest.importorskip("triton")
    model, inputs = MODELS[which]()
    ref = vanilla(model, inputs)
    with force_tier(tier), torchpatches.disabled("gelu_gemm"):
        out = run(model, inputs)
    assert table_calls == {tier: {"flux1": 1, "flux2": 2}[which]}
    if tier == "torch":
        assert torch.equal(out, ref)
    else:  # the other fused kernels' one-ulp differences reach the output
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # The tables alone change nothing (the reference reverts ``rope`` too: its kernel is not diffusers' bits on CUDA).
    with force_tier(tier), torchpatches.disabled("rope", *(name for name in FUSED if name != "rope_tables")):
        assert torch.equal(run(model, inputs), ref)


def test_rope_tables_with_float_ids_on_flux2(table_calls: Dict[str, int]) -> None:
    """The harness feeds tiny FLUX.2 the pipeline's int64 ids; a caller that builds float ids (as FLUX.1's pipeline
    does) gets the op too, and diffusers' tables."""
    model, inputs = tiny_flux2()
    assert inputs["img_ids"].dtype == inputs["txt_ids"].dtype == torch.int64
    inputs = dict(inputs, img_ids=inputs["img_ids"].float(), txt_ids=inputs["txt_ids"].float())
    ref = vanilla(model, inputs)
    with force_tier("triton"), torchpatches.disabled("rope", *(name for name in FUSED if name != "rope_tables")):
        out = run(model, inputs)
    assert torch.equal(out, ref) and table_calls == {"triton": 2}


def test_rope_tables_verifies_what_it_reproduces() -> None:
    """The code the op reproduces and the forwards call is fingerprinted (another source skips the patch)."""
    assert set(_patch("rope_tables").verifies) == {"diffusers.models.embeddings:get_1d_rotary_pos_embed",
                                                   "diffusers.utils.torch_utils:maybe_adjust_dtype_for_device"}
    assert set(_patch("gate_residual").verifies) == {f"{m.__name__}:{c}.forward" for m, c in (
        (transformer_flux, "FluxAttention"), (transformer_flux2, "Flux2Attention"),
        (transformer_flux2, "Flux2ParallelSelfAttention"))}


def test_rope_tables_step_aside(table_calls: Dict[str, int]) -> None:
    """A hook on the embedder runs around the fused forward (it sees the same output), fp64 positions are fused too;
    diffusers' forward for: an axes list that does not fit ids (FLUX.1's own IndexError), odd axes (diffusers' own
    AssertionError), positions requiring grad, a replaced global of the forward."""
    embed = transformer_flux.FluxPosEmbed(10000, [4, 6, 6])
    embed2 = transformer_flux2.Flux2PosEmbed(10000, [4, 4])
    ids = torch.arange(12.0).reshape(4, 3)
    with torchpatches.disabled("rope_tables"):
        ref = embed(ids)
    with force_tier("torch"):
        assert all(torch.equal(a, b) for a, b in zip(embed(ids), ref)) and table_calls == {"torch": 1}
        table_calls.clear()
        seen = []
        hook = embed.register_forward_hook(lambda m, a, o: seen.append(1))
        out = embed(ids)
        hook.remove()
        assert seen == [1] and all(torch.equal(a, b) for a, b in zip(out, ref)) and table_calls == {"torch": 1}
        table_calls.clear()
        assert torch.equal(embed(ids.double())[0], ref[0]) and table_calls == {"torch": 1}  # float() of them
        table_calls.clear()
        with pytest.raises(IndexError):
            transformer_flux.FluxPosEmbed(10000, [4, 6])(ids)  # fewer axes than ids' columns
        with pytest.raises(AssertionError):
            transformer_flux.FluxPosEmbed(10000, [4, 5, 6])(ids)
        grad_ids = ids.clone().requires_grad_(True)
        assert embed(grad_ids)[0].requires_grad
        assert table_calls == {}
        assert embed2(ids)[0].shape == (4, 8) and table_calls == {"torch": 1}  # FLUX.2: the first two columns
        table_calls.clear()
    real = transformer_flux.get_1d_rotary_pos_embed
    try:  # a user's own get_1d_rotary_pos_embed (here one that calls diffusers'): the forward that calls it runs
        transformer_flux.get_1d_rotary_pos_embed = lambda *args, **kwargs: real(*args, **kwargs)
        with force_tier("torch"):
            assert all(torch.equal(a, b) for a, b in zip(embed(ids), ref))
        assert table_calls == {}
    finally:
        transformer_flux.get_1d_rotary_pos_embed = real


def test_joined_is_a_view_only_for_adjacent_slices() -> None:
    whole = torch.randn(2, 7, 4)
    first, second = whole[:, :3], whole[:, 3:]
    view = _single_stream.joined(first, second)
    assert torch.equal(view, whole) and view.data_ptr() == whole.data_ptr()
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 4)
    assert torch.equal(_single_stream.joined(a, b), torch.cat([a, b], dim=1))
    swapped = _single_stream.joined(second, first)
    assert torch.equal(swapped, torch.cat([second, first], dim=1)) and swapped.data_ptr() != whole.data_ptr()


# ---- torch.compile: the patches step aside --------------------------------------------------------

def compile_and_count(model: torch.nn.Module, inputs: Dict[str, Any]) -> Tuple[torch.Tensor, int]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with repeatable_inductor(), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        out, codes = run_and_get_code(lambda: compiled(**inputs, return_dict=False)[0])
    return out, count_kernels(codes)


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(MODELS))
def test_compile_same_kernels_and_outputs(which: str, calls: Dict[str, int],
                                          record_property: Callable[[str, Any], None]) -> None:
    model, inputs = MODELS[which]()
    with torchpatches.disabled(*FUSED):
        ref, ref_kernels = compile_and_count(model, inputs)
    with force_tier("torch"):  # even with the fused path allowed on CPU, tracing keeps diffusers' code
        out, kernels = compile_and_count(model, inputs)
    torch._dynamo.reset()
    record_property("inductor_fused_kernels", dict(vanilla=ref_kernels, patched=kernels))
    print(f"\ninductor kernels, tiny {which}, CPU, torch {torch.__version__}: vanilla {ref_kernels}, patched {kernels}")
    assert not calls
    assert kernels == ref_kernels
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
