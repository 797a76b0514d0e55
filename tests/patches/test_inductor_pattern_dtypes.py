"""inductor_pattern_dtypes: a replacement registered for a custom op ``foo(x, scale)`` fires in Inductor's
post-grad pass with an fp32, a complex and a ``float8_e8m0fnu`` scale alike (without the patch only with fp32: the
dtype skip meant for aten ops' codegen), and aten anchors keep the skip."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Tuple

import pytest
import torch

import torchpatches

from _torch_fixes import skip_unless_applied

NAME = "inductor_pattern_dtypes"
MODULE = "torch._inductor.pattern_matcher"  # the target's module loads with Inductor
_OPS = itertools.count()
SCALE_DTYPES = [torch.float32, torch.complex64] + ([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else [])


def _ops() -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """A fresh custom op pair: ``foo`` (x * 2) and its replacement ``bar`` (x * 3)."""
    n = next(_OPS)

    def op(name: str, factor: float) -> Callable[..., Any]:
        @torch.library.custom_op(f"torchpatches_test::{name}{n}", mutates_args=())
        def impl(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x * factor

        @impl.register_fake
        def _(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(x)

        return getattr(torch.ops.torchpatches_test, f"{name}{n}")

    return op("foo", 2.0), op("bar", 3.0)


def _replacements(scale_dtype: torch.dtype) -> Tuple[Optional[int], float]:
    """(replacements the pass made, the compiled output's value): 3 + 1 where ``bar`` replaced ``foo``, else 2 + 1."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

    foo, bar = _ops()

    class Replace(CustomGraphPass):
        def __init__(self) -> None:
            self.patterns, self.count = PatternMatcherPass(), None
            examples = [torch.empty(4, 4), torch.empty(4, dtype=scale_dtype)]
            register_replacement(lambda x, s: foo(x, s), lambda x, s: bar(x, s), examples, fwd_only, self.patterns)

        def __call__(self, graph: Any) -> None:
            self.count = self.patterns.apply(graph)

        def uuid(self) -> None:
            return None

    replace = Replace()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=replace, fx_graph_cache=False):
        out = torch.compile(lambda x, s: foo(x, s) + 1, fullgraph=True)(torch.ones(4, 4), torch.zeros(4, dtype=scale_dtype))
    return replace.count, float(out[0, 0])


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
def test_custom_op_pattern_fires_for_every_dtype(scale_dtype: torch.dtype) -> None:
    skip_unless_applied(NAME, MODULE)
    assert _replacements(scale_dtype) == (1, 4.0)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES[1:], ids=str)
def test_skipped_without_the_patch(scale_dtype: torch.dtype) -> None:
    """The bug, as torch ships it: with the patch off the pattern never fires for these dtypes (fp32 does)."""
    with torchpatches.disabled(NAME):
        assert _replacements(torch.float32) == (1, 4.0)
        assert _replacements(scale_dtype) == (0, 3.0)


def test_builtin_anchors_keep_the_skip() -> None:
    """An aten node with a complex input is still skipped; a custom op's node is not."""
    import torch._inductor.lowering as lowering
    import torch._inductor.pattern_matcher as pm

    skip_unless_applied(NAME, MODULE)
    foo, _ = _ops()
    graph = torch.fx.Graph()
    x, s = graph.placeholder("x"), graph.placeholder("s")
    x.meta["val"], s.meta["val"] = torch.empty(4, 4, device="meta"), torch.empty(4, dtype=torch.complex64, device="meta")
    aten = graph.call_function(torch.ops.aten.mul.Tensor, (x, s))
    custom = graph.call_function(foo.default, (x, s))
    assert pm.fallback_node_due_to_unsupported_type(aten, allow_cpu_inputs=False) == \
        lowering.fallback_node_due_to_unsupported_type(aten, allow_cpu_inputs=False)
    assert pm.fallback_node_due_to_unsupported_type(custom, allow_cpu_inputs=False) is False
    assert lowering.fallback_node_due_to_unsupported_type is not pm.fallback_node_due_to_unsupported_type
