"""Helpers that keep Python side effects out of ``torch.compile`` graphs without breaking them.

Dynamo cannot trace ``logging.Logger`` methods or ``warnings.warn``: each call in a compiled region
splits the graph there (``fullgraph=True`` fails). The helpers here do the side effect *while Dynamo
traces* -- once, with the values of the call that triggered the trace -- and put nothing in the graph.
In eager they call the real logger / ``warnings.warn`` with the same logger, level, category and text.

    warning_once(logger, "x has %d dims", x.ndim)     # logging, once per distinct message
    warn_once("pass 2-D ids", FutureWarning)            # warnings.warn, once per distinct message
    log = OnceLogger(logging.getLogger(__name__))       # logger stand-in: .warning() is once, compile-safe
    @constant_query                                     # a cached query Dynamo treats as a constant
    def flash_attention_available() -> bool: ...

"Once" is keyed by the final text (and logger + level, or warning category): the same message is not
repeated, different ones are -- in eager, under compile, and across the two (the set is per process;
:func:`reset_once` clears it). Messages are formatted lazily, logging style (``msg % args``), so pass
shape values as arguments rather than pre-formatting them: under ``dynamic=True`` a shape is a SymInt,
formatting it in the model's code would specialize it (one recompile per shape), while the helpers
format it at trace time from its hint (its value in the call that was traced), adding no guard.

Mechanism: the trace-time side effect goes through ``torch._dynamo.comptime`` (a callback Dynamo
runs while tracing, with access to the traced values). ``torch.compiler.assume_constant_result``
cannot carry it: on torch 2.11 and 2.13 it refuses a ``logging.Logger`` argument and a SymInt argument
(2.13: graph break; 2.11: ``InternalTorchDynamoError``, a hard compile failure).
"""
from __future__ import annotations

import functools
import logging
import os
import traceback
from typing import Any, Callable, Optional, Tuple, Type, TypeVar, Union

import torch

from ._core.compat import (
    assume_constant,
    emit_log_once,
    emit_warning_once,
    first_time,
    format_message,
    formats_cleanly,
    is_compiling,
    reset_once,
)

__all__ = ["warning_once", "warn_once", "OnceLogger", "constant_query", "reset_once"]

_log = logging.getLogger("torchpatches")
_F = TypeVar("_F", bound=Callable[..., Any])
LoggerLike = Union[logging.Logger, "OnceLogger", str]

_THIS_FILE = os.path.normcase(os.path.abspath(__file__))


def _resolve_logger(logger: LoggerLike) -> logging.Logger:
    if isinstance(logger, OnceLogger):
        return logger.logger
    if isinstance(logger, str):
        return logging.getLogger(logger)
    return logger


# ---- trace time ---------------------------------------------------------------------------------

# Arguments gathered by the comptime callbacks of one helper call. Dynamo traces one frame at a
# time on one thread, and the callbacks of a call run back to back, so a single buffer is enough.
_trace_args: list = []


