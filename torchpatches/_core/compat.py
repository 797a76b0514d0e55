"""Compile-safe primitives shared by ``torchpatches.compile``, ``torchpatches.ops`` and the patches.

One place for the few things that depend on how Dynamo treats Python code, so there is one
mechanism to update when torch changes. Cheap to import: torch, and nothing of Dynamo, Inductor
or triton (``torch.compiler.assume_constant_result`` itself imports Dynamo, 1-2 s).

- :func:`is_compiling`: true while Dynamo traces (Dynamo folds it to a constant);
- :func:`assume_constant`: ``torch.compiler.assume_constant_result`` without importing Dynamo;
- :func:`emit_log_once` / :func:`emit_warning_once`: a log record or a warning once per distinct
  text in the process, from code that runs in Python (eager, or a trace-time callback);
  :func:`reset_once` forgets what was emitted.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import warnings
from typing import Any, Callable, Hashable, Optional, Tuple, Type, TypeVar

import torch

__all__ = [
    "is_compiling", "assume_constant", "first_time", "reset_once", "format_message", "formats_cleanly", "emit_log_once",
    "emit_warning_once",
]

_F = TypeVar("_F", bound=Callable[..., Any])
#: (filename, line, function) of the traced user line a trace-time message is attributed to.
Location = Tuple[str, int, str]

_seen: set = set()
_seen_lock = threading.Lock()


def is_compiling() -> bool:
    """True while Dynamo traces the calling code; Dynamo folds the call to a constant (no graph break)."""
    return bool(torch.compiler.is_compiling())


def assume_constant(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result(fn)`` without importing Dynamo at import time.

    In torch 2.4-2.13 the public decorator only sets the attribute below, which Dynamo reads when it
    meets the function (verified in torch/_dynamo/decorators.py of 2.11 and 2.13). Once Dynamo is
    loaded the public API is used, so a torch that does more there gets it.
    """
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)  # type: ignore[return-value]
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def reset_once() -> None:
    """Forget which messages were emitted (they are emitted again on their next occurrence)."""
    with _seen_lock:
        _seen.clear()


def first_time(key: Hashable) -> bool:
    """True the first time ``key`` is seen in this process (until :func:`reset_once`)."""
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def format_message(msg: Any, args: Tuple[Any, ...]) -> str:
    """Logging's formatting rule: ``msg % args`` only when there are args (a bare '%' stays).

    Never raises. When ``%`` refuses the arguments -- a ``%d`` given a tensor (under compile a tensor
    argument is only a stand-in text: its value does not exist at trace time), too many or too few
    arguments -- every conversion is retried as ``%s``, then the arguments are appended: the message
    is kept, a caller's formatting slip never takes the model down or loses the text.
    """
    text = str(msg)
    if not args:
        return text
    try:
        return text % args
    except (TypeError, ValueError, KeyError):
        pass
    try:
        return _CONVERSION.sub(lambda m: "%%" if m.group(0) == "%%" else "%s", text) % args
    except (TypeError, ValueError, KeyError):
        return f"{text} {args!r}"


# One printf-style conversion (or a literal %%), as ``str % tuple`` parses them.
_CONVERSION = re.compile(r"%%|%[#0\- +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?[diouxXeEfFgGcrsa]")


def formats_cleanly(msg: Any, args: Tuple[Any, ...]) -> bool:
    """Whether logging can format ``msg % args`` itself (else its handler prints '--- Logging error ---')."""
    if not args:
        return True
    try:
        str(msg) % args
    except Exception:  # noqa: BLE001 - whatever % raises, logging would raise it in the handler
        return False
    return True


def emit_log_once(
    logger: logging.Logger, level: int, msg: Any, args: Tuple[Any, ...] = (),
    location: Optional[Location] = None, stacklevel: int = 1,
) -> None:
    """``logger.log(level, msg, *args)`` unless the same text was logged at this level on this logger.

    The level is checked first, as ``Logger.log`` does, and a message the logger does not show is not
    counted (enabling the logger later shows it). The record carries ``msg`` and ``args`` unchanged.
    ``location``: the traced user line, for trace-time callbacks (the Python stack there is Dynamo's).
    """
    if not logger.isEnabledFor(level):
        return
    if not first_time(("log", logger.name, level, format_message(msg, args))):
        return
    if not formats_cleanly(msg, args):  # hand logging text it can print, not a record that fails later
        msg, args = format_message(msg, args), ()
    if location is None:
        logger.log(level, msg, *args, stacklevel=stacklevel + 1)
        return
    pathname, lineno, func = location
    logger.handle(logger.makeRecord(logger.name, level, pathname, lineno, msg, args, None, func=func))


def emit_warning_once(
    text: str, category: Type[Warning], location: Optional[Location] = None, stacklevel: int = 1
) -> None:
    """``warnings.warn(text, category)`` unless the same text and category were warned before.

    ``stacklevel`` counts from the caller of this function, as in ``warnings.warn``.
    """
    if not first_time(("warn", category.__module__, category.__qualname__, text)):
        return
    if location is None:
        warnings.warn(text, category, stacklevel=stacklevel + 1)
        return
    pathname, lineno, _ = location
    warnings.warn_explicit(text, category, pathname, lineno)
