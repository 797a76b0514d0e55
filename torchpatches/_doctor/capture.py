"""Record what Dynamo does while a block of code runs: graph breaks, recompiles, graphs compiled.

    with capture() as events:
        compiled(x)
    events.breaks, events.recompiles, events.graphs, events.notes

Used by the doctor and by the tiny-model test harness. Dynamo has no public API for this, so the
capture hooks two internals for the duration of the block (and puts the originals back after it);
read in the sources of torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0, which all have these names and
signatures:

- graph breaks: ``torch._dynamo.symbolic_convert.InstructionTranslatorBase.log_graph_break(self,
  code_options, reason, exc)``. Every graph break Dynamo reports (``TORCH_LOGS=graph_breaks``) passes
  through it once (``exc.logged``), including a break before the first op of a frame, which
  ``torch._dynamo.explain`` does not count. ``exc.real_stack`` holds the traced user frames,
  ``exc.gb_type`` the graph-break type (the registry key behind Dynamo's ``gbNNNN`` pages).
- recompiles: ``torch._dynamo.convert_frame.get_and_maybe_log_recompilation_reasons(cache_entry(s),
  frame, backend, skip_logging=False)``, called once each time a frame is compiled again because the
  guards of every earlier compile failed; it returns the guard failures.
- graphs: ``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` (not cleared by ``reset()``).

On a torch where a hook point moved, that part is not captured and ``notes`` says so; nothing raises.
Importing this module imports nothing from Dynamo; entering ``capture()`` does.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import threading
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Tuple

__all__ = ["Frame", "GraphBreak", "Recompile", "Capture", "capture", "in_progress", "clean_function_name"]

_log = logging.getLogger("torchpatches")


class Frame(NamedTuple):
    file: str
    line: int
    function: str


class GraphBreak(NamedTuple):
    """One graph break as Dynamo logged it."""

    file: str  # innermost traced frame: where Dynamo stopped
    line: int
    function: str
    reason: str  # the graph-break type ("logging.Logger method not supported for non-export cases")
    explanation: str  # Dynamo's explanation, when it gives one
    hints: Tuple[str, ...]  # Dynamo's own hints
    gb_id: str  # "GB0291" when Dynamo links its graph-break page, else ""
    stack: Tuple[Frame, ...]  # traced frames, outermost first
    detail: str  # the full text Dynamo logged


class Recompile(NamedTuple):
    """A frame compiled again because the guards of its earlier compile(s) failed."""

    function: str
    file: str
    line: int  # first line of the function
    reasons: Tuple[str, ...]  # one per earlier compile, as Dynamo words it ("tensor 'x' size mismatch ...")


class Capture:
    """What happened inside one ``capture()`` block (filled in while it runs)."""

    def __init__(self) -> None:
        self.breaks: List[GraphBreak] = []
        self.recompiles: List[Recompile] = []
        self.graphs: Optional[int] = None  # graphs compiled inside the block; None if unknown
        self.notes: List[str] = []  # what could not be captured on this torch, and why
        self._graphs_at_start: Optional[int] = None


_RESUME = re.compile(r"^(?:(.+)\.)?torch_dynamo_resume_in_(.+)_at_\d+$")


def clean_function_name(name: str) -> str:
    """Dynamo's resume functions (``torch_dynamo_resume_in_forward_at_737``, qualified by their class on
    Python 3.11+: ``FluxTransformer2DModel.torch_dynamo_resume_in_forward_at_737``) by the function they resume."""
    match = _RESUME.match(name)
    if not match:
        return name
    owner, function = match.groups()
    return f"{owner}.{function}" if owner else function


def _frames(stack: Any) -> Tuple[Frame, ...]:
    frames = []
    for summary in stack or ():
        frames.append(Frame(summary.filename, summary.lineno or 0, clean_function_name(summary.name)))
    return tuple(frames)


_GB_PAGE = re.compile(r"/gb/(gb\d+)\.html", re.IGNORECASE)


def _parse_reason(reason: str, gb_type: Optional[str]) -> Tuple[str, str, Tuple[str, ...], str]:
    """(type, explanation, hints, gb id) from Dynamo's text (2.11/2.13 format; degrades to line 1)."""
    lines = [line.strip() for line in reason.splitlines()]
    explanation, hints = "", []
    for line in lines:
        if line.startswith("Explanation:") and not explanation:
            explanation = line[len("Explanation:"):].strip()
        elif line.startswith("Hint:"):
            hints.append(line[len("Hint:"):].strip())
    page = _GB_PAGE.search(reason)
    kind = (gb_type or "").strip()
    if not kind:
        meaningful = [line for line in lines if line and not line.startswith("Encountered graph break")]
        kind = meaningful[0] if meaningful else reason.strip()
    return kind, explanation, tuple(hints), page.group(1).upper() if page else ""


