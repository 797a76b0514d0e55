"""torchpatches.compile: warn-once helpers and constant queries that never break a graph."""
from __future__ import annotations

import logging
import warnings
from typing import Iterator, List

import pytest
import torch

import harness
from torchpatches.compile import OnceLogger, constant_query, reset_once, warn_once, warning_once

LOGGER_NAME = "torchpatches.tests.compile"


@pytest.fixture
def records() -> Iterator[harness.LogRecords]:
    """Everything logged on LOGGER_NAME (handler on the logger itself: no propagation needed)."""
    reset_once()
    torch._dynamo.reset()
    try:
        with harness.capture_logs(LOGGER_NAME, level=logging.DEBUG) as handler:
            yield handler
    finally:
        torch._dynamo.reset()
        reset_once()


def _explain(fn, *args):
    report = harness.graph_report(fn, *args)
    return report.graphs, report.breaks


def _compiled(fn, **kwargs):
    return torch.compile(fn, backend="eager", fullgraph=True, **kwargs)


once_logger = OnceLogger(logging.getLogger(LOGGER_NAME))


def _model_with_warnings(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    once_logger.warning("x has %d rows and %s", x.shape[0], "a name")
    warning_once(LOGGER_NAME, "plain %s", "message", level=logging.INFO)
    warn_once("rows: %s", FutureWarning, args=(x.shape[0],))
    return x * 2


# ---- eager ---------------------------------------------------------------------------------------


def test_warning_once_eager_same_message_once_different_messages_each(records: harness.LogRecords) -> None:
    logger = logging.getLogger(LOGGER_NAME)
    for _ in range(3):
        warning_once(logger, "same %s", "text")
    warning_once(logger, "same %s", "other")
    warning_once(logger, "same %s", "text", level=logging.ERROR)  # another level is another message
    assert records.messages == ["same text", "same other", "same text"]
    assert [r.levelno for r in records.records] == [logging.WARNING, logging.WARNING, logging.ERROR]
    assert all(r.funcName == "test_warning_once_eager_same_message_once_different_messages_each" for r in records.records)


def test_warning_once_respects_level_and_does_not_consume_disabled_messages(records: harness.LogRecords) -> None:
    logging.getLogger(LOGGER_NAME).setLevel(logging.ERROR)
    warning_once(LOGGER_NAME, "hidden")
    logging.getLogger(LOGGER_NAME).setLevel(logging.DEBUG)
    warning_once(LOGGER_NAME, "hidden")
    assert records.messages == ["hidden"]


def test_warn_once_eager(records: harness.LogRecords) -> None:
    with pytest.warns(FutureWarning, match="^deprecated thing$") as caught:
        for _ in range(3):
            warn_once("deprecated thing", FutureWarning, stacklevel=1)
    assert len([w for w in caught if "deprecated thing" in str(w.message)]) == 1
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match="^n=3$"):
        warn_once("n=%d", args=(3,))


def test_once_logger_eager(records: harness.LogRecords) -> None:
    for _ in range(2):
        once_logger.warning("w")
        once_logger.info("i %d", 1)  # info keeps the logger's every-call behaviour in eager
    assert records.messages == ["w", "i 1", "i 1"]
    assert once_logger.isEnabledFor(logging.INFO)  # the rest of the Logger API passes through
    assert records.records[0].funcName == "test_once_logger_eager"


def test_percent_without_args_and_records_keep_msg_and_args(records: harness.LogRecords) -> None:
    warning_once(LOGGER_NAME, "100% sure")
    warning_once(LOGGER_NAME, "%s and %d", "a", 2)
    assert records.messages == ["100% sure", "a and 2"]
    assert (records.records[1].msg, records.records[1].args) == ("%s and %d", ("a", 2))  # as Logger.log makes it


# ---- under torch.compile ---------------------------------------------------------------------------


def test_no_graph_break_and_fullgraph(records: harness.LogRecords) -> None:
    assert _explain(_model_with_warnings, torch.randn(4)) == (1, 0)
    reset_once()
    records.records.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _compiled(_model_with_warnings)(torch.randn(4))
    assert out.shape == (4,)
    assert records.messages == ["x has 4 rows and a name", "plain message"]
    assert [str(w.message) for w in caught] == ["rows: 4"]
    # attributed to the traced source line, not to Dynamo's frames
    assert caught[0].filename == __file__
    assert records.records[0].funcName == "_model_with_warnings" and records.records[0].pathname == __file__


