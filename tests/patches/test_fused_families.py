"""Every fused family of the model registry, one table: its ``<name>-fused`` tiny transformer computes diffusers'
values with torchpatches' fused paths.

- The PyTorch tier forced (``exact``) in fp32, bf16 and fp16: bit for bit (QwenImage in fp32 on a GPU within the
  ulps ``_fused_models.same`` states), with exactly the fused op calls the registry row pins (``calls``), so a path
  that silently stopped fusing fails here as surely as one that computes a wrong number.
- The Triton tier (interpreted on the CPU, compiled on a GPU) in bf16: within the one-ulp differences of fp32 norm
  statistics summed in another order, carried through two blocks of bf16 GEMMs; a wrong table, mask or vector moves
  the output by order 1e-1.

What only one family has (masks built once per step, per-token vectors, CFG batches, hooked norms) is tested in its
own file; the step-aside cases in test_fused_step_aside.py and test_fused_recompiles.py, over the same table.
"""
from __future__ import annotations

from typing import Dict

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import MODELS, exact_run, reverted, run, same, tiny  # noqa: E402
from harness import registry  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", MODELS)
def test_fused_path_equals_diffusers(name: str, dtype: torch.dtype, calls: Dict[str, int]) -> None:
    model, inputs = tiny(name, dtype)
    ref = reverted(model, inputs)
    assert not calls, "the reverted run must not reach the fused ops"
    out = exact_run(model, inputs)
    assert dict(calls) == registry.FAMILIES[name].calls
    assert out.dtype == ref.dtype and same(out, ref, name)


@pytest.mark.parametrize("name", MODELS)
def test_triton_tier_is_within_an_ulp_of_diffusers(name: str, calls: Dict[str, int]) -> None:
    pytest.importorskip("triton")
    model, inputs = tiny(name, torch.bfloat16)
    ref = reverted(model, inputs)
    with force_tier("triton"), torchpatches.disabled("gelu_gemm"):
        out = run(model, inputs)
    assert dict(calls) == registry.FAMILIES[name].calls
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_every_fused_pattern_targets_some_family() -> None:
    """A fused pattern of a diffusers module (declared through ``_fused_common``) that no registry row's coverage
    names would run on no tiny model of these tables."""
    import importlib
    import inspect

    from torchpatches.patches import PATCH_MODULES

    fused = set()
    for name in PATCH_MODULES:
        module = importlib.import_module(f"torchpatches.patches.{name}")
        if "_fused_common" in inspect.getsource(module) and all(
                target.path.startswith("diffusers.") for target in module.PATCH.targets):
            fused.add(name)
    assert fused and fused <= set(registry.FUSED_PATTERNS), fused - set(registry.FUSED_PATTERNS)
