"""FLUX.1-dev eager step with peft LoRA adapters loaded and unfused: vanilla vs ``import torchpatches``.

Model and inputs as ``dit.py``'s ``flux1`` (``_dit_models.py``: FLUX.1-dev dims, random bf16 weights, 1024x1024,
batch 1).
Rank-64 adapters (random A and B, ``lora_alpha`` = rank) on to_q/k/v, to_out.0, add_q/k/v_proj, to_add_out,
ff(_context).net.0.proj / .net.2, proj_mlp, proj_out, norm1(_context).linear, norm.linear, loaded through
diffusers' ``load_lora_adapter``. Cases, in this order on one model:

  one       one adapter
  two       a second adapter, ``set_adapters(["first", "second"], [0.7, 0.5])``
  scale     one adapter, ``joint_attention_kwargs={"scale": 0.8}``
  hotswap   ``prepare_model_for_compiled_hotswap`` (what ``enable_lora_hotswap`` runs after the first load:
            ranks padded, scalings in 0-d tensors) + ``load_lora_adapter(..., hotswap=True)``

Each case: eager vanilla (every patch reverted) and eager with every patch, alternated A B A B (and once
every patch but ``lora``), median of CUDA-event-timed steps; output difference against vanilla. ``--graphed``
adds both states through ``torchpatches.cuda_graphs.graphed`` (one wrapper for the run: a case's adapter changes
drop its graphs; the first call of each state and case captures) to the alternation.

    python benchmarks/flux_lora.py --json lora.json          # GPU
    python benchmarks/flux_lora.py --layers                   # one layer per FLUX.1-dev shape: op vs peft's order
    python benchmarks/flux_lora.py --tiny                     # CPU smoke test (PyTorch tiers forced)
    python benchmarks/flux_lora.py --without lora_scale       # also every patch but lora_scale, alternated
    python benchmarks/flux_lora.py --graphed                  # also through cuda_graphs.graphed (opt-in), both states
    python benchmarks/flux_lora.py --graphed --unwatched      # and graphed(watch_model=False): the check's share
    python benchmarks/flux_lora.py --cases one,two --back-to-back 10  # two cases; also steps not synchronized
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402,I001  (before torch's Inductor: turns its caches off)
from _bench import rel_err, state, time_back_to_back, time_steps, versions  # noqa: E402
from _dit_models import SPECS, flux_inputs, tiny_config  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out",
           "norm1.linear", "norm1_context.linear", "norm.linear"]


def adapter_state_dict(model: torch.nn.Module, rank: int, seed: int) -> Dict[str, torch.Tensor]:
    """Random rank-``rank`` LoRA weights for ``model``'s TARGETS, as a diffusers LoRA file holds them."""
    import peft
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    model.add_adapter(peft.LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False, target_modules=TARGETS),
                      adapter_name="donor")
    weights = {f"transformer.{k}": v.clone() for k, v in get_peft_model_state_dict(model, adapter_name="donor").items()}
    model.delete_adapters("donor")
    return weights


def cases(model: torch.nn.Module, rank: int) -> List[tuple]:
    """(name, setup, extra forward kwargs); each setup leaves the model in its case's state."""
    first, second = adapter_state_dict(model, rank, 1), adapter_state_dict(model, rank, 2)

    def one() -> None:
        model.load_lora_adapter(first, adapter_name="first")

    def two() -> None:
        model.load_lora_adapter(second, adapter_name="second")
        model.set_adapters(["first", "second"], [0.7, 0.5])

    def scale() -> None:
        model.delete_adapters("second")
        model.set_adapters("first")

    def hotswap() -> None:
        from peft.utils.hotswap import prepare_model_for_compiled_hotswap

        prepare_model_for_compiled_hotswap(model, target_rank=rank, check_compiled="ignore")
        model.load_lora_adapter(second, adapter_name="first", hotswap=True)

    return [("one", one, {}), ("two", two, {}), ("scale", scale, {"joint_attention_kwargs": {"scale": 0.8}}),
            ("hotswap", hotswap, {})]


#: (name, tokens, in, out, GELU) of FLUX.1-dev's LoRA-wrapped projections (image stream; text: 512 tokens).
LAYERS = [("to_q/k/v, to_out.0", 4096, 3072, 3072, False), ("ff.net.0.proj (+GELU)", 4096, 3072, 12288, True),
          ("ff.net.2", 4096, 12288, 3072, False), ("proj_out", 4608, 15360, 3072, False),
          ("norm1.linear", 1, 3072, 18432, False)]


