"""The project's own test harness (private): shared by the tests, the benchmarks and ``python -m torchpatches demo``.

- ``models``: tiny diffusers models by name and their inputs;
- ``programs``: what tests and benchmarks both measure (graph-break cases, realize programs);
- ``reports``: what a compile did (graphs and breaks, Inductor's kernels and bytes);
- ``references``: RoPE in float64, relative error;
- ``logs``: log capture, silencing, diffusers' attention-check switch;
- ``variants``: alternatives a patch decided against, bound in its place for a block.

Not imported by ``import torchpatches``; Dynamo, Inductor and diffusers are imported when used.
``torchpatches.testing`` re-exports the parts users may want.
"""
from __future__ import annotations

from .logs import LogRecords, attn_checks, capture_logs, quiet
from .models import CONFIGS, build_model, tiny_inputs
from .programs import GRAPH_BREAK_CASES, REALIZE_PROGRAMS, GraphBreakCase, Program
from .references import rel_err, rope_reference
from .reports import GraphReport, InductorReport, count_buffers, count_kernels, graph_report, inductor_report
from .variants import replacing, rope_op_under_compile

__all__ = [
    "CONFIGS", "build_model", "tiny_inputs",
    "GraphBreakCase", "GRAPH_BREAK_CASES", "Program", "REALIZE_PROGRAMS",
    "GraphReport", "graph_report", "InductorReport", "inductor_report", "count_kernels", "count_buffers",
    "rope_reference", "rel_err",
    "LogRecords", "capture_logs", "quiet", "attn_checks",
    "replacing", "rope_op_under_compile",
]
