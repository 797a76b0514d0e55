"""Compiled with torchpatches, every fused family recompiles exactly as often as diffusers' own code: diffusers'
regional compile (``compile_repeated_blocks(fullgraph=True)``, what diffusers recommends) and a whole-model compile,
two calls each, the fused patterns on and off.

A fused pattern replaces block ``forward`` methods; Dynamo keeps compiled entries per code object and the regional
compile's frames are those forwards. Each replacement must therefore be its own code object, as each original is:
FLUX's double and single blocks once shared one, which cost a recompile, and with ``recompile_limit=1`` (diffusers'
own ``test_torch_compile_repeated_blocks``) a hard failure. Dynamo alone decides this: the tests compile with the
``eager`` backend (the GPU check, ``TORCHPATCHES_TEST_DEVICE=cuda``, runs the same cases where the fused paths run
eagerly around the compiled blocks).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

import torchpatches
from torchpatches._doctor.capture import capture
from torchpatches.ops import force_tier

from _fused_models import FUSED, MODELS, output, tiny

pytestmark = pytest.mark.slow


def _blocks(model: torch.nn.Module) -> List[torch.nn.Module]:
    kinds = tuple(getattr(model, "_repeated_blocks", ()))
    return [m for m in model.modules() if type(m).__name__ in kinds]


def _recompiles(model: torch.nn.Module, inputs: Dict[str, Any], how: str) -> Tuple[List[str], torch.Tensor]:
    """(the recompile reasons Dynamo gave, the second call's output) of two calls of ``model`` compiled ``how``."""
    torch._dynamo.reset()
    if how == "regional":
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
        call = model
    else:
        call = torch.compile(model, fullgraph=True, backend="eager")
    try:
        with capture() as events, torch.no_grad():
            call(**inputs, return_dict=False)
            out = output(call(**inputs, return_dict=False))
    finally:
        for block in _blocks(model):
            block._compiled_call_impl = None
        torch._dynamo.reset()
    return [f"{r.function}: {r.reasons}" for r in events.recompiles], out


@pytest.mark.parametrize("how", ["regional", "full"])
@pytest.mark.parametrize("name", MODELS)
def test_recompiles_as_diffusers(name: str, how: str) -> None:
    model, inputs = tiny(name)
    if how == "regional" and not getattr(model, "_repeated_blocks", None):
        pytest.skip(f"{type(model).__name__} declares no repeated blocks (diffusers refuses its regional compile)")
    with force_tier("torch"):  # the fused paths engage on the CPU: eager code around the compiled blocks runs them
        try:
            with torchpatches.disabled(*FUSED, "rope"):
                plain, plain_out = _recompiles(model, inputs, how)
        except torch._dynamo.exc.Unsupported as error:  # Z-Image's whole model: diffusers' own code does not trace
            with pytest.raises(type(error)):
                _recompiles(model, inputs, how)
            return
        patched, patched_out = _recompiles(model, inputs, how)
    assert len(patched) == len(plain), f"{name} {how}: with torchpatches {patched}, diffusers alone {plain}"
    assert torch.equal(patched_out, plain_out)


def test_fused_forwards_have_their_own_code() -> None:
    """Every method a fused pattern replaces gets a code object of its own."""
    import importlib

    for name in MODELS:  # their diffusers modules imported: the pending patterns apply
        tiny(name)
    codes: Dict[int, str] = {}  # by id: code objects compare equal by value, Dynamo keeps entries per object
    for name in FUSED + ("lora",):
        if torchpatches.status()[name].state.value != "applied":
            continue
        for target in importlib.import_module(f"torchpatches.patches.{name}").PATCH.targets:
            module_name, qualname = target.path.split(":", 1)
            owner = importlib.import_module(module_name)
            for part in qualname.split("."):
                owner = getattr(owner, part)
            code = owner.__code__
            assert id(code) not in codes, f"{target.path} shares its code object with {codes.get(id(code))}"
            codes[id(code)] = target.path
    assert codes, "no fused pattern applied"


def test_regional_compile_with_a_recompile_limit_of_one() -> None:
    """diffusers' ``test_torch_compile_repeated_blocks`` on its FLUX.1 config (one double and one single block):
    ``recompile_limit=1`` and two calls pass with torchpatches as without."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 48, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), img_ids=torch.randn(16, 3, generator=g),
                  txt_ids=torch.randn(48, 3, generator=g), timestep=torch.tensor([1.0]))
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    try:
        with force_tier("torch"), torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
            model(**inputs)
            model(**inputs)
    finally:
        for block in _blocks(model):
            block._compiled_call_impl = None
        torch._dynamo.reset()
