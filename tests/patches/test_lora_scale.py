"""``lora_scale``: diffusers' LoRA scale walk without generators, the same layers in the same order.

The walk (``tuner_layers``) against ``model.modules()`` on drawn trees (shared modules, ``None`` children, deep
chains) and every case it hands back to diffusers, without peft; with peft (the ``peft-accelerate`` nox session):
the scalings after ``scale_lora_layers`` / ``unscale_lora_layers`` equal diffusers' exactly, weight 0, 1 and
None, the ``@apply_lora_scale`` forward's output and scalings, torch.compile and revert.
"""
from __future__ import annotations

import abc
import copy
from typing import Any, Dict, List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchpatches.patches._bodies import lora_scale
from torchpatches.patches._bodies.lora_scale import tuner_layers


class Layer(torch.nn.Module):
    """Stands for peft's ``BaseTunerLayer`` where peft is not installed."""


def expected(model: torch.nn.Module, cls: type) -> List[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, cls)]


@st.composite
def trees(draw: Any) -> torch.nn.Module:
    """A module tree of up to 40 modules, some reached twice (a module shared by two parents), some children None."""
    made: List[torch.nn.Module] = []
    for _ in range(draw(st.integers(1, 40))):
        module = Layer() if draw(st.booleans()) else torch.nn.Module()
        if made:
            for i in draw(st.lists(st.integers(0, len(made) - 1), max_size=4)):
                module.add_module(f"c{len(module._modules)}", made[i])
            if draw(st.booleans()):
                module.register_module(f"none{len(module._modules)}", None)
        made.append(module)
    return made[-1]


@settings(max_examples=60, deadline=None)
@given(trees())
def test_walk_is_modules_order_with_shared_and_none_children(model: torch.nn.Module) -> None:
    assert tuner_layers(model, Layer) == expected(model, Layer)


class OwnWalk(torch.nn.Module):
    def named_modules(self, *args: Any, **kwargs: Any) -> Any:
        return iter(())


class NoHash(torch.nn.Module):
    def __eq__(self, other: object) -> bool:  # defines __eq__ without __hash__: unhashable
        return self is other


def test_what_diffusers_walk_must_answer() -> None:
    """A walk ``modules()`` would do otherwise, or that raises, is diffusers' to do (None)."""
    own = torch.nn.Sequential(Layer(), OwnWalk())
    assert tuner_layers(own, Layer) is None
    instance = torch.nn.Sequential(Layer(), torch.nn.Module())
    instance[1].named_modules = lambda *a, **k: iter(())
    assert tuner_layers(instance, Layer) is None
    bare = torch.nn.Sequential(Layer())
    bare._modules["half"] = torch.nn.Module.__new__(torch.nn.Module)  # skipped Module.__init__: no _modules
    assert tuner_layers(bare, Layer) is None
    assert tuner_layers(torch.nn.Sequential(NoHash()), Layer) is None
    not_a_module = torch.nn.Sequential(Layer())
    not_a_module._modules["x"] = object()
    assert tuner_layers(not_a_module, Layer) is None
    assert tuner_layers(None, Layer) is None and tuner_layers(object(), Layer) is None


def test_a_walk_override_set_after_a_walk_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    class Late(torch.nn.Module):
        pass

    model = torch.nn.Sequential(Layer(), Late())
    assert tuner_layers(model, Layer) == [model[0]]
    monkeypatch.setattr(Late, "named_modules", OwnWalk.named_modules, raising=False)
    assert tuner_layers(model, Layer) is None


def test_classes_made_at_run_time_are_not_kept_alive() -> None:
    import gc
    import weakref

    made = type("Made", (torch.nn.Module,), {})
    assert tuner_layers(torch.nn.Sequential(made()), Layer) == []
    gone = weakref.ref(made)
    del made
    gc.collect()
    assert gone() is None


def test_abc_register_after_a_walk_is_seen() -> None:
    class Marker(abc.ABC):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Layer())
    assert tuner_layers(model, Marker) == [] == expected(model, Marker)
    Marker.register(torch.nn.Linear)
    assert tuner_layers(model, Marker) == [model[0]] == expected(model, Marker)


# ---- with peft: diffusers' functions ----------------------------------------------------------------------

SCALE_PATHS = ("scale_lora_layers", "unscale_lora_layers")


@pytest.fixture
def peft_utils() -> Any:
    pytest.importorskip("peft")
    pytest.importorskip("diffusers")
    import diffusers.utils.peft_utils as peft_utils

    import torchpatches

    state = torchpatches.status()["lora_scale"]
    assert state.state.value == "applied", str(state)
    return peft_utils


def scalings(model: torch.nn.Module) -> List[Dict[str, Any]]:
    return [dict(m.scaling) for m in model.modules() if hasattr(m, "scaling")]