def layers(args: argparse.Namespace) -> Dict[str, Any]:
    """Each shape once: ``ops.lora_linear`` epilogue tier vs its torch tier (peft's and diffusers' op order)."""
    from torchpatches.ops import lora_linear

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype, scale = (torch.float32, 16) if args.tiny else (torch.bfloat16, 1)
    rows: Dict[str, Any] = {}
    for name, m, k, n, gelu in LAYERS:
        m, k, n = max(1, m // scale), k // scale, n // scale
        r = lambda *shape: (torch.randn(*shape, device=device) / shape[-1] ** 0.5).to(dtype)  # noqa: E731
        x, weight, bias, adapters = r(m, k) * k ** 0.5, r(n, k), r(n), [(r(args.rank, k), r(n, args.rank), 0.7)]
        row = {}
        with torch.inference_mode():
            for tier in ("torch", "epilogue", "torch+", "epilogue+"):
                step = lambda: lora_linear(x, weight, bias, adapters, gelu=gelu, tier=tier.rstrip("+"))  # noqa: E731
                row[tier] = measure(step, device, args)["median_ms"] * 1e3
        rows[name] = row
        print(f"[layer] {name:<24} {m}x{k}->{n}: peft order {row['torch']:.1f}/{row['torch+']:.1f} us, "
              f"epilogue {row['epilogue']:.1f}/{row['epilogue+']:.1f} us", flush=True)
    return rows


def measure(step: Callable[[], Any], device: torch.device, args: argparse.Namespace) -> Dict[str, Any]:
    times, host = time_steps(step, device, args.warmup, args.iters)
    row = {"median_ms": statistics.median(times), "host_ms": statistics.median(host), "times_ms": times}
    if args.back_to_back and device.type == "cuda":
        row["back_to_back_ms"] = statistics.median(time_back_to_back(step, args.back_to_back, 3))
    return row


def best_ms(row: Dict[str, Any], variant: str) -> float:
    """The faster median of a variant's two alternations (A B A B: ``variant`` and ``variant+``)."""
    return min(row[variant]["median_ms"], row[variant + "+"]["median_ms"])


def run(args: argparse.Namespace) -> Dict[str, Any]:
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = tiny_config("flux1") if args.tiny else dict(SPECS["flux1"].config)
    side, text = (64, 8) if args.tiny else (1024, 512)
    model = _bench.build(SPECS["flux1"].cls_name, config, device, dtype)
    feed = flux_inputs("flux1", config, side, text, device, dtype)
    results: Dict[str, Any] = {"versions": versions(), "rank": args.rank, "cases": {}}
    graph = unwatched = None
    if args.graphed:  # one wrapper: each case's adapters drop its graphs, each patch state finds its own
        from torchpatches.cuda_graphs import graphed

        graph = graphed(model)
        # the same without the model check before each replay (reset by hand after each case's changes)
        unwatched = graphed(model, watch_model=False) if args.unwatched else None
    for name, setup, extra in cases(model, args.rank):
        setup()
        model.eval()  # adapters are added in training mode (their dropout is nn.Identity here anyway)
        if args.cases and name not in args.cases:
            continue  # each case's setup builds on the one before, so it runs all the same
        if unwatched is not None:
            unwatched.reset()
        row: Dict[str, Any] = {}
        outputs: Dict[str, torch.Tensor] = {}
        first = ("vanilla", "all") + tuple(f"-{n}" for n in args.without)
        first += ("graph:vanilla", "graph:all") if graph is not None else ()
        first += ("unwatched:all",) if unwatched is not None else ()
        for variant in first + tuple(v + "+" for v in first) + ("-lora",):  # A B (C) A B (C)
            call = {"graph": graph, "unwatched": unwatched}.get(variant.split(":")[0], model)
            with state(variant.split(":", 1)[-1]), torch.inference_mode():
                step = lambda: call(**feed, **extra)  # noqa: E731
                outputs[variant] = step()[0].float()
                row[variant] = measure(step, device, args)
        van, fused = best_ms(row, "vanilla"), best_ms(row, "all")
        row["ratio"] = fused / van
        row["ratio_without_lora"] = row["-lora"]["median_ms"] / van
        row["rel_err_vs_vanilla"] = rel_err(outputs["all"], outputs["vanilla"])
        results["cases"][name] = row
        if args.back_to_back:
            print(f"[{name}] back to back (ms per step of {args.back_to_back}, median of 3): " + ", ".join(
                f"{variant} {row[variant]['back_to_back_ms']:.2f}" for variant in first if "back_to_back_ms" in
                row[variant]), flush=True)
        print(f"[{name}] vanilla {row['vanilla']['median_ms']:.2f}/{row['vanilla+']['median_ms']:.2f} ms, "
              f"torchpatches {row['all']['median_ms']:.2f}/{row['all+']['median_ms']:.2f} ms ({row['ratio']:.3f}x; "
              f"host {row['all']['host_ms']:.1f} ms), all but lora {row['-lora']['median_ms']:.2f} ms "
              f"({row['ratio_without_lora']:.3f}x), rel err {row['rel_err_vs_vanilla']:.2e}", flush=True)
        if graph is not None:
            for kind in ("vanilla", "all"):
                row[f"ratio_graph_{kind}"] = best_ms(row, f"graph:{kind}") / van
                row[f"rel_err_graph_{kind}"] = rel_err(outputs[f"graph:{kind}"], outputs[kind])
            print(f"[{name}] graphed: vanilla {row['ratio_graph_vanilla']:.3f}x, every patch {row['ratio_graph_all']:.3f}x "
                  f"(host {row['graph:all']['host_ms']:.1f} ms; against eager of the same state: rel err "
                  f"{row['rel_err_graph_vanilla']:.1e} / {row['rel_err_graph_all']:.1e})", flush=True)
        if unwatched is not None:
            row["ratio_unwatched_all"] = best_ms(row, "unwatched:all") / van
            row["rel_err_unwatched_all"] = rel_err(outputs["unwatched:all"], outputs["all"])
            print(f"[{name}] graphed without the model check: every patch {row['ratio_unwatched_all']:.3f}x (host "
                  f"{row['unwatched:all']['host_ms']:.1f} ms; rel err against eager {row['rel_err_unwatched_all']:.1e})",
                  flush=True)
        for patch in args.without:
            without = best_ms(row, f"-{patch}")
            row[f"ratio_without_{patch}"] = without / van
            a, b = row[f"-{patch}"], row[f"-{patch}+"]
            print(f"[{name}] every patch but {patch} {a['median_ms']:.2f}/{b['median_ms']:.2f} ms "
                  f"({without / van:.3f}x; host {a['host_ms']:.1f} / {b['host_ms']:.1f} ms, all {row['all']['host_ms']:.1f} / "
                  f"{row['all+']['host_ms']:.1f} ms)", flush=True)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny FLUX.1 on the CPU (smoke test, PyTorch tiers)")
    parser.add_argument("--rank", type=int, default=None, help="adapter rank (64; --tiny: 4)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--layers", action="store_true", help="only the per-layer table (no model)")
    parser.add_argument("--without", action="append", default=[], metavar="PATCH",
                        help="also every patch but PATCH, in the A B alternation (repeatable): --without lora_scale")
    parser.add_argument("--graphed", action="store_true",
                        help="also the step through torchpatches.cuda_graphs.graphed, vanilla and every patch")
    parser.add_argument("--unwatched", action="store_true",
                        help="with --graphed: also every patch through graphed(watch_model=False), the model check's share")
    parser.add_argument("--cases", type=lambda text: text.split(","), default=None,
                        help="comma-separated cases to measure (one,two,scale,hotswap; default all)")
    parser.add_argument("--back-to-back", type=int, default=0, metavar="N",
                        help="also each variant's ms per step over N steps without a synchronization between them")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.rank = args.rank or (4 if args.tiny else 64)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.iters = args.iters if args.iters is not None else (2 if args.tiny else 20)

    import torchpatches

    forced = contextlib.nullcontext()
    if args.tiny:  # CPU: let the patches run their fused path (PyTorch tiers; lora's addmm epilogue)
        from torchpatches.ops import force_tier

        forced = force_tier("torch")
    t0 = time.perf_counter()
    with forced:
        results = {"versions": versions(), "layers": layers(args)} if args.layers else run(args)
    results["wall_s"] = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    print(json.dumps(results["versions"]))
    print(torchpatches.status()["lora"])
    print(torchpatches.status()["lora_scale"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
