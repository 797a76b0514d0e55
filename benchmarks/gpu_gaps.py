"""Where the GPU waits inside one eager step, and what the host was doing then (issue 17, goal 2).

FLUX.1-dev eager + torchpatches on an H200 spends 118 ms in kernels per 127 ms step: 5-9 ms per step the GPU has
nothing to run. This profiles ``--steps`` synchronized steps per variant with torch.profiler (CPU and CUDA) and walks
the GPU's kernels (and copies / memsets) in time order. For each gap between two kernels it finds the API call that
launched the second one (by correlation id):

- *host-bound*: the launch call ended after the previous kernel had finished, so the GPU waited for the host (the
  gap is charged to the CPU op that enclosed that launch, e.g. ``aten::linear``, and to the kernel it launched);
- *queued*: the kernel was already queued when the previous one ended; the gap is the device's own switch time.

Two profiled passes per variant: CUDA activity alone (the gaps by kind, without the CPU profiler's cost on the
host), then CPU and CUDA (which CPU op each host-bound gap falls in; the host is slower there, so its gaps are
larger). Gaps longer than 20 ms are the synchronizations between the profiled steps and are left out. Printed per
variant and step: the step ms unprofiled, kernel ms, the gaps by kind, the time before the
first kernel, host-bound gaps by the enclosing CPU op, and the longest host-bound gaps with the kernels on both
sides.

    python benchmarks/gpu_gaps.py --variants vanilla,all --json gaps.json      # GPU
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench, dit beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import bisect  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402

import dit  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def trace_events(step: Any, steps: int, cpu: bool) -> List[Dict[str, Any]]:
    """The chrome-trace events of ``steps`` synchronized steps: CUDA kernels and launch calls, and with ``cpu`` the
    CPU ops too (which slows the host: the timing pass runs without them)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cpu else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            return json.load(handle)["traceEvents"]


def _innermost_op(ops: List[Dict[str, Any]], starts: List[float], ts: float) -> str:
    """The shortest CPU op that encloses ``ts`` (ops sorted by start)."""
    best, best_dur = "(no op)", float("inf")
    i = bisect.bisect_right(starts, ts) - 1
    scanned = 0
    while i >= 0 and scanned < 400:  # enclosing ops start before ts; nested ones are close by
        op = ops[i]
        if op["ts"] <= ts <= op["ts"] + op["dur"] and op["dur"] < best_dur:
            best, best_dur = op["name"], op["dur"]
        i -= 1
        scanned += 1
    return best


def gaps(events: List[Dict[str, Any]], steps: int, top: int) -> Dict[str, Any]:
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    starts = [op["ts"] for op in ops]
    kernel_us = sum(e["dur"] for e in gpu)
    host_bound, queued = 0.0, 0.0
    by_op: Dict[str, float] = collections.defaultdict(float)
    by_op_n: Dict[str, int] = collections.defaultdict(int)
    by_next: Dict[str, float] = collections.defaultdict(float)
    longest = []
    for a, b in zip(gpu, gpu[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap <= 0:
            continue
        if gap > 20_000:  # the synchronization between two profiled steps
            continue
        launch = launches.get(b.get("args", {}).get("correlation"))
        launched_late = launch is not None and launch["ts"] + launch["dur"] > a["ts"] + a["dur"]
        if launched_late:
            host_bound += gap
            op = _innermost_op(ops, starts, launch["ts"])
            by_op[op] += gap
            by_op_n[op] += 1
            by_next[b["name"][:50]] += gap
            longest.append((gap, a["name"][:60], b["name"][:60], op))
        else:
            queued += gap
    longest.sort(reverse=True)
    first_cpu = min(op["ts"] for op in ops) if ops else min(e["ts"] for e in launches.values())
    return {
        "kernels_per_step": len(gpu) / steps,
        "kernel_ms": kernel_us / steps / 1e3,
        "host_bound_gap_ms": host_bound / steps / 1e3,
        "queued_gap_ms": queued / steps / 1e3,
        "first_kernel_after_ms": (gpu[0]["ts"] - first_cpu) / 1e3,
        "host_bound_by_op_ms": {k: (v / steps / 1e3, by_op_n[k] / steps)
                                for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]},
        "host_bound_by_next_kernel_ms": {k: v / steps / 1e3
                                         for k, v in sorted(by_next.items(), key=lambda kv: -kv[1])[:top]},
        "longest_host_bound_us": [(round(g, 1), pa, pb, op) for g, pa, pb, op in longest[:top]],
    }


def report(name: str, variant: str, r: Dict[str, Any], step_ms: float) -> None:
    print(f"\n[{name}] {variant}: step {step_ms:.2f} ms unprofiled, kernels {r['kernel_ms']:.2f} ms "
          f"({r['kernels_per_step']:.0f}), gaps host-bound {r['host_bound_gap_ms']:.2f} ms + queued "
          f"{r['queued_gap_ms']:.2f} ms; first kernel {r['first_kernel_after_ms']:.2f} ms after the first CPU op")
    print("  host-bound gap ms per step by the CPU op around the launch (gaps per step):")
    for op, (ms, n) in r["host_bound_by_op_ms"].items():
        print(f"    {ms:8.3f}  ({n:5.1f})  {op}")
    print("  host-bound gap ms per step by the kernel launched late:")
    for kernel, ms in r["host_bound_by_next_kernel_ms"].items():
        print(f"    {ms:8.3f}  {kernel}")
    print("  longest host-bound gaps (us): previous kernel -> next kernel [op]")
    for g, pa, pb, op in r["longest_host_bound_us"]:
        print(f"    {g:8.1f}  {pa} -> {pb} [{op}]")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="flux1")
    parser.add_argument("--layers", default="")
    parser.add_argument("--variants", default="vanilla,all")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    opts = dit.parse(["--models", args.models] + (["--layers", args.layers] if args.layers else []))
    device = torch.device("cuda")
    results: Dict[str, Any] = {"versions": _bench.versions(), "command": _bench.command_line(argv), "models": {}}
    import torchpatches  # noqa: F401

    for name in opts.models:
        model, feed, _, _ = dit.load(name, opts, device, torch.bfloat16)
        step = functools.partial(model, **feed)
        entry = results["models"][name] = {}
        for variant in args.variants.split(","):
            with _bench.state(variant), torch.inference_mode():
                times, _ = _bench.time_steps(step, device, 2, 5)
                timing = gaps(trace_events(step, args.steps, cpu=False), args.steps, args.top)
                where = gaps(trace_events(step, args.steps, cpu=True), args.steps, args.top)
            step_ms = sorted(times)[len(times) // 2]
            entry[variant] = {"step_ms": step_ms, "cuda_only": timing, "with_cpu_ops": where}
            report(name, f"{variant}, CUDA activity only", timing, step_ms)
            report(name, f"{variant}, with CPU ops (attribution)", where, step_ms)
            _bench.save_json(args.json, results)
        del model, feed, step
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
