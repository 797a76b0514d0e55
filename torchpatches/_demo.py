"""``python -m torchpatches demo``: compile a tiny FLUX transformer the way users hit the problems.

It builds the tiny diffusers ``FluxTransformer2DModel`` of ``torchpatches._harness`` (random weights,
no download), calls it with the deprecated 3-D ``img_ids``/``txt_ids`` (a ``logger.warning`` in the
forward), compiles it with ``fullgraph=True`` on the available device, and reports graph breaks, whether
fullgraph compiled, and the largest difference from eager, first with every patch reverted and then
with the patches on. Without diffusers it says so and only the status table is shown.
"""
from __future__ import annotations

import logging
from typing import Any, Dict


def _compile_report(model: Any, inputs: Dict[str, Any], reference: Any) -> str:
    import torch

    from . import _harness as harness

    with torch.no_grad():
        report = harness.graph_report(model, backend="inductor", **inputs)
    if report.fullgraph:
        diff = (report.output[0] - reference).abs().max().item()
        verdict = f"fullgraph=True compiled in {report.seconds:.1f}s, max |compiled - eager| = {diff:.2e}"
    else:  # the point of the demo: show what fails without the patches
        verdict = f"fullgraph=True FAILED ({report.error.split(':')[0]})"
    return f"{report.graphs} graph(s), {report.breaks} graph break(s); {verdict}"


def run(api: Any) -> None:
    """Print the before/after comparison (a CLI command, so printing is its job); ``api`` is the package."""
    try:
        import diffusers
        import torch
    except ImportError as error:
        print(f"demo needs diffusers ({error}); pip install 'torchpatches[diffusers]'")
        return
    from . import _harness as harness

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logging.getLogger("diffusers").setLevel(logging.ERROR)  # the deprecation warning is the subject, not news
    model = harness.build_model("flux1", device=device)
    inputs = harness.tiny_inputs("flux1", device=device, ids_3d=True)  # the deprecated 3-D form
    with torch.no_grad():
        reference = model(**inputs)[0]
    print(f"tiny FluxTransformer2DModel on {device}, torch {torch.__version__}, diffusers {diffusers.__version__}")
    with api.disabled():
        print(f"  without torchpatches: {_compile_report(model, inputs, reference)}")
    print(f"  with torchpatches:    {_compile_report(model, inputs, reference)}")
    print()
