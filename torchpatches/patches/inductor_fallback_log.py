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
from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.inductor_fallback_log"
_EXC = "torch._inductor.exc"


# 2.13 has the same operator_str but formats it lazily at the call site itself (its call_function never calls
# it). Not ``verifies`` on call_function: torch._inductor.exc loads while Inductor's modules are half-run, and
# reading torch._inductor.graph then would import it in the middle of that chain.
PATCH = Patch("inductor_fallback_log", targets=Target(
    f"{_EXC}:OperatorIssue.operator_str", f"{_BODY}:make_replacement",
    {"d7c1758d4f17e93d"}),  # torch 2.11.0, 2.12.1 (and 2.13.0: see requires)
    summary="torch 2.11/2.12 Inductor: the implicit-fallback INFO log line is formatted only when emitted",
    requires={"torch": ">=2.11,<2.13"})