# ---- the hooks ----------------------------------------------------------------------------------

_lock = threading.RLock()
_active: List[Capture] = []
_restore: List[Callable[[], None]] = []


def _record_break(tracer: Any, code_options: Any, reason: Any, exc: Any) -> None:
    stack = _frames(getattr(exc, "real_stack", None))
    if not stack:
        import torch

        stack = _frames(torch._guards.TracingContext.extract_stack())
    if stack:
        file, line, function = stack[-1]
    else:  # first instruction of a frame: Dynamo points at the frame itself
        file = str(code_options.get("co_filename", "?"))
        line = int(code_options.get("co_firstlineno", 0))
        function = clean_function_name(str(code_options.get("co_name", "?")))
    text = str(reason)
    kind, explanation, hints, gb_id = _parse_reason(text, getattr(exc, "gb_type", None))
    event = GraphBreak(file, line, function, kind, explanation, hints, gb_id, stack, text)
    for active in list(_active):
        active.breaks.append(event)


def _compiled_function(frame: Any) -> Tuple[str, str, int]:
    """(name, file, first line) of the user's function a recompiled frame belongs to.

    A compiled ``nn.Module`` is entered through a small Dynamo wrapper (``external_utils.wrap_inline``)
    whose local ``fn`` is the module (2.13) or its bound ``__call__``: report the module's ``forward``.
    """
    code = frame.f_code
    found = (clean_function_name(getattr(code, "co_qualname", code.co_name)), code.co_filename, code.co_firstlineno)
    if f"{os.sep}_dynamo{os.sep}" not in code.co_filename:
        return _decorated_forward(frame, code) or found
    try:
        wrapped = frame.f_locals.get("fn")
    except Exception:  # noqa: BLE001
        return found
    if wrapped is None:
        return found
    owner = getattr(wrapped, "__self__", None)
    if owner is not None:  # a bound method: the module's forward for its call methods, else the method
        calls = ("__call__", "_call_impl", "_wrapped_call_impl")
        forward = getattr(type(owner), "forward", None) if getattr(wrapped, "__name__", "") in calls else None
        forward = forward if forward is not None else getattr(wrapped, "__func__", None)
    elif not hasattr(wrapped, "__code__") and hasattr(type(wrapped), "forward"):  # the module itself
        forward = type(wrapped).forward
    else:
        forward = wrapped
    forward_code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    if forward_code is None:
        return found
    name = getattr(forward_code, "co_qualname", forward_code.co_name)
    return name, forward_code.co_filename, forward_code.co_firstlineno


def _decorated_forward(frame: Any, code: Any) -> Optional[Tuple[str, str, int]]:
    """The forward a decorator wraps, when the recompiled frame is that decorator's wrapper.

    diffusers wraps many model forwards in ``@apply_lora_scale`` (``functools.wraps``): the frame Dynamo
    compiles is the wrapper in peft_utils.py, yet the user's question is about the model's ``forward``.
    """
    try:
        owner = frame.f_locals.get("self")
        forward = getattr(type(owner), "forward", None) if owner is not None else None
        if forward is None or getattr(forward, "__code__", None) is not code:
            return None
        inner = getattr(inspect.unwrap(forward), "__code__", None)
    except Exception:  # noqa: BLE001 - odd objects: keep the frame's own name
        return None
    if inner is None or inner is code:
        return None
    return getattr(inner, "co_qualname", inner.co_name), inner.co_filename, inner.co_firstlineno


def _record_recompile(frame: Any, reasons: Any) -> None:
    name, file, line = _compiled_function(frame)
    event = Recompile(name, file, line, tuple(str(r) for r in reasons or ()))
    for active in list(_active):
        active.recompiles.append(event)


