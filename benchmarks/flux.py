"""Whole-model FLUX benchmark: step time with and without torchpatches' ``rope`` patch.

A FLUX.1-dev-sized ``FluxTransformer2DModel`` (19 double + 38 single blocks, 24 heads x 128,
random bf16 weights built directly on the GPU), one 1024x1024 image (4096 image tokens) and
512 text tokens, batch 1. Variants, all in one process:

  eager / vanilla        diffusers as shipped (``torchpatches.revert("rope")``)
  eager / torchpatches   ``torchpatches.apply("rope")``
  compile / vanilla      ``torch.compile`` of diffusers as shipped
  compile / torchpatches ``torch.compile`` with the patch applied (what users get)
  compile / op           ``torch.compile`` with the RoPE op forced into the graph even while compiling
                         (the alternative the patch decides against or for; see NOTES-flux.md)

plus a RoPE micro-benchmark at the FLUX shape (diffusers eager, the op called once per tensor,
the op called once for q and k) that says whether patching the attention processor to rotate q and k
in one launch would be worth it.

Step times are medians of CUDA-event timings after a warm-up. Results go to stdout as a table and,
with ``--json PATH``, to a JSON file rewritten after every variant (partial results survive a timeout).

    python benchmarks/flux.py --json out.json          # GPU, FLUX.1-dev size
    python benchmarks/flux.py --tiny                   # CPU smoke test with a tiny model
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # the tests' harness
import harness  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench beside this file
import _bench  # noqa: E402

def time_steps(step: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> List[float]:
    """Per-step milliseconds: CUDA events on a GPU, perf_counter after a synchronize elsewhere."""
    return _bench.time_steps(step, device, warmup, iters)[0]


@contextlib.contextmanager
def patch_state(variant: str) -> Iterator[None]:
    """Put torchpatches into the state a variant names; every patch as before after it.

    vanilla       every torchpatches patch reverted: stock torch + diffusers
    torchpatches  every eligible patch applied (what ``import torchpatches`` gives)
    rope          only the rope patch applied
    op            stock, plus a replacement that keeps the RoPE op even under torch.compile
    """
    import torchpatches
    from torchpatches.patches import rope as rope_patch

    if variant == "torchpatches":
        torchpatches.apply()
        yield
    elif variant == "vanilla":
        with torchpatches.only():
            yield
    elif variant == "rope":
        with torchpatches.only("rope"):
            yield
    elif variant == "op":
        with torchpatches.only(), harness.replacing(rope_patch.PATCH, harness.rope_op_under_compile):
            yield
    else:
        raise ValueError(f"unknown variant {variant!r}")


def output_of(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result.sample


def bench_rope_micro(device: torch.device, tokens: int, config: Dict[str, Any], iters: int) -> Dict[str, float]:
    """RoPE alone at the FLUX shape: diffusers eager vs the patch's replacement (q and k one call each),
    vs one op call for q and k together (what patching the attention processor would buy)."""
    from diffusers.models import embeddings
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    import torchpatches
    from torchpatches.ops._rope import apply_rope_qk
    from torchpatches.patches import rope as rope_patch

    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    torch.manual_seed(2)
    q = torch.randn(1, tokens, heads, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    ids = torch.randint(0, 64, (tokens, 3), device=device).float()
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=list(config["axes_dims_rope"]))(ids)
    with torchpatches.disabled("rope"):
        original = embeddings.apply_rotary_emb
    replacement = rope_patch.build_replacement(original)
    calls: Dict[str, Callable[[], Any]] = {
        "diffusers_eager_qk_us": lambda: (
            original(q, (cos, sin), sequence_dim=1),
            original(k, (cos, sin), sequence_dim=1),
        ),
        "patch_two_calls_qk_us": lambda: (
            replacement(q, (cos, sin), sequence_dim=1),
            replacement(k, (cos, sin), sequence_dim=1),
        ),
    }
    calls["op_one_call_qk_us"] = lambda: apply_rope_qk(q, k, cos, sin, interleaved=True, sequence_dim=1)
    compiled = torch.compile(lambda: (original(q, (cos, sin), sequence_dim=1), original(k, (cos, sin), sequence_dim=1)))
    calls["diffusers_inductor_qk_us"] = compiled
    out: Dict[str, float] = {}
    for name, call in calls.items():
        out[name] = statistics.median(time_steps(call, device, warmup=5, iters=iters)) * 1e3
        if device.type == "cuda" and name != "diffusers_inductor_qk_us":
            # Replayed from a CUDA graph: GPU time alone, without Python / launch overhead.
            try:
                out[name.replace("_us", "_graph_us")] = graph_time_us(call, iters)
            except Exception as error:  # noqa: BLE001 - a capture problem must not cost the run
                print(f"graph timing of {name} failed: {type(error).__name__}: {error}", flush=True)
    copy_src = torch.empty(2 * q.numel() * 2 + 2 * cos.numel() * 4, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    out["copy_same_bytes_us"] = statistics.median(time_steps(lambda: copy_dst.copy_(copy_src), device, 5, iters)) * 1e3
    # The fewest bytes: read q, k, cos, sin once and write q', k' once; the copy above moves
    # (q + k + cos + sin) read + written, i.e. slightly more than that floor.
    torch._dynamo.reset()
    return out


def profile_gpu(step: Callable[[], Any], steps: int = 2) -> Dict[str, Any]:
    """Per step: GPU kernel time in total, in RoPE-like kernels, and the top kernels (torch.profiler)."""
    kernels = _bench.kernel_times(step, steps)
    return {
        "gpu_kernel_ms_per_step": sum(row[1] for row in kernels),
        "rope_kernel_ms_per_step": sum(row[1] for row in kernels if "rope" in row[0].lower()),
        "top_kernels_ms_per_step": kernels[:25],
    }


def graph_time_us(call: Callable[[], Any], iters: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return statistics.median(time_steps(graph.replay, torch.device("cuda"), warmup=5, iters=iters)) * 1e3


def print_table(results: Dict[str, Any]) -> None:
    steps = results["steps"]
    print()
    print(
        f"{'mode':<8} {'variant':<13} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
        f"{'ratio':>7} {'compile s':>9} {'rel err':>9}"
    )
    for key, row in steps.items():
        mode, variant = key.split("/")
        base = steps.get(f"{mode}/vanilla")
        ratio = row["median_ms"] / base["median_ms"] if base else float("nan")
        print(
            f"{mode:<8} {variant:<13} {row['median_ms']:>10.2f} {row['p10_ms']:>8.2f} {row['p90_ms']:>8.2f} "
            f"{ratio:>6.3f}x {row.get('compile_s', 0.0):>9.1f} {row.get('rel_err_vs_eager_vanilla', 0.0):>9.2e}"
        )
    for name, value in results.get("rope_micro", {}).items():
        print(f"rope micro  {name:<28} {value:>9.1f} us")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke test)")
    parser.add_argument("--json", help="write results here (rewritten after each variant)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--modes", default="eager,compile", help="comma list of eager, compile")
    parser.add_argument("--compile-variants", default="vanilla,op,torchpatches,rope")
    parser.add_argument("--eager-variants", default="vanilla,torchpatches")
    parser.add_argument("--regional", action="store_true", help="compile the repeated blocks only")
    parser.add_argument("--no-micro", action="store_true", help="skip the RoPE micro-benchmark")
    parser.add_argument("--profile", action="store_true", help="torch.profiler GPU kernel times of eager steps")
    args = parser.parse_args(argv)

    import torchpatches  # applies every eligible patch; rope waits for diffusers

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config_name = "flux1" if args.tiny else "flux1-dev"
    config = harness.CONFIGS[config_name][1]
    image_side, text_tokens = (128, 8) if args.tiny else (1024, 512)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    iters = args.iters if args.iters is not None else (3 if args.tiny else 20)

    results: Dict[str, Any] = {
        "config": dict(config, name=config_name, image_side=image_side, text_tokens=text_tokens, batch=1,
                       dtype=str(dtype)),
        "versions": _bench.versions(),
        "warmup": warmup,
        "iters": iters,
        "regional_compile": args.regional,
        "steps": {},
    }

    def save() -> None:
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=2)

    t0 = time.perf_counter()
    model = harness.build_model(config_name, dtype=dtype, device=device)
    # As FluxPipeline passes them: VAE /8, then 2x2 packing -> a (side / 16)^2 token grid.
    inputs = harness.tiny_inputs(config_name, dtype=dtype, device=device, side=image_side // 16,
                                 text_tokens=text_tokens)
    results["build_s"] = time.perf_counter() - t0
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"built model in {results['build_s']:.1f} s; {params_b:.2f} B params", flush=True)
    from torchpatches.ops import _rope as rope_op

    results["rope_tiers"] = {name: list(v) for name, v in rope_op.describe_tiers(device.type).items()}
    reference: Optional[torch.Tensor] = None

    def run_variant(mode: str, variant: str) -> None:
        nonlocal reference
        torch._dynamo.reset()
        with patch_state(variant), torch.inference_mode():
            if mode == "compile":
                if args.regional:
                    model.compile_repeated_blocks(fullgraph=True)
                    step_model = model
                else:
                    step_model = torch.compile(model, fullgraph=True)
            else:
                step_model = model
            step = lambda: step_model(**inputs)  # noqa: E731
            t1 = time.perf_counter()
            out = output_of(step())
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t1
            times = time_steps(step, device, warmup, iters)
            profiled = None
            if args.profile and device.type == "cuda" and mode == "eager":
                try:
                    profiled = profile_gpu(step)
                except Exception as error:  # noqa: BLE001 - profiling is a bonus, not the run
                    print(f"profiling {mode}/{variant} failed: {type(error).__name__}: {error}", flush=True)
            if mode == "compile" and args.regional:
                for submodule in model.modules():  # undo nn.Module.compile() for the next variant
                    submodule._compiled_call_impl = None
        row: Dict[str, Any] = {
            "median_ms": statistics.median(times),
            "p10_ms": sorted(times)[len(times) // 10],
            "p90_ms": sorted(times)[(len(times) * 9) // 10 - (1 if len(times) >= 10 else 0)],
            "times_ms": times,
            "first_call_s": first_s,
            "finite": bool(torch.isfinite(out).all()),
        }
        if mode == "compile":
            row["compile_s"] = first_s
        if profiled is not None:
            row["profile"] = profiled
            print(
                f"  profile: GPU kernels {profiled['gpu_kernel_ms_per_step']:.2f} ms/step, "
                f"RoPE kernels {profiled['rope_kernel_ms_per_step']:.2f} ms/step",
                flush=True,
            )
        if reference is None:
            reference = out.float().clone()
        row["rel_err_vs_eager_vanilla"] = harness.rel_err(out.float(), reference)
        if mode == "eager" and variant != "vanilla":
            row["rope_tier_used"] = rope_op.last_tier()
        key = f"{mode}/{variant}"
        while key in results["steps"]:  # a variant listed twice: the repeat measures run-to-run spread
            key += "+"
        results["steps"][key] = row
        print(f"{key}: {row['median_ms']:.2f} ms (first call {first_s:.1f} s)", flush=True)
        save()

    modes = [m for m in args.modes.split(",") if m]
    # eager/vanilla first: it is the numerical reference for every other variant.
    if "eager" in modes:
        for variant in [v for v in args.eager_variants.split(",") if v]:
            run_variant("eager", variant)
    if not args.no_micro:
        results["rope_micro"] = bench_rope_micro(
            device,
            tokens=(image_side // 16) ** 2 + text_tokens,
            config=config,
            iters=iters * 5,
        )
        save()
    if "compile" in modes:
        for variant in [v for v in args.compile_variants.split(",") if v]:
            run_variant("compile", variant)
    results["ratios"] = {
        key: row["median_ms"] / results["steps"][key.split("/")[0] + "/vanilla"]["median_ms"]
        for key, row in results["steps"].items()
        if key.split("/")[0] + "/vanilla" in results["steps"]
    }
    results["total_s"] = time.perf_counter() - t0
    save()
    print_table(results)
    print(json.dumps(results["versions"]))
    print(f"torchpatches status:\n{torchpatches.status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
