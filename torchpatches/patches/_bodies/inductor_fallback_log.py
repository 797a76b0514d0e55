"""The ``inductor_fallback_log`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/inductor_fallback_log.py``."""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional


class DeferredText:
    """``str(self)`` is ``build(*args)``, computed once, when first asked for (a log record's ``%s``)."""

    __slots__ = ("_build", "_args", "_text")

    def __init__(self, build: Callable[..., str], *args: Any) -> None:
        self._build, self._args = build, args
        self._text: Optional[str] = None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._build(*self._args)
            self._args = ()
        return self._text

    def __repr__(self) -> str:
        return repr(str(self))


def _call_function_code() -> Any:
    """The code of ``GraphLowering.call_function`` (read per call: ``torch._inductor.exc`` loads before ``graph``)."""
    graph = sys.modules.get("torch._inductor.graph")
    lowering = getattr(graph, "GraphLowering", None)
    return getattr(getattr(lowering, "call_function", None), "__code__", None)


def make_replacement(original: Any) -> Any:
    build = original.__func__ if isinstance(original, staticmethod) else original

    def operator_str(target: Any, args: Any, kwargs: Any) -> Any:
        """torchpatches: deferred for the implicit-fallback log line (GraphLowering.call_function), else the original."""
        code = sys._getframe(1).f_code
        if code.co_name == "call_function" and code is _call_function_code():
            return DeferredText(build, target, args, kwargs)
        return build(target, args, kwargs)

    return staticmethod(operator_str)
