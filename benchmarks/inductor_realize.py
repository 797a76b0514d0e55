"""What the ``inductor_realize`` patch changes in Inductor's output: kernels, loop nests, buffers, bytes.

Each program is compiled twice from scratch (``torch._dynamo.reset()``, FX-graph and AOTAutograd
caches off), once with the patch reverted and once applied, and the generated code is measured:

  kernels     kernel definitions in the generated module (``cpp_fused_*`` on CPU, ``triton_*`` on GPU).
              On CPU Inductor puts all loops of a graph into very few C++ functions, so this rarely moves;
  nests       fused scheduler nodes, i.e. loop nests on CPU / kernel launches on GPU
              (``len(torch._inductor.metrics.nodes_num_elem)``);
  loads       load sites in the kernel source (vector ``loadu(``, scalar ``= in_ptrN[``, ``tl.load(``):
              a static proxy for recomputation: an inlined value re-loads its inputs in every
              consumer, a realized one is loaded from its buffer;
  buffers     intermediate buffers the wrapper allocates (``empty_strided_*`` calls): realizing a
              reused value costs one buffer, inlining it costs none;
  bytes       ``torch._inductor.metrics.num_bytes_accessed``: Inductor's own estimate of bytes read and
              written by all scheduler nodes (``GraphLowering.count_bytes``). Inductor fills it only while
              the ``inductor_metrics`` logging artifact is enabled; we enable that logger quietly
              (level INFO, no handler) for the compile instead of ``torch._logging.set_logs``.

    python benchmarks/inductor_realize.py                 # CPU, every program, a table
    python benchmarks/inductor_realize.py --json out.json --programs flux_tiny residual_chain
    python benchmarks/inductor_realize.py --device cuda --time   # GPU: also median step times

The programs are also the equivalence-test programs (tests/patches/test_inductor_realize.py loads
this file), so the test and the table cannot drift apart.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

PATCH_NAME = "inductor_realize"
# Inductor writes its metrics through this artifact logger (torch/_inductor/compile_fx.py).
_METRICS_LOGGER = "torch._inductor.compile_fx.__inductor_metrics"

Args = Tuple[Any, ...]


# ---- programs ------------------------------------------------------------------------------


def _rms(h: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def residual_chain(x: torch.Tensor, ys: List[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """A residual stream: every ``x + y`` has 2 reads and 3 users (pow, mul, next add).

    The original (2 reads <= 4) inlines each sum into all of its users, so the chain is
    recomputed again and again; the byte rule (2 reads * 2 >= 1 output * 4) realizes it.
    """
    outs = []
    for y in ys:
        x = x + y
        outs.append(_rms(x))
    return (x, *outs)


def norm_qkv(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """An RMSNorm output read by three matmuls: the matmuls need it realized whatever the rule says."""
    n = _rms(x) * w
    return n @ wq, n @ wk, n @ wv


def flip_to_realize(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``a + b`` (2 full reads) used by 3 reductions: the original inlines it, the patch realizes it."""
    h = a + b
    return h.sum(0), h.sum(1), h.amax(0)


