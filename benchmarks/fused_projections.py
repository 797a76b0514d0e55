"""What merging FLUX.1's projections that read the same input into one GEMM is worth (issue 17, goals 1 and 2).

A FLUX.1-dev step makes 504 linear calls. 190 of them read an input that another projection of the same block
reads too: q, k and v (and the text stream's q, k, v) in the 19 double blocks, and q, k, v and the MLP input
projection in the 38 single blocks. Each such call costs the host a cuBLAS launch (the largest share of an eager
step's host time), and the GPU a GEMM that is narrower than it could be (N = 3072 is 12 tiles of 256 for M =
4096 rows: wave quantization on 132 SMs).

Part 1, GEMMs alone, at FLUX.1-dev shapes (bf16, bias, random data): the projections of one block as separate
``F.linear`` calls against one ``F.linear`` over their concatenated weights. GPU ms per block (CUDA events over
``--reps`` repetitions, after warm-up; the two forms alternated) and host µs per block (the GPU kept busy by
``torch.cuda._sleep`` so that a call only enqueues).

Part 2, the whole model: FLUX.1-dev (``--layers``, default all 19 + 38 blocks), 1024x1024, eager, every patch off
(``vanilla``) and on (``all``), each with diffusers' own ``transformer.fuse_qkv_projections()`` (q/k/v and the text
q/k/v merged into ``to_qkv`` / ``to_added_qkv``: +2 weight copies of those projections' memory; ``unfuse`` after
the row) and without; rows alternated in rounds, CUDA-event step ms, host ms (enqueueing a step on an empty queue),
then torch.profiler's GPU ms by kernel class and launches per step, and ||out - ref|| / ||ref|| against vanilla.

    python benchmarks/fused_projections.py --json out.json        # GPU
    python benchmarks/fused_projections.py --no-model             # part 1 only
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench, dit beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
from typing import Any, Dict, Iterator, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dit  # noqa: E402
from launch_queue import batch_us, sleep_cycles  # noqa: E402

#: (name, rows M, input width K, output widths N of the projections that read one input) per FLUX.1-dev block.
GROUPS = (
    ("double: image q/k/v", 4096, 3072, (3072, 3072, 3072)),
    ("double: text q/k/v", 512, 3072, (3072, 3072, 3072)),
    ("single: q/k/v + MLP in", 4608, 3072, (3072, 3072, 3072, 12288)),
)


def gemm_part(reps: int, rounds: int) -> List[Dict[str, Any]]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    busy = sleep_cycles(device, 30.0)
    rows = []
    for name, m, k, widths in GROUPS:
        x = torch.randn(1, m, k, device=device, dtype=dtype)
        weights = [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for n in widths]
        biases = [torch.randn(n, device=device, dtype=dtype) for n in widths]
        merged_w, merged_b = torch.cat(weights), torch.cat(biases)

        def separate() -> None:
            for w, b in zip(weights, biases):
                F.linear(x, w, b)

        def merged() -> None:
            F.linear(x, merged_w, merged_b)

        same = torch.equal(torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1),
                           F.linear(x, merged_w, merged_b))
        for fn in (separate, merged):
            for _ in range(3):
                fn()
        sep_ms, mer_ms, sep_us, mer_us = [], [], [], []
        for _ in range(rounds):
            sep_ms.append(_bench.time_back_to_back(separate, reps, 1)[0])
            mer_ms.append(_bench.time_back_to_back(merged, reps, 1)[0])
            sep_us.append(batch_us(separate, 60, busy))
            mer_us.append(batch_us(merged, 60, busy))
        flops = 2 * m * k * sum(widths)
        row = dict(group=name, m=m, k=k, widths=list(widths), bit_identical=same,
                   separate_ms=statistics.median(sep_ms), merged_ms=statistics.median(mer_ms),
                   separate_host_us=statistics.median(sep_us), merged_host_us=statistics.median(mer_us))
        row["separate_tflops"] = flops / row["separate_ms"] / 1e9
        row["merged_tflops"] = flops / row["merged_ms"] / 1e9
        rows.append(row)
        print(f"  {name:<26} GPU {row['separate_ms']:.3f} -> {row['merged_ms']:.3f} ms "
              f"({row['separate_tflops']:.0f} -> {row['merged_tflops']:.0f} TFLOP/s), host "
              f"{row['separate_host_us']:.1f} -> {row['merged_host_us']:.1f} us, bit-identical {same}", flush=True)
        del x, weights, biases, merged_w, merged_b
    return rows


@contextlib.contextmanager
def projections(model: torch.nn.Module, fuse: bool) -> Iterator[None]:
    if not fuse:
        yield
        return
    model.fuse_qkv_projections()
    try:
        yield
    finally:
        model.unfuse_qkv_projections()
        torch.cuda.empty_cache()


def model_part(args: argparse.Namespace, results: Dict[str, Any]) -> None:
    device = torch.device("cuda")
    opts = dit.parse(["--models", "flux1", "--layers", f"flux1={args.layers}"])
    model, feed, _, _ = dit.load("flux1", opts, device, torch.bfloat16)
    step = functools.partial(model, **feed)
    variants: List[Tuple[str, str, bool]] = [("vanilla", "vanilla", False), ("all", "all", False),
                                             ("vanilla+qkv", "vanilla", True), ("all+qkv", "all", True)]
    times: Dict[str, List[float]] = {v[0]: [] for v in variants}
    hosts: Dict[str, List[float]] = {v[0]: [] for v in variants}
    ref: Optional[torch.Tensor] = None
    errors: Dict[str, float] = {}
    with torch.inference_mode():
        for key, state, fuse in variants:  # first calls: outputs against vanilla
            with _bench.state(state), projections(model, fuse):
                out = step()[0]
                ref = out.float() if ref is None else ref
                errors[key] = _bench.rel_err(out.float(), ref)
        for r in range(args.rounds):
            for key, state, fuse in variants:
                with _bench.state(state), projections(model, fuse):
                    t, h = _bench.time_steps(step, device, 2, args.steps)
                times[key] += t
                hosts[key] += h
            print(f"  round {r + 1}: " + ", ".join(f"{k} {statistics.median(times[k][-args.steps:]):.2f}"
                                                  for k in times), flush=True)
        rows = {}
        for key, state, fuse in variants:
            with _bench.state(state), projections(model, fuse):
                prof = _bench.profile(step)
            rows[key] = dict(step_ms=statistics.median(times[key]), host_ms=statistics.median(hosts[key]),
                             round_ms=[statistics.median(times[key][i:i + args.steps])
                                       for i in range(0, len(times[key]), args.steps)],
                             rel_err=errors[key], gpu_kernel_ms=prof["gpu_kernel_ms"],
                             ms_by_class=prof["ms_by_class"], launches=prof["launches_per_step"])
    results["model"] = dict(layers=args.layers, rounds=args.rounds, steps=args.steps, rows=rows)
    base = rows["vanilla"]["step_ms"]
    print(f"\nFLUX.1-dev ({args.layers} blocks), 1024x1024, eager; {args.rounds} rounds x {args.steps} steps")
    print(f"{'row':<14}{'step ms':>9}{'/vanilla':>9}{'host ms':>9}{'GPU ms':>8}{'GEMM':>7}{'attn':>7}{'other':>7}"
          f"{'launch':>7}{'rel err':>10}  rounds")
    for key, row in rows.items():
        c = row["ms_by_class"]
        print(f"{key:<14}{row['step_ms']:9.2f}{row['step_ms'] / base:8.3f}x{row['host_ms']:9.1f}"
              f"{row['gpu_kernel_ms']:8.1f}{c['gemm']:7.1f}{c['attention']:7.1f}{c['other']:7.1f}"
              f"{row['launches']:7.0f}{row['rel_err']:10.2e}  " + " ".join(f"{x:.1f}" for x in row["round_ms"]))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--gemm-rounds", type=int, default=5)
    parser.add_argument("--layers", default="19+38")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-model", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results: Dict[str, Any] = {"versions": _bench.versions(), "command": _bench.command_line(argv)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("Part 1: one block's projections, separate vs merged (GPU ms per block, host us per block)")
    results["gemms"] = gemm_part(args.reps, args.gemm_rounds)
    _bench.save_json(args.json, results)
    if not args.no_model:
        import torchpatches  # noqa: F401  (applies every patch; the rows switch them)

        model_part(args, results)
        _bench.save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
