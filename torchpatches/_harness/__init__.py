"""What backs ``torchpatches.testing`` and ``python -m torchpatches demo`` (private).

- ``models``: tiny diffusers models by name and their inputs;
- ``reports``: what a compile did (graphs and breaks, Inductor's kernels and bytes).

The project's test-only fixtures (graph-break cases, realize programs, references, log capture, variants)
live in ``tests/harness``. Not imported by ``import torchpatches``; Dynamo, Inductor and diffusers are
imported when used.
"""
from __future__ import annotations

from .models import CONFIGS, build_model, tiny_inputs
from .reports import GraphReport, InductorReport, count_buffers, count_kernels, graph_report, inductor_report

__all__ = ["CONFIGS", "build_model", "tiny_inputs",
           "GraphReport", "graph_report", "InductorReport", "inductor_report", "count_kernels", "count_buffers"]
