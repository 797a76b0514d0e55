"""The compile-safe message helpers never lose a message to a formatting error.

Under compile, a tensor argument has no value at trace time (it is a FakeTensor); the helpers show a
stand-in and must still format the message whatever the ``%`` spec (``%d`` with a tensor included),
instead of handing logging a record that fails in the handler (``--- Logging error ---``).
"""
from __future__ import annotations

import io
import logging
import sys
import warnings
from typing import Iterator, List

import pytest
import torch

from torchpatches.compile import OnceLogger, reset_once, warn_once, warning_once

LOGGER_NAME = "torchpatches.tests.compile_hostile"


class _Formatted(logging.Handler):
    """Formats every record the way a real handler does: a bad record raises here, not silently."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def formatted(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Formatted]:
    reset_once()
    handler, logger = _Formatted(), logging.getLogger(LOGGER_NAME)
    handler.handleError = lambda record: (_ for _ in ()).throw(AssertionError("--- Logging error ---"))  # type: ignore[assignment]
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    torch._dynamo.reset()
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()
        reset_once()


def _compiled(fn):
    return torch.compile(fn, backend="eager", fullgraph=True)


def test_tensor_argument_with_a_numeric_spec_under_compile(formatted: _Formatted) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        warning_once(LOGGER_NAME, "count %d of %s", x.sum(), "things")
        return x + 1

    _compiled(f)(torch.ones(3))
    assert len(formatted.messages) == 1
    message = formatted.messages[0]
    assert message.startswith("count ") and message.endswith(" of things")
    assert "tensor" in message


def test_once_logger_with_a_tensor_under_compile(formatted: _Formatted) -> None:
    log = OnceLogger(logging.getLogger(LOGGER_NAME))

    def f(x: torch.Tensor) -> torch.Tensor:
        log.warning("mean %.3f", x.mean())
        log.info("value %i", x.max())
        return x * 2

    _compiled(f)(torch.ones(3))
    assert len(formatted.messages) == 2
    assert formatted.messages[0].startswith("mean ") and formatted.messages[1].startswith("value ")


@pytest.mark.parametrize("args", [(torch.ones(3),), ("too", "many"), ()])
def test_eager_bad_format_arguments_keep_the_message(formatted: _Formatted, args: tuple) -> None:
    warning_once(LOGGER_NAME, "count %d", *args)
    assert len(formatted.messages) == 1 and formatted.messages[0].startswith("count")


def test_warn_once_with_a_tensor_under_compile() -> None:
    reset_once()

    def f(x: torch.Tensor) -> torch.Tensor:
        warn_once("count %d", UserWarning, args=(x.sum(),))
        return x + 1

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compiled(f)(torch.ones(3))
    torch._dynamo.reset()
    reset_once()
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(text.startswith("count ") for text in texts), texts


def test_no_logging_error_on_stderr_under_compile(capsys: pytest.CaptureFixture) -> None:
    """The symptom users would see: logging's own '--- Logging error ---' report."""
    reset_once()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger(LOGGER_NAME + ".stderr")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        def f(x: torch.Tensor) -> torch.Tensor:
            warning_once(logger, "count %d", x)
            return x + 1

        torch._dynamo.reset()
        _compiled(f)(torch.ones(2))
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()
        reset_once()
    assert "Logging error" not in capsys.readouterr().err
    assert stream.getvalue().startswith("count ")
