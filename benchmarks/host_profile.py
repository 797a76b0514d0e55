"""Where the host time of one eager step goes (issue 17: enqueueing a fused FLUX.1-dev step takes 77 ms, goal 40).

For each model and variant (``vanilla``: every patch reverted; ``all``: every patch applied), in one process:
host ms per step without a profiler (wall time of enqueueing one step on an empty queue, median of
``--steps``) and the thread's CPU ms for the same (``time.thread_time``: steadier on a shared host), then
``cProfile`` over ``--steps`` steps: self time per step grouped by where the function lives (torchpatches,
diffusers, torch.nn modules, other torch Python, triton, C calls such as ``linear`` or a kernel launch, the
rest), calls per step, and the top functions by self time. cProfile adds a cost per Python
call, so its total exceeds the unprofiled host time; the split between groups is what it is for.

    python benchmarks/host_profile.py --models flux2 --json host.json                 # GPU
    python benchmarks/host_profile.py --models flux1 --layers flux1=19+38 --top 30
    python benchmarks/host_profile.py --tiny --models flux1                           # CPU smoke test
    python benchmarks/host_profile.py --stub-kernels --models flux1 --layers flux1=19+38  # CPU: the fused path
    python benchmarks/host_profile.py --models flux1 --lora scale --variants all,-lora_scale  # with peft adapters

``--stub-kernels`` (CPU, no GPU): the tiny configs in bf16 with the Triton tier forced and every kernel launch
replaced by a no-op, so the fused path runs the same Python as on a GPU (minus ``ops._runtime.launch``'s cached launch
and triton's launcher); its function calls per step are a host-independent measure of that Python.

``--graphed``: the step through ``torchpatches.cuda_graphs.graphed`` (one wrapper; each variant captures its graph
in the first, untimed call). ``--lora CASE`` (FLUX.1; needs peft): the model with ``flux_lora.py``'s adapters in
that case's state (``one``, ``two``, ``scale``, ``hotswap``; rank 64, on the CPU 4), the case's extra forward
arguments included.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench, _dit_models, dit beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import functools  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402

import dit  # noqa: E402

GROUPS = (("torchpatches", "/torchpatches/"), ("diffusers", "/diffusers/"), ("torch.nn modules", "/torch/nn/modules/"),
          ("torch other", "/torch/"), ("triton", "/triton/"))


def group_of(filename: str) -> str:
    if filename == "~":  # a C function: cProfile names it "<built-in method ...>" / "<method ... of ... objects>"
        return "C calls"
    # Match inside the environment only: a venv under /opt/torch/ would put every package in "torch other".
    inside = "/" + filename.replace(os.sep, "/").rsplit("site-packages/", 1)[-1]
    for label, part in GROUPS:
        if part in inside:
            return label
    return "other Python"


def profile_steps(step: Any, device: torch.device, steps: int, top: int) -> Dict[str, Any]:
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    cpu: List[float] = []  # this thread's CPU ms of the same steps: steadier than wall time on a shared host
    _, host = _bench.time_steps(step, device, 2, steps, host_cpu=cpu)
    profiler = cProfile.Profile()
    for _ in range(steps):
        profiler.enable()
        step()
        profiler.disable()
        if device.type == "cuda":
            torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    groups: Dict[str, float] = {}
    rows = []
    calls = 0
    for (filename, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        label = group_of(filename)
        groups[label] = groups.get(label, 0.0) + tottime * 1e3 / steps
        calls += ncalls
        rows.append((tottime * 1e3 / steps, ncalls / steps, cumtime * 1e3 / steps,
                     f"{label}: {os.path.basename(filename)}:{line} {name}"[:110]))
    rows.sort(reverse=True)
    return {"host_ms": statistics.median(host), "host_cpu_ms": statistics.median(cpu),
            "profiled_ms": sum(groups.values()),
            "python_calls_per_step": calls / steps, "self_ms_by_group": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top": rows[:top]}


def with_adapters(model: torch.nn.Module, case: str, rank: int) -> Dict[str, Any]:
    """``model`` with flux_lora.py's adapters in ``case``'s state (the earlier cases' setups run first, as there);
    the case's extra forward arguments."""
    import flux_lora

    for name, setup, extra in flux_lora.cases(model, rank):
        setup()
        if name == case:
            model.eval()  # adapters are added in training mode
            return extra
    raise ValueError(f"no LoRA case {case!r}")


def report(name: str, variant: str, result: Dict[str, Any]) -> None:
    print(f"\n[{name}] {variant}: host {result['host_ms']:.1f} ms per step unprofiled "
          f"(thread CPU {result['host_cpu_ms']:.1f} ms); under cProfile "
          f"{result['profiled_ms']:.1f} ms, {result['python_calls_per_step']:.0f} function calls per step")
    for label, ms in result["self_ms_by_group"].items():
        print(f"  {label:<18}{ms:9.2f} ms")
    print(f"  {'self ms':>9}{'calls':>8}{'cum ms':>9}  function")
    for tottime, ncalls, cumtime, where in result["top"]:
        print(f"  {tottime:9.3f}{ncalls:8.0f}{cumtime:9.2f}  {where}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="flux2")
    parser.add_argument("--layers", default="", help="as dit.py: flux1=19+38")
    parser.add_argument("--variants", default="vanilla,all")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tiny", action="store_true", help="the harness's tiny configs on the CPU (PyTorch tiers)")
    parser.add_argument("--stub-kernels", action="store_true",
                        help="CPU: tiny configs in bf16, Triton tier forced, kernel launches stubbed")
    parser.add_argument("--lora", choices=("one", "two", "scale", "hotswap"),
                        help="FLUX.1 with flux_lora.py's peft adapters in this case's state")
    parser.add_argument("--graphed", action="store_true",
                        help="the step through torchpatches.cuda_graphs.graphed (after its capture)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.tiny = args.tiny or args.stub_kernels
    opts = dit.parse(["--models", args.models] + (["--layers", args.layers] if args.layers else [])
                     + (["--tiny"] if args.tiny else []))
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny and not args.stub_kernels else torch.bfloat16
    results: Dict[str, Any] = {"versions": _bench.versions(), "command": _bench.command_line(argv), "models": {}}
    from torchpatches.ops import force_tier

    tier = "triton" if args.stub_kernels else "torch" if args.tiny else None
    with force_tier(tier), _bench.stubbed_launches() if args.stub_kernels else contextlib.nullcontext():
        for name in opts.models:
            model, feed, _, config = dit.load(name, opts, device, dtype)
            if args.lora:
                feed = dict(feed, **with_adapters(model, args.lora, 4 if args.tiny else 64))
            call = model
            if args.graphed:
                from torchpatches.cuda_graphs import graphed

                call = graphed(model)
            step = functools.partial(call, **feed)
            entry = results["models"][name] = {"layers": list(dit.layers_of(dit.SPECS[name], config))}
            for variant in args.variants.split(","):
                with _bench.state(variant), torch.inference_mode():
                    entry[variant] = profile_steps(step, device, args.steps, args.top)
                report(name, variant, entry[variant])
                _bench.save_json(args.json, results)
            del model, feed, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
