"""inductor_fallback_log: Inductor's "Creating implicit fallback" log line costs nothing while INFO is off
(torch 2.11, 2.12).

What goes wrong upstream
    When Inductor meets an op without a lowering (every custom op of a serving stack) it logs
    ``log.info("Creating implicit fallback for:\\n%s", error.operator_str(target, args, kwargs))``
    (``GraphLowering.call_function``). The argument is built before ``log.info`` looks at the level:
    ``operator_str`` prints every input's IR tree, whose text grows with the unrealized pointwise chain feeding it,
    also with INFO logging off. vLLM reports compiles of deep MoE / tensor-parallel graphs minutes slower for it and
    works around it in its ``env_override.py`` (``FALLBACK_ALLOW_LIST``, vllm-project/vllm#42129, which also drops the
    default layout constraint of its own ops: a policy, not this fix). torch 2.13 passes
    ``LazyString(error.operator_str, ...)`` instead.

What the patch changes
    ``OperatorIssue.operator_str``, called from ``GraphLowering.call_function`` (that caller only, read from the
    calling frame), returns an object whose ``str()`` is the original's text, built on first use: the log record
    formats it only when emitted. Every other caller (the ``MissingOperator*`` errors, user code) gets the original's
    ``str``, computed at once. Compiled code is unchanged (no Inductor cache key).

Versions
    torch 2.11.0 and 2.12.1 (``operator_str`` fingerprint ``d7c1758d4f17e93d``, read; their ``call_function`` makes the
    eager call). 2.13.0 ships the same ``operator_str`` with the lazy call site: the gate stops at ``<2.13`` (the
    replacement would defer nothing there, its ``call_function`` never calling it); 2.15.0 differs by fingerprint.

When to delete
    When the supported torch floor is 2.13.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from .._core.declare import Patch, Target

__all__ = ["PATCH", "make_replacement", "DeferredText"]

_EXC = "torch._inductor.exc"


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


PATCH = Patch(
    name="inductor_fallback_log",
    summary="torch 2.11/2.12 Inductor: the implicit-fallback INFO log line is formatted only when emitted",
    targets=(
        Target(f"{_EXC}:OperatorIssue.operator_str", make_replacement=make_replacement,
               fingerprints=frozenset({"d7c1758d4f17e93d"})),  # torch 2.11.0, 2.12.1 (and 2.13.0: see requires)
    ),
    # 2.13 has the same operator_str but formats it lazily at the call site itself (its call_function never calls
    # it). Not ``verifies`` on call_function: torch._inductor.exc loads while Inductor's modules are half-run, and
    # reading torch._inductor.graph then would import it in the middle of that chain.
    requires={"torch": ">=2.11,<2.13"},
)
