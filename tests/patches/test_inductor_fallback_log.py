"""inductor_fallback_log: with INFO logging off, Inductor's implicit-fallback log line no longer builds the text of
the op's inputs (torch 2.11, 2.12), and the line reads the same when INFO is on; every other caller of
``OperatorIssue.operator_str`` gets the original's str."""
from __future__ import annotations

import itertools
import logging
import types
from typing import Callable, Iterator, List

import pytest
import torch

import torchpatches

from _torch_fixes import skip_unless_applied

NAME = "inductor_fallback_log"
_OPS = itertools.count()


def _program() -> Callable[[torch.Tensor], torch.Tensor]:
    """A custom op of its own per compile (Inductor creates an op's implicit fallback once per process), fed by a
    pointwise chain."""
    name = f"fallback_log_{next(_OPS)}"

    @torch.library.custom_op(f"torchpatches_test::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @op.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def program(x: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            x = x.sin() + 1
        return getattr(torch.ops.torchpatches_test, name)(x) - 1

    return program


def _compile(program: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(program, backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(out, program(x))


@pytest.fixture
def applied() -> Iterator[None]:
    skip_unless_applied(NAME, "torch._inductor.graph")  # its target's module (exc) loads with Inductor's graph
    yield


@pytest.fixture
def texts_built(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The texts operator_str builds (its last step, ``textwrap.indent``, counted)."""
    import textwrap

    import torch._inductor.exc as exc

    built: List[str] = []

    def indent(text: str, prefix: str) -> str:
        built.append(text)
        return textwrap.indent(text, prefix)

    monkeypatch.setattr(exc, "textwrap", types.SimpleNamespace(indent=indent))
    return built


def test_not_built_while_info_is_off(applied: None, texts_built: List[str]) -> None:
    logging.getLogger("torch._inductor.graph").setLevel(logging.WARNING)
    _compile(_program())
    assert texts_built == []
    with torchpatches.disabled(NAME):
        _compile(_program())
    assert len(texts_built) == 1 and "fallback_log_" in texts_built[0]  # the unpatched call builds it


def test_same_line_when_info_is_on(applied: None, caplog: pytest.LogCaptureFixture) -> None:
    def line() -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="torch._inductor.graph"):
            _compile(_program())
        [message] = [r.getMessage() for r in caplog.records if "Creating implicit fallback" in r.getMessage()]
        return message

    patched = line()
    with torchpatches.disabled(NAME):
        plain = line()
    strip = lambda text: "".join(c for c in text if not c.isdigit())  # noqa: E731 - op and buffer numbers
    assert strip(patched) == strip(plain) and "target: torchpatches_test.fallback_log_" in patched


def test_other_callers_get_the_original_str(applied: None) -> None:
    from torch._inductor.exc import MissingOperatorWithoutDecomp, OperatorIssue

    text = OperatorIssue.operator_str("t", [1, "a"], {"k": 2})
    assert type(text) is str and text == "  target: t\n  args[0]: 1\n  args[1]: a\n  kwargs: {'k': 2}"
    assert str(MissingOperatorWithoutDecomp("t", [1], {})) == "missing lowering\n  target: t\n  args[0]: 1"
