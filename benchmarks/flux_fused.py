"""Whole-model FLUX.1 / FLUX.2 step time with torchpatches' eager fusion patches, in one process.

Models (random bf16 weights built on the GPU, batch 1, 1024x1024 = 4096 image tokens + 512 text tokens):

  flux1   FLUX.1-dev-sized FluxTransformer2DModel: 19 double + 38 single blocks, 24 heads x 128 (11.9 B)
  flux2   Flux2Transformer2DModel with FLUX.2-dev's dims (48 heads x 128 = 6144 wide, MLP ratio 3, text
          dim 15360, RoPE axes 4 x 32) and a quarter of its blocks: 2 double + 12 single (dev: 8 + 48),
          the same 1:6 ratio; 7.9 B parameters instead of 32 B, so it fits and compiles within the budget

Variants (each model; ``torch._dynamo.reset()`` before each):

  eager/vanilla         every torchpatches patch reverted (``torchpatches.disabled()``)
  eager/all             every patch applied (what ``import torchpatches`` gives)
  eager/-NAME           every patch but NAME (one fused pattern off: its share of the win)
  compile/vanilla       ``torch.compile(model, fullgraph=True)`` of stock diffusers
  compile/all           the same with every patch applied (``--compile-variants`` chooses)
  a trailing ``+``      the variant measured again later in the run (run-to-run spread)

Step time: median of CUDA-event-timed steps after warm-up. ``--profile``: GPU kernel time per step by
class (GEMM / attention / everything else) and kernel launches per step from torch.profiler. Numerical
difference of every variant's output against eager vanilla (and compile/vanilla) as ||a - b|| / ||b||.
Inductor caches are off (TORCHINDUCTOR_FX_GRAPH_CACHE=0, TORCHINDUCTOR_AUTOGRAD_CACHE=0), so every compile is
a real one. Results: a table at the end and ``--json PATH`` (rewritten after every variant).

    python benchmarks/flux_fused.py --models flux1 --json out.json --profile          # GPU
    python benchmarks/flux_fused.py --tiny                                             # CPU smoke test

``dit.py`` measures every DiT (these two included) with regional and full compile, per-row profiles and
alternated rounds; this script stays for ``gpu_session.sh``'s FLUX.1 before/after re-check (its JSON layout).
The model configs, inputs and timing helpers live in ``_dit_models.py`` and ``_bench.py`` (re-exported here).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench, _dit_models beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402

from _bench import kernel_class, profile, rel_err, state, time_steps, versions  # noqa: E402,F401  (re-exported)
from _dit_models import SPECS, flux_inputs as inputs  # noqa: E402,F401  (re-exported)

FUSED = ("adaln", "qk_norm_rope", "gate_residual", "gelu_gemm", "swiglu")

CONFIGS: Dict[str, Dict[str, Any]] = {name: SPECS[name].config for name in ("flux1", "flux2")}
TINY: Dict[str, Dict[str, Any]] = {
    "flux1": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                  axes_dims_rope=(4, 6, 6)),
    "flux2": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=16, mlp_ratio=3.0,
                  axes_dims_rope=(4, 4, 4, 4)),
}
# Patterns that have no call site in a model are left out of its "-NAME" variants.
APPLIES = {"flux1": ("adaln", "qk_norm_rope", "gate_residual", "gelu_gemm"),
           "flux2": ("adaln", "qk_norm_rope", "gate_residual", "swiglu")}


def build(name: str, config: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    return _bench.build(SPECS[name].cls_name, config, device, dtype)


def run_model(name: str, args: argparse.Namespace, results: Dict[str, Any], save: Callable[[], None]) -> None:
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = (TINY if args.tiny else CONFIGS)[name]
    side, text = (64, 8) if args.tiny else (1024, 512)
    t0 = time.perf_counter()
    model = build(name, config, device, dtype)
    feed = inputs(name, config, side, text, device, dtype)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    entry: Dict[str, Any] = {"config": dict(config, image_side=side, text_tokens=text, dtype=str(dtype)),
                             "params_b": params, "build_s": time.perf_counter() - t0, "steps": {}}
    results["models"][name] = entry
    print(f"[{name}] built in {entry['build_s']:.1f} s, {params:.2f} B params", flush=True)
    refs: Dict[str, torch.Tensor] = {}
    eager = ["vanilla", "all"] + [f"-{p}" for p in APPLIES[name] if p in args.patterns] + ["vanilla+", "all+"]
    plan = [("eager", v) for v in eager if "eager" in args.modes]
    plan += [("compile", v) for v in args.compile_variants if "compile" in args.modes]
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    iters = args.iters if args.iters is not None else (2 if args.tiny else 20)
    profiles: Dict[str, Any] = {}
    outputs: Dict[str, torch.Tensor] = {}
    for mode, variant in plan:
        torch._dynamo.reset()
        with state(variant), torch.inference_mode():
            fn = torch.compile(model, fullgraph=True) if mode == "compile" else model
            step = lambda: fn(**feed)  # noqa: E731
            t1 = time.perf_counter()
            out = step()[0]
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t1
            times, host = time_steps(step, device, warmup, iters)
            if args.profile and device.type == "cuda" and mode == "compile":
                profiles[f"{mode}/{variant}"] = profile(step)  # compiled code exists only now
        record(name, entry, refs, mode, variant, times, host, first_s, out)
        outputs[f"{mode}/{variant}"] = out.float().clone()
        save()
    if "compile" in refs:  # every output against compiled diffusers, eager variants measured before it too
        for key, out in outputs.items():
            entry["steps"][key]["rel_err_vs_compile_vanilla"] = rel_err(out, refs["compile"])
    if args.profile and device.type == "cuda" and "eager" in args.modes:
        # Eager profiles after every timing, so the profiler cannot disturb the timed steps.
        for variant in ("vanilla", "all"):
            with state(variant), torch.inference_mode():
                profiles[f"eager/{variant}"] = profile(lambda: model(**feed))
    for key, prof in profiles.items():
        entry["steps"][key]["profile"] = prof
        c = prof["ms_by_class"]
        print(f"[{name}] profile {key}: GPU {prof['gpu_kernel_ms']:.1f} ms: gemm {c['gemm']:.1f}, attention "
              f"{c['attention']:.1f}, other {c['other']:.1f}; {prof['launches_per_step']:.0f} launches", flush=True)
    save()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def record(name: str, entry: Dict[str, Any], refs: Dict[str, torch.Tensor], mode: str, variant: str,
           times: List[float], host: List[float], first_s: float, out: torch.Tensor) -> None:
    row: Dict[str, Any] = dict(_bench.summary(times), host_ms=_bench.summary(host)["median_ms"], times_ms=times,
                               first_call_s=first_s, finite=bool(torch.isfinite(out).all()))
    key = f"{mode}/{variant}"
    if key == "eager/vanilla":
        refs["eager"] = out.float().clone()
    if key == "compile/vanilla":
        refs["compile"] = out.float().clone()
    row["rel_err_vs_eager_vanilla"] = rel_err(out.float(), refs["eager"]) if "eager" in refs else None
    if "compile" in refs:
        row["rel_err_vs_compile_vanilla"] = rel_err(out.float(), refs["compile"])
    entry["steps"][key] = row
    print(f"[{name}] {key}: {row['median_ms']:.2f} ms (host {row['host_ms']:.1f} ms, first call {first_s:.1f} s)",
          flush=True)


def ratios(entry: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    steps = entry["steps"]
    out: Dict[str, Dict[str, float]] = {}
    for key, row in steps.items():
        r = {}
        for base in ("eager/vanilla", "compile/vanilla"):
            if base in steps:
                r["vs_" + base.replace("/", "_")] = row["median_ms"] / steps[base]["median_ms"]
        out[key] = r
    return out


def print_table(results: Dict[str, Any]) -> None:
    for name, entry in results["models"].items():
        entry["ratios"] = ratios(entry)
        print(f"\n{name}: {entry['params_b']:.2f} B params")
        print(f"{'variant':<22} {'median ms':>10} {'p10':>8} {'p90':>8} {'/eager van':>10} {'/compile van':>12} "
              f"{'err/eager':>9} {'err/comp':>9} {'host ms':>8} {'first s':>8}")
        for key, row in entry["steps"].items():
            r = entry["ratios"][key]
            print(f"{key:<22} {row['median_ms']:>10.2f} {row['p10_ms']:>8.2f} {row['p90_ms']:>8.2f} "
                  f"{r.get('vs_eager_vanilla', float('nan')):>9.3f}x {r.get('vs_compile_vanilla', float('nan')):>11.3f}x "
                  f"{row['rel_err_vs_eager_vanilla'] or 0.0:>9.2e} {row.get('rel_err_vs_compile_vanilla', float('nan')):>9.2e} "
                  f"{row['host_ms']:>8.1f} {row['first_call_s']:>8.1f}")
        for key, row in entry["steps"].items():
            if "profile" in row:
                c = row["profile"]["ms_by_class"]
                print(f"  profile {key:<18} GPU {row['profile']['gpu_kernel_ms']:7.2f} ms = gemm {c['gemm']:6.2f} + "
                      f"attention {c['attention']:6.2f} + other {c['other']:6.2f}; "
                      f"{row['profile']['launches_per_step']:.0f} launches/step")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (smoke test, PyTorch tiers)")
    parser.add_argument("--models", default="flux1,flux2")
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--patterns", default=",".join(FUSED), help="fused patterns to switch off one at a time")
    parser.add_argument("--compile-variants", default="vanilla,all")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--after-compile", action="store_true",
                        help="compile a 3-op function first: the eager steps then run in a process where "
                             "torch.compile has run (issue 17 measured a slower host path there)")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.patterns = [p for p in args.patterns.split(",") if p]
    args.compile_variants = [v for v in args.compile_variants.split(",") if v]

    import torchpatches

    results: Dict[str, Any] = {"versions": versions(), "models": {}, "command": _bench.command_line(argv)}

    def save() -> None:
        _bench.save_json(args.json, results)

    forced = contextlib.nullcontext()
    if args.tiny:  # CPU: let the patches run their fused path through the PyTorch tier
        from torchpatches.ops import force_tier

        forced = force_tier("torch")
    if args.after_compile:
        _bench.compile_once(torch.device("cpu" if args.tiny else "cuda"))
        results["after_compile"] = True
    with forced:
        for name in [m for m in args.models.split(",") if m]:
            run_model(name, args, results, save)
    print_table(results)
    save()
    print(json.dumps(results["versions"]))
    print(torchpatches.status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