def flip_to_inline(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """5 reads, but 4 are broadcast rows: the original realizes (5 > 4), the patch inlines it (bytes ~ output)."""
    h = x + p + q + r + s
    return h.sum(-1), h.amax(0)


def cpu_heavy_op(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``exp`` reused twice: both rules realize it on CPU (the heavy-op rule the patch keeps)."""
    h = (a + b).exp()
    return h.sum(0), h.sum(1)


FLUX_TINY_CONFIG: Dict[str, Any] = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 4, 8),
)


@dataclasses.dataclass
class Program:
    name: str
    build: Callable[[torch.device], Tuple[Callable[..., Any], Args]]
    note: str


def _randn(*shape: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device)


def _simple(fn: Callable[..., Any], *shapes: Any) -> Callable[[torch.device], Tuple[Callable[..., Any], Args]]:
    def build(device: torch.device) -> Tuple[Callable[..., Any], Args]:
        generator = torch.Generator().manual_seed(0)

        def make(shape: Any) -> Any:
            if isinstance(shape, list):
                return [make(s) for s in shape]
            return _randn(*shape, device=device, generator=generator)

        return fn, tuple(make(shape) for shape in shapes)

    return build


def _build_flux_tiny(device: torch.device) -> Tuple[Callable[..., Any], Args]:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**FLUX_TINY_CONFIG).eval().to(device)
    generator = torch.Generator().manual_seed(0)
    hidden = _randn(1, 16, 4, device=device, generator=generator)
    text = _randn(1, 8, 32, device=device, generator=generator)
    pooled = _randn(1, 32, device=device, generator=generator)
    timestep = torch.tensor([0.5], device=device)
    img_ids = _randn(16, 3, device=device, generator=generator)
    txt_ids = _randn(8, 3, device=device, generator=generator)

    def flux_tiny(hidden: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor, timestep: torch.Tensor,
                  img_ids: torch.Tensor, txt_ids: torch.Tensor) -> torch.Tensor:
        return model(hidden_states=hidden, encoder_hidden_states=text, pooled_projections=pooled,
                     timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]

    return flux_tiny, (hidden, text, pooled, timestep, img_ids, txt_ids)


PROGRAMS: Dict[str, Program] = {
    program.name: program
    for program in (
        Program("residual_chain", _simple(residual_chain, (64, 256), [(64, 256)] * 4), "x+y, 3 users, 4 layers"),
        Program("norm_qkv", _simple(norm_qkv, (32, 128), (128,), (128, 128), (128, 128), (128, 128)), "norm -> 3 matmuls"),
        Program("flip_to_realize", _simple(flip_to_realize, (128, 128), (128, 128)), "orig inlines, patch realizes"),
        Program("flip_to_inline", _simple(flip_to_inline, (128, 128), (128,), (128,), (128,), (128,)), "orig realizes, patch inlines"),
        Program("cpu_heavy_op", _simple(cpu_heavy_op, (128, 128), (128, 128)), "exp reused: both realize"),
        Program("flux_tiny", _build_flux_tiny, "FluxTransformer2DModel, 1+1 blocks"),
    )
}


# ---- measuring -----------------------------------------------------------------------------


@dataclasses.dataclass
class Measurement:
    kernels: int
    nests: int
    loads: int
    buffers: int
    bytes: int
    output: Any = dataclasses.field(repr=False, default=None)
    code: str = dataclasses.field(repr=False, default="")
    seconds: float = 0.0

    def counts(self) -> Dict[str, int]:
        return {"kernels": self.kernels, "nests": self.nests, "loads": self.loads, "buffers": self.buffers, "bytes": self.bytes}


_KERNEL_DEFINITION = re.compile(r"^(?:cpp_fused_\w*|triton_\w+) = async_compile\.", re.MULTILINE)
_LOAD_SITE = re.compile(r"::loadu\(|=\s*(?:in_ptr|in_out_ptr|out_ptr)\d+\[|\btl\.load\(")
_BUFFER_ALLOCATION = re.compile(r"\bempty_strided_\w+\(")


def count_kernels(code: str) -> int:
    return len(_KERNEL_DEFINITION.findall(code))


def count_loads(code: str) -> int:
    return len(_LOAD_SITE.findall(code))


def count_buffers(code: str) -> int:
    return len(_BUFFER_ALLOCATION.findall(code))


@contextlib.contextmanager
def inductor_metrics_enabled() -> Iterator[None]:
    """Make Inductor compute ``metrics.num_bytes_accessed`` without printing its INFO log.

    ``compile_fx`` counts bytes only when its ``inductor_metrics`` artifact logger is enabled
    for INFO; ``torch._logging.set_logs(inductor_metrics=True)`` would also print the records
    and reset the user's other log settings, so we raise just that logger's level.
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


def compile_and_measure(fn: Callable[..., Any], args: Args) -> Measurement:
    """A fresh, uncached compile of ``fn`` (fullgraph) and the counts of what Inductor emitted."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    metrics.reset()
    started = time.perf_counter()
    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False), inductor_metrics_enabled(), torch.no_grad():
        output, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    code = "\n".join(codes)
    return Measurement(
        kernels=count_kernels(code),
        nests=len(metrics.nodes_num_elem),
        loads=count_loads(code),
        buffers=count_buffers(code),
        bytes=int(metrics.num_bytes_accessed),
        output=output,
        code=code,
        seconds=time.perf_counter() - started,
    )


@contextlib.contextmanager
def patch_state(applied: bool) -> Iterator[None]:
    """Run with ``inductor_realize`` applied or reverted, then put it back as it was."""
    import torchpatches

    # "Wanted" (applied, pending or skipped) vs turned off: restore that, not the exact state.
    was_wanted = torchpatches.status()[PATCH_NAME].state.value != "disabled"
    (torchpatches.apply if applied else torchpatches.revert)(PATCH_NAME)
    try:
        yield
    finally:
        if was_wanted != applied:
            (torchpatches.apply if was_wanted else torchpatches.revert)(PATCH_NAME)


def measure_both(program: Program, device: torch.device) -> Tuple[Measurement, Measurement, Any]:
    """(original, patched, eager output) for one program."""
    fn, args = program.build(device)
    with torch.no_grad():
        eager = fn(*args)
    with patch_state(applied=False):
        original = compile_and_measure(fn, args)
    with patch_state(applied=True):
        patched = compile_and_measure(fn, args)
    return original, patched, eager


def _median_step_ms(fn: Callable[..., Any], args: Args, device: torch.device, steps: int = 50) -> float:
    compiled = torch.compile(fn, fullgraph=True)
    times = []
    with torch.no_grad():
        for step in range(steps + 5):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            compiled(*args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 5:
                times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--programs", nargs="*", default=list(PROGRAMS), choices=list(PROGRAMS))
    parser.add_argument("--time", action="store_true", help="also time compiled steps (meaningful on a GPU)")
    parser.add_argument("--json", help="write the results to this file")
    options = parser.parse_args(argv)

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="torchpatches-realize-"))
    import torchpatches

    others = [name for name in torchpatches.patch_names() if name != PATCH_NAME]
    device = torch.device(options.device)
    results: Dict[str, Any] = {"torch": torch.__version__, "device": str(device), "programs": {}}
    header = f"{'program':<16} {'':>9} {'kernels':>7} {'nests':>5} {'loads':>5} {'buffers':>7} {'bytes':>9}"
    if options.time:
        header += f" {'step ms':>8}"
    print(header)
    # Measure this patch alone (disabled() with no names would turn every patch off).
    with torchpatches.disabled(*others) if others else contextlib.nullcontext():
        for name in options.programs:
            program = PROGRAMS[name]
            original, patched, _ = measure_both(program, device)
            row: Dict[str, Any] = {"original": original.counts(), "patched": patched.counts(), "note": program.note}
            if options.time:
                fn, args = program.build(device)
                for label, applied in (("original", False), ("patched", True)):
                    with patch_state(applied):
                        torch._dynamo.reset()
                        row[label]["step_ms"] = _median_step_ms(fn, args, device)
            results["programs"][name] = row
            for label in ("original", "patched"):
                counts = row[label]
                line = (f"{name if label == 'original' else '':<16} {label:>9} {counts['kernels']:>7} {counts['nests']:>5} {counts['loads']:>5} "
                        f"{counts['buffers']:>7} {counts['bytes']:>9}")
                if options.time:
                    line += f" {counts['step_ms']:>8.3f}"
                print(line)
            sys.stdout.flush()
    state = torchpatches.status()[PATCH_NAME]
    results["patch_state"] = f"{state.state.value}: {state.reason}"
    print(f"# torch {torch.__version__} on {device}; {PATCH_NAME} after the runs: {results['patch_state']}")
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
