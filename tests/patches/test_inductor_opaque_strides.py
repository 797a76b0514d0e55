"""inductor_opaque_strides: a custom op taking an opaque object compiles with Inductor under the fixed-stride layout
constraint (vLLM's setting) where the patch applies (torch 2.11), fails to lower there without it, and is skipped by
fingerprint where torch carries the fix (the program then compiles on its own)."""
from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Iterator

import pytest
import torch

import torchpatches
from torchpatches.patches import inductor_opaque_strides

from _torch_fixes import applied, assert_gated_by_fingerprint

NAME = "inductor_opaque_strides"
MODULE = "torch._inductor.lowering"  # the target's module: pending until Inductor loads
opaque_object = pytest.importorskip("torch._library.opaque_object")
OpaqueBase = pytest.importorskip("torch._opaque_base").OpaqueBase


class Name(OpaqueBase):
    """A value-type opaque object hoisted to a graph input (vLLM passes module names so)."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Name) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __fx_repr__(self):  # noqa: ANN204 - the signature opaque types take
        return f"Name({self.value!r})", {Name}


opaque_object.register_opaque_type(Name, typ="value", hoist=True)


_OPS = itertools.count()


def _program() -> Callable[[torch.Tensor, Name], torch.Tensor]:
    """A program calling a custom op of its own: Inductor registers an implicit fallback (with the layout constraint
    of that moment) per op at its first lowering, so each compile here meets a new one."""
    name = f"opaque_scale_{next(_OPS)}"

    @torch.library.custom_op(f"torchpatches_test::{name}", mutates_args=())
    def op(x: torch.Tensor, n: Name) -> torch.Tensor:
        return x * 2

    @op.register_fake
    def _(x: torch.Tensor, n: Name) -> torch.Tensor:
        return torch.empty_like(x)

    return lambda x, n: getattr(torch.ops.torchpatches_test, name)(x + 1, n) - 1


@contextlib.contextmanager
def _fixed_stride_order() -> Iterator[None]:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with functorch_config.patch(custom_op_default_layout_constraint="needs_fixed_stride_order"), \
            inductor_config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()


def _compile_and_run() -> torch.Tensor:
    x = torch.arange(12.0).reshape(3, 4)
    with _fixed_stride_order():
        out = torch.compile(_program(), backend="inductor", fullgraph=True)(x, Name("layer.0"))
    assert torch.equal(out, (x + 1) * 2 - 1)
    return out


def test_opaque_argument_under_fixed_stride_order() -> None:
    _compile_and_run()


def test_fails_to_lower_without_the_patch_where_it_applies() -> None:
    if not applied(NAME, MODULE):
        pytest.skip(f"{NAME} is not applied on torch {torch.__version__} (the fix is upstream)")
    with torchpatches.disabled(NAME), pytest.raises(Exception, match="stride"):
        _compile_and_run()


def test_applies_exactly_on_the_verified_source() -> None:
    import torch._inductor.graph as graph
    import torch._inductor.lowering as lowering

    with torchpatches.disabled(NAME):
        original = lowering.constrain_to_fx_strides
        assert graph.constrain_to_fx_strides is original
    assert_gated_by_fingerprint(NAME, MODULE, lambda: lowering.constrain_to_fx_strides,
                                inductor_opaque_strides.FINGERPRINT_TORCH_2_11_0)
    if applied(NAME, MODULE):  # graph.py's own name for it is rebound, and restored by identity
        assert graph.constrain_to_fx_strides is lowering.constrain_to_fx_strides is not original
        with torchpatches.disabled(NAME):
            assert graph.constrain_to_fx_strides is original
