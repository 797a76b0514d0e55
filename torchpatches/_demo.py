"""``python -m torchpatches demo``: compile a tiny FLUX transformer the way users hit the problems.

It builds a tiny diffusers ``FluxTransformer2DModel`` with random weights (no download), calls it
with the deprecated 3-D ``img_ids``/``txt_ids`` (a ``logger.warning`` in the forward), compiles it
with ``fullgraph=True`` on the available device, and reports graph breaks, whether fullgraph
compiled, and the largest difference from eager, first with every patch reverted and then with
the patches on. Without diffusers it says so and only the status table is shown.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Tuple

import torchpatches

logger = logging.getLogger("torchpatches")


def _tiny_flux_inputs(torch, device: str) -> Tuple[object, Dict[str, object]]:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ).to(device).eval()
    image_tokens, text_tokens = 16, 8
    inputs = dict(
        hidden_states=torch.randn(1, image_tokens, 8, device=device),
        encoder_hidden_states=torch.randn(1, text_tokens, 32, device=device),
        pooled_projections=torch.randn(1, 16, device=device),
        timestep=torch.tensor([0.5], device=device),
        img_ids=torch.randint(0, 4, (1, image_tokens, 3), device=device).float(),  # deprecated 3-D form
        txt_ids=torch.zeros(1, text_tokens, 3, device=device),
        return_dict=False,
    )
    return model, inputs


def _compile_report(torch, model, inputs, reference) -> str:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(**inputs)
    torch._dynamo.reset()
    started = time.perf_counter()
    try:
        with torch.no_grad():
            out = torch.compile(model, fullgraph=True)(**inputs)[0]
    except Exception as error:  # the point of the demo: show what fails without the patches
        verdict = f"fullgraph=True FAILED ({type(error).__name__})"
    else:
        diff = (out - reference).abs().max().item()
        verdict = f"fullgraph=True compiled in {time.perf_counter() - started:.1f}s, max |compiled - eager| = {diff:.2e}"
    return f"{explanation.graph_count} graph(s), {explanation.graph_break_count} graph break(s); {verdict}"


def run() -> None:
    """Print the before/after comparison (a CLI command, so printing is its job)."""
    try:
        import diffusers  # noqa: F401
        import torch
    except ImportError as error:
        print(f"demo needs diffusers ({error}); pip install 'torchpatches[diffusers]'")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logging.getLogger("diffusers").setLevel(logging.ERROR)  # the deprecation warning is the subject, not news
    model, inputs = _tiny_flux_inputs(torch, device)
    with torch.no_grad():
        reference = model(**inputs)[0]
    print(f"tiny FluxTransformer2DModel on {device}, torch {torch.__version__}, diffusers {diffusers.__version__}")
    with torchpatches.disabled():
        print(f"  without torchpatches: {_compile_report(torch, model, inputs, reference)}")
    print(f"  with torchpatches:    {_compile_report(torch, model, inputs, reference)}")
    print()
