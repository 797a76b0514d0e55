"""The tiny models the fused-pattern tests run, from the model registry (not a test module)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Tuple

import torch
from harness import registry

#: The eager fusion patterns (every one some registry family runs) and the families whose ``<name>-fused`` config
#: every model-level fused test runs: both from the model registry (``torchpatches/_harness/registry.py``).
FUSED = registry.FUSED_PATTERNS
MODELS = tuple(name for name, family in registry.FAMILIES.items() if family.fused is not None)
#: Where the tiny models run: the CPU in CI; ``TORCHPATCHES_TEST_DEVICE=cuda`` runs the same cases on a GPU
#: (the Triton tier compiled, not interpreted), as benchmarks/README's GPU checks do.
DEVICE = torch.device(os.environ.get("TORCHPATCHES_TEST_DEVICE", "cpu"))


def tiny(name: str, dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The harness's ``<name>-fused``: ``flux1-fused`` / ``flux2-fused`` (1 double + 2 single blocks), 16 image
    + 8 text tokens; ``qwenimage-fused`` (2 blocks), 16 image + 8 text tokens, the last 2 masked out."""
    from harness import build_model, tiny_inputs

    config = f"{name}-fused"
    model = build_model(config, dtype=dtype, device=DEVICE)
    inputs = tiny_inputs(config, dtype=dtype, device=DEVICE)
    inputs.pop("return_dict")
    return model, inputs


def run(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return output(model(**inputs, return_dict=False))


def outputs(model: torch.nn.Module, inputs: Dict[str, Any]) -> List[torch.Tensor]:
    """Every output of a ``return_dict=False`` forward (LTX-2's and Kandinsky 6's video and audio), no grad."""
    with torch.no_grad():
        return list(model(**inputs, return_dict=False))


def reverted_outputs(model: torch.nn.Module, inputs: Dict[str, Any]) -> List[torch.Tensor]:
    """:func:`outputs` with every fused pattern (and the rope patch) reverted for the call."""
    import torchpatches

    with torchpatches.disabled(*FUSED, "rope"):
        return outputs(model, inputs)


def latents(inputs: Dict[str, Any]) -> Tuple[torch.Tensor, Callable[[torch.Tensor], Dict[str, Any]]]:
    """The latents a forward takes (``hidden_states``; Z-Image's one-sample list ``x``) and how to pass others."""
    if "hidden_states" in inputs:
        return inputs["hidden_states"], lambda t: {**inputs, "hidden_states": t}
    return inputs["x"][0], lambda t: {**inputs, "x": [t]}


def output(out: Any) -> torch.Tensor:
    """A model's ``return_dict=False`` output as one tensor: its first item (Z-Image's: a list of per-sample
    tensors, stacked)."""
    first = out[0]
    return torch.stack(first) if isinstance(first, list) else first


def run_hooked(model: torch.nn.Module, inputs: Dict[str, Any], hooks: Iterable[Any],
               context: ContextManager[Any]) -> torch.Tensor:
    """``run(model, inputs)`` inside ``context`` (a forced tier, ``exact()``), then the hooks removed, whatever
    happened."""
    try:
        with context:
            return run(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()


def reverted(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    """The model's output with every fused pattern (and the rope patch) reverted for the call."""
    import torchpatches

    with torchpatches.disabled(*FUSED, "rope"):
        return run(model, inputs)


@contextlib.contextmanager
def patterns_applied(names: Tuple[str, ...]) -> Iterator[None]:
    """``names`` applied for the block; afterwards the ones that were not applied are reverted again, except those
    that were pending (their module not imported yet: they would have applied on import, and reverting them would
    disable them for the test files that follow)."""
    import torchpatches

    were = {name: torchpatches.status()[name].state.value for name in names}
    torchpatches.apply(list(names))
    try:
        yield
    finally:
        torchpatches.revert([n for n, s in were.items() if s not in ("applied", "pending")])


@contextlib.contextmanager
def exact() -> Iterator[None]:
    """Where a patched run must equal diffusers' bit for bit: the PyTorch tier forced and gelu_gemm off (on CUDA
    its cuBLASLt epilogue rounds once where diffusers rounds twice; on the CPU it never runs)."""
    import torchpatches
    from torchpatches.ops import force_tier

    with force_tier("torch"), torchpatches.disabled("gelu_gemm"):
        yield


def exact_run(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    """The patched run under :func:`exact`."""
    with exact():
        return run(model, inputs)


def same(out: torch.Tensor, ref: torch.Tensor, which: str = "") -> bool:
    """A patched run (PyTorch tier) against diffusers': bit for bit, except QwenImage in fp32 on a GPU.

    diffusers' QwenImage RoPE is a complex64 multiply; CUDA evaluates it with fused multiply-adds, 1 ulp off the
    real-form rotation (``x * cos + rotate(x) * sin``, each product rounded, as the CPU computes both) in 9%
    (tiny) to 17% (production) of the rotated elements (measured on an H100).
    Attention and the GEMMs after it carry those ulps to the output: there ``rtol=1e-5, atol=1e-6``, far below
    what a wrong mask, table or order gives (differences of order 1e-1)."""
    if which == "qwenimage" and out.device.type == "cuda" and out.dtype == torch.float32:
        return out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    return torch.equal(out, ref)


#: peft LoRA targets per model (each model's usual LoRA targets on the tiny config) and the fused op calls a
#: LoRA-loaded forward still makes: the projections are module calls, the fused glue runs around them.
LORA = {name: (list(family.lora[0]), family.lora[1]) for name, family in registry.FAMILIES.items() if family.lora}


def repeatable_inductor() -> ContextManager[None]:
    """Inductor's config for a compile whose bits a test compares with another compile's: the FX graph cache off,
    and no choice by on-device timing where it changes numerics (``deterministic``, torch >= 2.11). On a GPU,
    Inductor times several configs of a reduction at its first run and keeps the fastest, so two compiles of one
    graph may sum in another order: 1-ulp differences between two fresh compiles of the same tiny FLUX on an H200
    (and a CUDA-only QwenImage failure of the same check). On the CPU Inductor
    times nothing, and the mode made the tiny FLUX.1 check 28% slower (32 s against 25 s, torch 2.13.0): off there.
    It follows the tests' device (``DEVICE``, where the tiny models live). The mode also changes some CPU code
    generation that has nothing to do with timing (buffer reuse): harmless for a check that compares two compiles
    made under the same config, but CPU and GPU checks compile in different modes."""
    options: Dict[str, Any] = {"fx_graph_cache": False}
    if DEVICE.type != "cpu" and hasattr(torch._inductor.config, "deterministic"):
        options["deterministic"] = True
    return torch._inductor.config.patch(options)


def regional_compile_run(model: torch.nn.Module, inputs: Dict[str, Any],
                         repeatable: bool = True) -> Tuple[torch.Tensor, List[str]]:
    """One forward of ``model`` with its repeated blocks compiled (diffusers' ``compile_repeated_blocks``, fullgraph;
    Dynamo reset, ``repeatable_inductor``, or only the FX graph cache off where not ``repeatable``: a probe of
    Inductor's own choices) and the code Inductor generated; the blocks are eager again after."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    config = repeatable_inductor() if repeatable else torch._inductor.config.patch(fx_graph_cache=False)
    with config, torch.no_grad():
        model.compile_repeated_blocks(fullgraph=True)
        try:
            return run_and_get_code(lambda: model(**inputs, return_dict=False)[0])
        finally:
            for block in model.transformer_blocks:
                block._compiled_call_impl = None  # back to eager for the next compile