def _value_of(var: Any) -> Any:
    """A ComptimeVar's Python value: the constant, or for a SymInt/SymFloat its hint (no guard)."""
    if var.is_python_constant():
        return var.as_python_constant()
    try:
        fake = var.as_fake()
    except Exception:  # noqa: BLE001 - not a tensor or symbol: show what we can
        return f"<{getattr(var.python_type(), '__name__', 'object')}>"
    if isinstance(fake, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = getattr(fake.node, "hint", None)
        return hint if hint is not None else str(fake)
    if isinstance(fake, torch.Tensor):
        return f"tensor(shape={list(fake.shape)}, dtype={fake.dtype})"
    return fake


def _user_location(stacklevel: int) -> Optional[Tuple[str, int, str]]:
    """The traced frame ``stacklevel`` levels up, counting from the helper's caller (1 = the caller).

    Frames of this file are skipped. Frames outside the compiled region are not in Dynamo's stack:
    a level above the compiled function reports the compiled function's line instead.
    """
    frames = list(torch._guards.TracingContext.extract_stack())
    user = [f for f in frames if os.path.normcase(os.path.abspath(f.filename)) != _THIS_FILE]
    if not user:
        return None
    frame: traceback.FrameSummary = user[-min(stacklevel, len(user))]
    return frame.filename, frame.lineno or 0, frame.name


def _python_value(var: Any) -> Any:
    """The object behind a ComptimeVar that is not a constant (a Logger passed by the caller).

    Dynamo has no constant form for a ``logging.Logger``; its variable tracker holds the object.
    This reaches through comptime's documented escape hatch, so it may need updating with torch.
    """
    if var.is_python_constant():
        return var.as_python_constant()
    tracker = var._i_will_not_complain_if_bc_breaks_VariableTracker()
    tracker = tracker.realize() if hasattr(tracker, "realize") else tracker
    return tracker.value


def _comptime_begin(ctx: Any) -> None:
    _trace_args.clear()


def _comptime_arg(ctx: Any) -> None:
    _trace_args.append(_value_of(ctx.get_local("arg")))


def _comptime_emit(ctx: Any) -> None:
    args = tuple(_trace_args)
    _trace_args.clear()
    try:
        kind = ctx.get_local("kind").as_python_constant()
        target = _python_value(ctx.get_local("target"))
        detail = ctx.get_local("detail").as_python_constant()
        msg = ctx.get_local("msg").as_python_constant()
        stacklevel = ctx.get_local("stacklevel").as_python_constant()
        location = _user_location(stacklevel)
        if kind == "log":
            emit_log_once(_resolve_logger(target), detail, msg, args, location)
        else:
            emit_warning_once(format_message(msg, args), detail, location)
    except Exception:  # noqa: BLE001 - a message must never abort a compile
        _log.debug("torchpatches: could not emit a message at trace time", exc_info=True)


def _emit_at_trace_time(kind: str, target: Any, detail: Any, msg: str, args: Tuple[Any, ...], stacklevel: int) -> None:
    """Traced by Dynamo: runs the emission in comptime callbacks, so the graph gets nothing."""
    # Imported here: torch._dynamo costs seconds to import and is loaded anyway once Dynamo traces.
    from torch._dynamo.comptime import comptime

    comptime(_comptime_begin)
    for arg in args:  # unrolled by Dynamo; each callback reads this frame's ``arg``
        comptime(_comptime_arg)
    comptime(_comptime_emit)


# ---- public API ---------------------------------------------------------------------------------


def warning_once(
    logger: LoggerLike, msg: str, *args: Any, level: int = logging.WARNING, stacklevel: int = 1
) -> None:
    """``logger.log(level, msg, *args)`` once per distinct message; never breaks a compiled graph.

    ``logger`` is a ``logging.Logger``, an :class:`OnceLogger` or a logger name. ``stacklevel`` as
    in ``Logger.log``: 1 reports the line that called this function.
    """
    if is_compiling():
        # The logger is not touched in traced code (Dynamo 2.11 fails even on isinstance(Logger)).
        _emit_at_trace_time("log", logger, level, msg, args, stacklevel)
        return
    emit_log_once(_resolve_logger(logger), level, msg, args, stacklevel=stacklevel + 1)


def warn_once(
    message: str, category: Type[Warning] = UserWarning, stacklevel: int = 2, *, args: Tuple[Any, ...] = ()
) -> None:
    """``warnings.warn(message % args, category, stacklevel)`` once per distinct message and category.

    ``stacklevel`` as in ``warnings.warn``: 1 is the line calling ``warn_once``, 2 its caller.
    Under compile the warning is attributed to the traced source line (``warnings.warn_explicit``).
    """
    if is_compiling():
        _emit_at_trace_time("warn", None, category, message, args, stacklevel)
        return
    emit_warning_once(format_message(message, args), category, stacklevel=stacklevel + 1)


class OnceLogger:
    """A stand-in for a module's ``logging.Logger`` that Dynamo traces without a graph break.

    ``warning``/``warn`` go through :func:`warning_once` (the same message once). ``debug``,
    ``info``, ``error``, ``critical`` and ``log`` behave exactly like the logger's in eager (every
    call) and under compile are emitted once at trace time. Anything else (``setLevel``,
    ``isEnabledFor``, ``handlers``...) is the wrapped logger's.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.name = logger.name

    def __repr__(self) -> str:
        return f"OnceLogger({self.logger!r})"

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "logger":  # not set yet (copy/pickle build the object without __init__)
            raise AttributeError(attribute)
        return getattr(self.logger, attribute)

    def _always(self, level: int, msg: str, args: Tuple[Any, ...], kwargs: Any) -> None:
        if is_compiling():
            _emit_at_trace_time("log", self.name, level, msg, args, 1)
            return
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 2
        self.logger.log(level, msg, *args, **kwargs)

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        if is_compiling():
            _emit_at_trace_time("log", self.name, logging.WARNING, msg, args, 1)
            return
        if kwargs:  # exc_info / extra / stack_info: the logger formats the record itself
            if self.logger.isEnabledFor(logging.WARNING) and first_time(
                ("log", self.name, logging.WARNING, format_message(msg, args))
            ):
                kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
                if not formats_cleanly(msg, args):
                    msg, args = format_message(msg, args), ()
                self.logger.warning(msg, *args, **kwargs)
            return
        emit_log_once(self.logger, logging.WARNING, msg, args, stacklevel=2)

    warn = warning

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._always(logging.DEBUG, msg, args, kwargs)

    def info(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._always(logging.INFO, msg, args, kwargs)

    def error(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._always(logging.ERROR, msg, args, kwargs)

    def critical(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._always(logging.CRITICAL, msg, args, kwargs)

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        self._always(level, msg, args, kwargs)


def constant_query(fn: _F) -> _F:
    """Cache ``fn`` per arguments and let Dynamo fold its result into the graph as a constant.

    For process-level facts: library / torch version checks, "is FlashAttention importable",
    device capability of a fixed device, an environment variable read once. Dynamo calls the query
    while tracing and bakes the result in, *without a guard*: the compiled code keeps using that
    value even if the answer would change later.

    Unsafe (wrong results, silently) when the answer can change after the first compile: values
    that depend on mutable state (a config flag the user toggles, ``torch.is_grad_enabled()``, the
    current device/stream, an env var set later), on the call's tensors, or that must differ per
    call. Arguments must be Python constants (str, int, bool, None, tuples of them, enum members)
    -- not tensors and not shapes under ``dynamic=True`` (2.11 fails the compile, 2.13 breaks the
    graph). Results must be constants too (None, bool, int, float, str, tuples of them).
    ``query.cache_clear()`` clears the eager cache; compiled code keeps its value until
    ``torch._dynamo.reset()``.
    """
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def query(*args: Any, **kwargs: Any) -> Any:
        return cached(*args, **kwargs)

    query.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    query.cache_info = cached.cache_info  # type: ignore[attr-defined]
    return assume_constant(query)  # type: ignore[return-value]
