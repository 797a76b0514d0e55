"""The tests' harness, shared with the benchmarks: the package's tiny models and compile reports
(``torchpatches._harness``) plus the fixtures only tests and benchmarks use.

- ``programs``: what tests and benchmarks both measure (graph-break cases, realize programs);
- ``references``: RoPE in float64, relative error;
- ``logs``: log capture, silencing, diffusers' attention-check switch;
- ``variants``: alternatives a patch decided against, bound in its place for a block.

Importable as ``harness`` from the tests (``tests/`` is on ``sys.path`` through its ``conftest.py``) and from the
benchmarks (``benchmarks/_bench.py`` puts it there).
"""
from __future__ import annotations

from torchpatches._harness import families, models, production, registry
from torchpatches._harness.models import CONFIGS, build_model, tiny_inputs
from torchpatches._harness.reports import (
    GraphReport, InductorReport, count_buffers, count_kernels, graph_report, inductor_report,
)

from .logs import LogRecords, attn_checks, capture_logs, quiet
from .programs import GRAPH_BREAK_CASES, REALIZE_PROGRAMS, GraphBreakCase, Program
from .references import rel_err, rope_reference
from .variants import replacing, rope_op_under_compile

__all__ = [
    "families", "models", "production", "registry", "CONFIGS", "build_model", "tiny_inputs",
    "GraphBreakCase", "GRAPH_BREAK_CASES", "Program", "REALIZE_PROGRAMS",
    "GraphReport", "graph_report", "InductorReport", "inductor_report", "count_kernels", "count_buffers",
    "rope_reference", "rel_err",
    "LogRecords", "capture_logs", "quiet", "attn_checks",
    "replacing", "rope_op_under_compile",
]