def lora_flux() -> Any:
    import peft

    from _fused_models import tiny

    model, inputs = tiny("flux1", torch.float32)
    torch.manual_seed(3)
    targets = ["to_q", "to_k", "to_v", "proj_mlp", "proj_out", "norm.linear", "ff.net.2"]
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, target_modules=targets),
                      adapter_name="a")
    model.add_adapter(peft.LoraConfig(r=2, lora_alpha=3, init_lora_weights=False, target_modules=targets[:3]),
                      adapter_name="b")
    model.set_adapters(["a", "b"], [0.7, 0.3])
    return model, inputs


def test_scalings_equal_diffusers_for_each_weight(peft_utils: Any) -> None:
    import torchpatches

    model, _ = lora_flux()
    for weights in ([0.8], [0.8, 0.8], [3.0, 0.0], [1.0], [None], [0.3, 1.0]):
        twin = copy.deepcopy(model)
        for w in weights:
            peft_utils.scale_lora_layers(model, w if w is not None else 1.0)
            peft_utils.unscale_lora_layers(model, w)
            peft_utils.scale_lora_layers(model, 0.6)
            with torchpatches.disabled("lora_scale"):
                peft_utils.scale_lora_layers(twin, w if w is not None else 1.0)
                peft_utils.unscale_lora_layers(twin, w)
                peft_utils.scale_lora_layers(twin, 0.6)
            assert scalings(model) == scalings(twin), w  # the same floats: the same multiplications in the same order


def test_the_decorated_forward_goes_through_the_walk(peft_utils: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchpatches

    model, inputs = lora_flux()
    walks = []
    real = lora_scale.tuner_layers
    monkeypatch.setattr(lora_scale, "tuner_layers", lambda *a: walks.append(1) or real(*a))
    before = scalings(model)
    with torch.no_grad():
        out = model(**inputs, joint_attention_kwargs={"scale": 0.8}, return_dict=False)[0]
        assert len(walks) == 2 and scalings(model) == before  # scaled, then unscaled: 0.8 then / 0.8 here exact
        with torchpatches.disabled("lora_scale"):
            ref = model(**inputs, joint_attention_kwargs={"scale": 0.8}, return_dict=False)[0]
    assert len(walks) == 2 and torch.equal(out, ref)


def test_under_compile_diffusers_walk_runs(peft_utils: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = lora_flux()
    twin = copy.deepcopy(model)
    monkeypatch.setattr(lora_scale, "is_compiling", lambda: True)
    monkeypatch.setattr(lora_scale, "tuner_layers", lambda *a: pytest.fail("walked while compiling"))
    peft_utils.scale_lora_layers(model, 0.5)
    vars(peft_utils)["scale_lora_layers"].__torchpatches_original__(twin, 0.5)
    assert scalings(model) == scalings(twin)


def test_compiled_scale_traces_in_one_graph(peft_utils: Any) -> None:
    """Dynamo traces the replacement (diffusers' walk inside it) with ``fullgraph=True``: the same output and the
    scaling back where it was, as with diffusers' functions."""
    import peft

    import torchpatches

    model = peft.inject_adapter_in_model(
        peft.LoraConfig(r=2, lora_alpha=2, target_modules=["0"], init_lora_weights=False),
        torch.nn.Sequential(torch.nn.Linear(8, 8))).eval()
    x = torch.randn(3, 8)

    def step(x: torch.Tensor) -> torch.Tensor:
        peft_utils.scale_lora_layers(model, 0.5)
        y = model(x)
        peft_utils.unscale_lora_layers(model, 0.5)
        return y

    with torch.no_grad():
        ref = step(x)
        with torchpatches.disabled("lora_scale"):
            torch._dynamo.reset()
            ref_compiled = torch.compile(step, backend="eager", fullgraph=True)(x)
        torch._dynamo.reset()
        out = torch.compile(step, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    assert torch.equal(out, ref) and torch.equal(ref_compiled, ref) and model[0].scaling == {"default": 1.0}


def test_without_peft_the_same_import_error(peft_utils: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "peft.tuners.tuners_utils", None)
    for name in SCALE_PATHS:
        with pytest.raises(ImportError):
            getattr(peft_utils, name)(torch.nn.Linear(2, 2), 1.0)
        with pytest.raises(ImportError):
            vars(peft_utils)[name].__torchpatches_original__(torch.nn.Linear(2, 2), 1.0)


def test_revert_puts_diffusers_functions_back_everywhere(peft_utils: Any) -> None:
    import diffusers.utils

    import torchpatches

    patched = {name: getattr(peft_utils, name) for name in SCALE_PATHS}
    with torchpatches.disabled("lora_scale"):
        for name, replacement in patched.items():
            original = replacement.__torchpatches_original__
            assert getattr(peft_utils, name) is original and getattr(diffusers.utils, name) is original
    for name, replacement in patched.items():
        assert getattr(peft_utils, name) is replacement and getattr(diffusers.utils, name) is replacement
