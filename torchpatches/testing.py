"""Helpers for trying torchpatches on your own code: what Dynamo and Inductor made of a call, and a tiny
diffusers model to try them (and ``torchpatches.doctor``) on without a download.

- :func:`graph_report`: graphs, graph breaks (each with its file and line) and whether ``fullgraph=True``
  compiles;
- :func:`inductor_report`: a fresh Inductor compile's generated code and its kernels, loop nests, loads,
  buffers and bytes; :func:`count_kernels` counts kernels in generated code;
- :func:`build_model` / :func:`tiny_inputs`: tiny diffusers transformers with random weights
  (``"flux1"``, ``"flux2"``, ``"sd3"``, ``"qwenimage"``, ``"wan"``, ...) and the arguments of one forward.

The project's test fixtures (graph-break cases, realize programs, references) are private
(``torchpatches._harness``). Not imported by ``import torchpatches``.
"""
from __future__ import annotations

from ._harness.models import build_model, tiny_inputs
from ._harness.reports import GraphReport, InductorReport, count_kernels, graph_report, inductor_report

__all__ = ["GraphReport", "graph_report", "InductorReport", "inductor_report", "count_kernels", "build_model",
           "tiny_inputs"]
