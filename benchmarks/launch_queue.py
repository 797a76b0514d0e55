"""Host cost of a launch onto an idle GPU against one onto a busy GPU (the launch queue already holds work).

Why: enqueueing a fused FLUX.1 step took 82-172 ms on different device hosts while diffusers' own step stayed
at 112-117 ms, and under cProfile the same C calls (``linear``, ``silu``, ``torch.empty``) cost 1.3-2x more in the
fused step, whose host falls behind its GPU, than in diffusers' step, whose GPU is behind. If a launch costs
more when the GPU has nothing queued (the driver must wake it), a host-bound step pays that on every launch.

For each call (tiny tensors, so each kernel takes a few microseconds on the GPU): a batch of ``--batch``
calls timed on the host (a) right after a synchronize, the GPU idle between launches, and (b) behind
``torch.cuda._sleep`` (a kernel that spins for ~50 ms), the GPU busy for the whole batch. Batches alternate
idle / busy, ``--repeats`` times; medians of microseconds per call. ``torch.empty`` launches nothing (a control).

    python benchmarks/launch_queue.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F


def calls(device: torch.device) -> Dict[str, Callable[[], Any]]:
    from torchpatches.ops import _modulate as modulate

    x = torch.randn(1, 16, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, 64, device=device, dtype=torch.bfloat16)
    return {
        "torch.empty (no launch)": lambda: torch.empty(16, 64, device=device, dtype=torch.bfloat16),
        "torch.add": lambda: x + 1,
        "F.silu": lambda: F.silu(x),
        "F.linear (cuBLAS)": lambda: F.linear(x, w),
        "ops.layer_norm_modulate (Triton)": lambda: modulate.layer_norm_modulate(x, v, v),
    }


def sleep_cycles(device: torch.device, ms: float) -> int:
    """GPU cycles ``torch.cuda._sleep`` spins for about ``ms`` milliseconds (measured once)."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def batch_us(fn: Callable[[], Any], batch: int, busy_cycles: int) -> float:
    torch.cuda.synchronize()
    if busy_cycles:
        torch.cuda._sleep(busy_cycles)
    t0 = time.perf_counter()
    for _ in range(batch):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / batch * 1e6


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=200, help="calls per batch (stays below the launch queue's depth)")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    device = torch.device("cuda")
    cycles = sleep_cycles(device, 50.0)
    rows: List[Dict[str, Any]] = []
    for name, fn in calls(device).items():
        for _ in range(3):
            fn()
        idle, busy = [], []
        for _ in range(args.repeats):
            idle.append(batch_us(fn, args.batch, 0))
            busy.append(batch_us(fn, args.batch, cycles))
        row = dict(call=name, idle_us=statistics.median(idle), busy_us=statistics.median(busy))
        row["idle_over_busy"] = row["idle_us"] / row["busy_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, median of "
          f"{args.repeats} batches of {args.batch}")
    print(f"{'call':<44}{'GPU idle':>10}{'GPU busy':>10}{'idle/busy':>11}")
    for r in rows:
        print(f"{r['call']:<44}{r['idle_us']:>10.2f}{r['busy_us']:>10.2f}{r['idle_over_busy']:>10.2f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=args.batch,
                           repeats=args.repeats, rows=rows), handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
