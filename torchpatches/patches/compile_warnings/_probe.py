"""Whether the running torch's Dynamo traces diffusers' two kinds of warning site on its own.

compile_warnings exists because Dynamo splits the graph at ``logger.warning(...)`` and at
``warnings.warn(...)``. Upstream work could change that: pytorch/pytorch#181476 (skip Logger methods
by default; closed, not landed), #186072 (replay constant ``warnings.warn`` after the graph by
default; not in any release through 2.15.0) and #190840 (Logger methods registered in
``torch._dynamo.config.reorderable_logging_functions`` replay after the graph; opt-in, in 2.14 and
2.15). Users can also opt in today with ``torch._dynamo.config.ignore_logging_functions``
(``logging.Logger.warning`` and ``warnings.warn``: both calls then vanish from compiled code).

Rather than trusting version numbers, the patch measures: it compiles, with ``fullgraph=True``, a
function that makes the two calls the way diffusers does (a module logger's ``.warning(...)`` with
``%``-arguments; ``warnings.warn(message, FutureWarning, stacklevel=...)`` as ``deprecate()`` does).
If both trace in one graph, the patch has nothing to fix and reports
``skipped: torch <version> traces these sites itself``. Measured on torch 2.11.0, 2.12.1, 2.13.0,
2.14.1 and 2.15.0 with the default configuration: neither traces.

The probe runs once per process, when compile_warnings first applies (diffusers has already
imported Dynamo by then); it costs about 0.25 s, most of it Dynamo's first compile. It never emits
anything: its logger is disabled and its warning is filtered.
"""
from __future__ import annotations

import functools
import logging
import types
import warnings
from typing import Any, List

__all__ = ["torch_traces_warning_sites", "probe_warning_sites"]

# A private logger, disabled, so that a probe that runs eagerly or replays its calls prints nothing.
_probe_logger = logging.getLogger("torchpatches.probe.warning_sites")
_probe_logger.addHandler(logging.NullHandler())
_probe_logger.setLevel(logging.CRITICAL + 1)
_probe_logger.propagate = False


def _logger_site(x: Any) -> Any:
    _probe_logger.warning("probe: %s", "logger site")
    return x + 1


def _warn_site(x: Any) -> Any:
    warnings.warn("probe: warnings.warn site", FutureWarning, stacklevel=2)
    return x + 1


def _traces_in_one_graph(site: Any) -> bool:
    import torch

    # A fresh code object per probe, so repeated probes never pile up in Dynamo's per-code cache.
    fresh = types.FunctionType(site.__code__.replace(), site.__globals__, site.__name__)
    graphs: List[int] = []

    def count_graphs(graph_module: Any, example_inputs: Any) -> Any:
        graphs.append(1)
        return graph_module.forward

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(fresh, backend=count_graphs, fullgraph=True)(torch.zeros(1))
    except Exception:  # noqa: BLE001 - any failure to trace means the site still breaks
        return False
    # No graph at all means Dynamo did not run (TORCHDYNAMO_DISABLE=1): nothing was traced.
    return len(graphs) == 1


def probe_warning_sites() -> dict:
    """``{"logger.warning": bool, "warnings.warn": bool}``: which call forms Dynamo traces right now."""
    return {"logger.warning": _traces_in_one_graph(_logger_site), "warnings.warn": _traces_in_one_graph(_warn_site)}


@functools.lru_cache(maxsize=None)
def torch_traces_warning_sites() -> bool:
    """True if Dynamo traces both kinds of site on its own (measured once per process)."""
    import torch

    if torch.compiler.is_compiling():  # never compile from inside a trace
        return False
    return all(probe_warning_sites().values())
