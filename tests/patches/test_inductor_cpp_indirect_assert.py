"""inductor_cpp_indirect_assert: a gather whose index varies along the vectorized dimension, padded along the outer
one (a scalar mask around a vector bounds check), compiles with Inductor's C++ backend and equals eager where the
patch applies (torch 2.11), fails to compile there without it, and is skipped by fingerprint where torch has the fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchpatches
from torchpatches.patches import inductor_cpp_indirect_assert

from _torch_fixes import applied, assert_gated_by_fingerprint

NAME = "inductor_cpp_indirect_assert"
MODULE = "torch._inductor.codegen.cpp"  # the target's module: pending until Inductor loads it


def _padded_gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.pad(t[idx], (0, 0, 1, 0))


def _compile_and_run() -> None:
    g = torch.Generator().manual_seed(0)
    t, idx = torch.randn(100, generator=g), torch.randint(0, 100, (5, 17), generator=g)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(_padded_gather, backend="inductor", fullgraph=True)(t, idx)
    assert torch.equal(out, _padded_gather(t, idx))


def test_padded_gather_compiles() -> None:
    _compile_and_run()


def test_does_not_compile_without_the_patch_where_it_applies() -> None:
    if not applied(NAME, MODULE):
        pytest.skip(f"{NAME} is not applied on torch {torch.__version__} (the fix is upstream)")
    with torchpatches.disabled(NAME), pytest.raises(Exception, match="VecMask"):
        _compile_and_run()


def test_applies_exactly_on_the_verified_source() -> None:
    import torch._inductor.codegen.cpp as cpp

    assert_gated_by_fingerprint(NAME, MODULE, lambda: cpp.CppVecKernel.indirect_assert,
                                inductor_cpp_indirect_assert.FINGERPRINT_TORCH_2_11_0)