def _parameters(function: Any) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _expect_parameters(function: Any, names: Tuple[str, ...]) -> Optional[str]:
    found = _parameters(function)[: len(names)]
    if found != names:
        return f"its parameters are {found}, expected {names}"
    return None


def _install() -> List[str]:
    """Install the hooks; returns notes about the ones that could not be installed."""
    notes: List[str] = []
    try:
        from torch._dynamo import convert_frame, symbolic_convert
    except Exception as error:  # noqa: BLE001 - a torch without Dynamo: nothing to capture
        return [f"torch._dynamo is not importable ({type(error).__name__}: {error}); nothing captured"]

    translator = getattr(symbolic_convert, "InstructionTranslatorBase", None)
    log_graph_break = getattr(translator, "log_graph_break", None) if translator is not None else None
    problem = (
        "it is missing" if log_graph_break is None
        else _expect_parameters(log_graph_break, ("self", "code_options", "reason", "exc"))
    )
    if problem is None:
        original_break = log_graph_break

        def hooked_log_graph_break(self: Any, code_options: Any, reason: Any, exc: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(exc, "logged", False):
                try:
                    _record_break(self, code_options, reason, exc)
                except Exception:  # noqa: BLE001 - recording must never change what Dynamo does
                    _log.debug("torchpatches: could not record a graph break", exc_info=True)
            return original_break(self, code_options, reason, exc, *args, **kwargs)

        translator.log_graph_break = hooked_log_graph_break
        _restore.append(lambda: setattr(translator, "log_graph_break", original_break))
    else:
        notes.append(
            f"graph breaks not captured: InstructionTranslatorBase.log_graph_break on this torch: {problem}"
        )

    recompilation = getattr(convert_frame, "get_and_maybe_log_recompilation_reasons", None)
    params = _parameters(recompilation) if recompilation is not None else ()
    if recompilation is None:
        problem = "it is missing"
    elif len(params) < 2 or params[1] != "frame" or "skip_logging" not in params:
        problem = f"its parameters are {params}, expected (cache_entry, frame, backend, skip_logging)"
    if problem is None:
        original_recompilation = recompilation

        def hooked_recompilation(*args: Any, **kwargs: Any) -> Any:
            reasons = original_recompilation(*args, **kwargs)
            skip = kwargs.get("skip_logging", args[3] if len(args) > 3 else False)
            if not skip:
                try:
                    frame = kwargs.get("frame", args[1] if len(args) > 1 else None)
                    if frame is not None:
                        _record_recompile(frame, reasons)
                except Exception:  # noqa: BLE001
                    _log.debug("torchpatches: could not record a recompile", exc_info=True)
            return reasons

        convert_frame.get_and_maybe_log_recompilation_reasons = hooked_recompilation
        _restore.append(lambda: setattr(convert_frame, "get_and_maybe_log_recompilation_reasons", original_recompilation))
    else:
        notes.append(
            "recompiles not captured: torch._dynamo.convert_frame.get_and_maybe_log_recompilation_reasons"
            f" on this torch: {problem}"
        )
    return notes


def _uninstall() -> None:
    while _restore:
        _restore.pop()()


def _graph_counter() -> Optional[int]:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return None


_install_notes: List[str] = []


def in_progress() -> Optional[Capture]:
    """The innermost ``capture()`` block running now, its graph count brought up to date: what a
    process that ends inside the block (``os._exit``) can still report."""
    with _lock:
        if not _active:
            return None
        result = _active[-1]
    end, start = _graph_counter(), result._graphs_at_start
    if start is not None and end is not None and end >= start:
        result.graphs = end - start
    return result


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    """Record Dynamo's graph breaks and recompiles (and count graphs) inside the block.

    Captures nest; each sees every event inside its own block. The hooks are removed when the
    outermost block exits.
    """
    result = Capture()
    with _lock:
        if not _active:
            _install_notes[:] = _install()
        result.notes.extend(_install_notes)
        _active.append(result)
    result._graphs_at_start = _graph_counter()
    try:
        yield result
    finally:
        end = _graph_counter()
        start = result._graphs_at_start
        if start is not None and end is not None and end >= start:
            result.graphs = end - start
        elif "graph count" not in " ".join(result.notes):
            result.notes.append("graph count not available (torch._dynamo.utils.counters['stats'])")
        with _lock:
            _active.remove(result)
            if not _active:
                _uninstall()