def test_emitted_once_at_trace_time_not_per_call_and_no_recompile(records: harness.LogRecords) -> None:
    compiled = _compiled(_model_with_warnings)
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("always")
        for _ in range(3):
            compiled(torch.randn(4))
    assert records.messages == ["x has 4 rows and a name", "plain message"]
    assert len(caught) == 1


def test_eager_then_compile_does_not_repeat(records: harness.LogRecords) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _model_with_warnings(torch.randn(4))
        _compiled(_model_with_warnings)(torch.randn(4))
    assert records.messages == ["x has 4 rows and a name", "plain message"]
    assert len(caught) == 1


def test_dynamic_shapes_format_the_traced_value_without_specializing(records: harness.LogRecords) -> None:
    compiled = _compiled(_model_with_warnings, dynamic=True)
    with warnings.catch_warnings(record=True), torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("always")
        for rows in (5, 7, 9):  # a guard on the row count would recompile and raise here
            assert compiled(torch.randn(rows)).shape == (rows,)
    assert records.messages == ["x has 5 rows and a name", "plain message"]


def test_raw_logger_object_under_compile(records: harness.LogRecords) -> None:
    logger = logging.getLogger(LOGGER_NAME)

    def fn(x: torch.Tensor) -> torch.Tensor:
        warning_once(logger, "raw %s", "logger")
        return x + 1

    assert torch.equal(_compiled(fn)(torch.ones(2)), torch.full((2,), 2.0))
    assert records.messages == ["raw logger"]


def _inner_site(x: torch.Tensor) -> torch.Tensor:
    once_logger.warning("inner")
    warn_once("inner warning", stacklevel=1)
    return x + 1


def _outer(x: torch.Tensor) -> torch.Tensor:
    return _inner_site(x) * 2


def test_trace_time_location_is_the_calling_line_in_nested_frames(records: harness.LogRecords) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compiled(_outer)(torch.ones(2))
    assert records.records[0].funcName == "_inner_site"
    assert caught[0].filename == __file__ and caught[0].lineno == _inner_site.__code__.co_firstlineno + 2


def test_once_logger_warning_with_logging_kwargs(records: harness.LogRecords) -> None:
    for _ in range(2):
        once_logger.warning("with extra", extra={"k": 1})
    assert records.messages == ["with extra"] and records.records[0].k == 1
    assert records.records[0].funcName == "test_once_logger_warning_with_logging_kwargs"


# ---- constant_query ---------------------------------------------------------------------------------


def test_constant_query_is_cached_and_constant_under_compile() -> None:
    calls: List[str] = []

    @constant_query
    def capability(name: str):
        calls.append(name)
        return None if name == "none" else name.upper()

    def fn(x: torch.Tensor) -> torch.Tensor:
        a, b = capability("none"), capability("abc")
        return x * 2 if a is None and b == "ABC" else x

    assert capability("abc") == "ABC" and capability("abc") == "ABC"
    assert calls == ["abc"]
    assert _explain(fn, torch.ones(2)) == (1, 0)
    torch._dynamo.reset()
    assert torch.equal(_compiled(fn)(torch.ones(2)), torch.full((2,), 2.0))
    assert calls == ["abc", "none"]  # traced calls went through the cache
    capability.cache_clear()
    assert capability("abc") == "ABC" and calls[-1] == "abc"


def test_constant_query_bool_and_tuple_results() -> None:
    @constant_query
    def flags() -> tuple:
        return (True, 3, "x")

    def fn(x: torch.Tensor) -> torch.Tensor:
        ok, n, s = flags()
        return x + n if ok and s == "x" else x

    torch._dynamo.reset()
    assert torch.equal(_compiled(fn)(torch.zeros(2)), torch.full((2,), 3.0))


def test_constant_query_on_a_platform_classmethod() -> None:
    """sglang's IS_AMP_SUPPORTED lesson: an lru_cache'd classmethod query without a graph break."""

    class Platform:
        @classmethod
        @constant_query
        def is_amp_supported(cls) -> bool:
            return False

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x if Platform.is_amp_supported() else x.float() * 2

    assert _explain(fn, torch.ones(2, dtype=torch.half)) == (1, 0)
