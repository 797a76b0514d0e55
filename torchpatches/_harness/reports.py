"""What a compile did: :func:`graph_report` (graphs, breaks, whether ``fullgraph=True`` compiles) and
:func:`inductor_report` (the generated code and its kernels, loop nests, loads, buffers, bytes).

Importing this module imports nothing from Dynamo or Inductor; the reports do when called.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["GraphReport", "graph_report", "InductorReport", "inductor_report", "count_kernels", "count_buffers"]


class GraphReport(NamedTuple):
    """What Dynamo made of a call: ``graphs``/``breaks`` as ``torch._dynamo.explain`` counts them (None when
    Dynamo itself raised), every break Dynamo logged (``sites``), and whether ``fullgraph=True`` compiles.

    explain under-reports (a break before a frame's first graph, e.g. a warning in a decorator, shows as 0
    breaks); the capture does not, so ``fullgraph`` is "no break logged" unless a real ``fullgraph=True``
    compile was asked for (``graph_report(..., backend=...)``), which then decides it."""

    graphs: Optional[int]
    breaks: Optional[int]
    fullgraph: bool
    reasons: Tuple[str, ...]  # first lines of the break reasons, sorted, without repeats
    error: str  # why Dynamo or the fullgraph compile failed, or the first logged break ("" when none)
    output: Any = None  # the fullgraph-compiled call's result (with a backend)
    seconds: float = 0.0  # compile and first call with fullgraph=True (with a backend)
    # Every graph break Dynamo logged during the explain run, as the doctor captures them
    # (torchpatches._doctor.capture: file, line, reason, traced stack), including those explain does not count.
    sites: Tuple[Any, ...] = ()

    @property
    def break_sites(self) -> Tuple[Tuple[str, int], ...]:
        """Distinct ``(file name, line)`` where Dynamo broke the graph, sorted."""
        return tuple(sorted({(os.path.basename(site.file), site.line) for site in self.sites}))


def graph_report(fn: Callable[..., Any], *args: Any, backend: Optional[str] = None, **kwargs: Any) -> GraphReport:
    """Explain ``fn(*args, **kwargs)``, capturing every break Dynamo logs as the doctor does: one Dynamo pass.

    With a ``backend`` (``"eager"``, ``"inductor"``), also compile it with ``fullgraph=True`` and that
    backend and call it (a second pass): ``fullgraph``, ``output``, ``seconds`` and ``error`` come from that
    try. Without one, ``fullgraph`` means no break was logged, and it is tried only where this torch's
    breaks could not be captured. Warnings are silenced meanwhile; Dynamo's caches are reset before and after.
    """
    import torch._dynamo

    from .._doctor.capture import capture

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        try:
            with capture() as captured:
                explanation = torch._dynamo.explain(fn)(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a hard Dynamo error is a result too (2.11 attn checks)
            torch._dynamo.reset()
            return GraphReport(None, None, False, (_first_line(error),), _first_line(error), sites=tuple(captured.breaks))
        torch._dynamo.reset()
        reasons = tuple(sorted({str(r.reason).splitlines()[0][:90] for r in explanation.break_reasons}))
        report = GraphReport(explanation.graph_count, explanation.graph_break_count, not captured.breaks, reasons,
                             captured.breaks[0].reason if captured.breaks else "", sites=tuple(captured.breaks))
        if backend is None and not captured.notes:
            return report
        started = time.perf_counter()
        compiled = torch.compile(fn, backend=backend or "eager", fullgraph=True)
        try:
            output, fullgraph, failure = compiled(*args, **kwargs), True, ""
        except Exception as error:  # noqa: BLE001 - any failure means fullgraph does not compile
            output, fullgraph, failure = None, False, _first_line(error)
        seconds = time.perf_counter() - started
        torch._dynamo.reset()
    return report._replace(fullgraph=fullgraph, error=failure, output=output, seconds=seconds)


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}"


class InductorReport(NamedTuple):
    """What Inductor generated for a call (CPU: C++ kernels; GPU: Triton), from a fresh compile.

    kernels  kernel definitions (``cpp_fused_*`` / ``triton_*``), distinct per graph, summed over graphs;
    nests    fused scheduler nodes: loop nests on CPU, kernel launches on GPU (``metrics.nodes_num_elem``);
    loads    load sites in the kernel source (``loadu(``, ``= in_ptrN[``, ``tl.load(``): a static proxy
             for recomputation (an inlined value re-loads its inputs in every consumer);
    buffers  intermediate buffers the wrapper allocates (``empty_strided_*`` calls);
    bytes    Inductor's own estimate of bytes read and written (``metrics.num_bytes_accessed``).
    """

    output: Any
    codes: Tuple[str, ...]  # one generated module per graph
    kernels: int
    nests: int
    loads: int
    buffers: int
    bytes: int
    seconds: float

    @property
    def code(self) -> str:
        return "\n".join(self.codes)


_KERNEL_DEFINITION = re.compile(r"^(?:cpp_fused_\w*|triton_\w+) = async_compile\.", re.MULTILINE)
_LOAD_SITE = re.compile(r"::loadu\(|=\s*(?:in_ptr|in_out_ptr|out_ptr)\d+\[|\btl\.load\(")
_BUFFER_ALLOCATION = re.compile(r"\bempty_strided_\w+\(")
# Inductor writes its metrics through this artifact logger (torch/_inductor/compile_fx.py).
_METRICS_LOGGER = "torch._inductor.compile_fx.__inductor_metrics"


def count_kernels(codes: Sequence[str]) -> int:
    """Kernels defined in generated modules, each module's distinct definitions summed."""
    return sum(len(set(_KERNEL_DEFINITION.findall(code))) for code in codes)


def count_buffers(code: str) -> int:
    return len(_BUFFER_ALLOCATION.findall(code))


@contextlib.contextmanager
def _inductor_metrics_enabled() -> Iterator[None]:
    """Make Inductor compute ``metrics.num_bytes_accessed`` without printing its INFO log.

    ``compile_fx`` counts bytes only when its ``inductor_metrics`` artifact logger is enabled for
    INFO; ``torch._logging.set_logs(inductor_metrics=True)`` would also print the records and reset
    the user's other log settings, so we raise just that logger's level.
    """
    log = logging.getLogger(_METRICS_LOGGER)
    saved = (log.level, log.propagate, list(log.handlers))
    log.setLevel(logging.INFO)
    log.propagate = False
    log.handlers = [logging.NullHandler()]
    try:
        yield
    finally:
        log.level, log.propagate, log.handlers = saved[0], saved[1], saved[2]


def inductor_report(fn: Callable[..., Any], *args: Any, fullgraph: bool = True, **kwargs: Any) -> InductorReport:
    """A fresh Inductor compile of ``fn(*args, **kwargs)`` under ``torch.no_grad()`` (Dynamo reset; the
    FX-graph and AOTAutograd caches off, so nothing is served from an earlier compile) and its counts."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    metrics.reset()
    started = time.perf_counter()
    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False), _inductor_metrics_enabled(), torch.no_grad():
        output, codes = run_and_get_code(torch.compile(fn, fullgraph=fullgraph), *args, **kwargs)
    seconds = time.perf_counter() - started
    torch._dynamo.reset()
    code = "\n".join(codes)
    return InductorReport(
        output=output, codes=tuple(codes), kernels=count_kernels(codes), nests=len(metrics.nodes_num_elem),
        loads=len(_LOAD_SITE.findall(code)), buffers=count_buffers(code), bytes=int(metrics.num_bytes_accessed),
        seconds=seconds,
    )
