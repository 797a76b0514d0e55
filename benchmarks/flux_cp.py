"""Diffusion transformers under diffusers' context parallelism, a process per GPU: vanilla vs ``import torchpatches``.

Per model (FLUX.1-dev dims, and FLUX.2's 2 + 12 blocks with ``--models flux1,flux2``, 1024x1024; ``wan``: Wan2.1-T2V-14B
widths, 4 of 40 blocks, 480x832x81; ``qwenimage``: Qwen-Image widths, 6 of 60 blocks, 1024x1024 and 256 masked text
tokens; random bf16 weights, batch 1, the same seeded inputs on every rank):

  one-gpu   each rank runs the whole model alone on its GPU (no collectives): the single-GPU reference on this host
  ulysses   a fresh model with ``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))``, the default
            attention backend (``native``: SDPA)
  ring      ``ring_degree=N`` over ``_native_cudnn`` (ring attention needs the log-sum-exp, which ``native`` does
            not return)

Each setting times every patch reverted (``vanilla``) and every patch applied (``all``) -- or ``--variants``, e.g.
``vanilla,all,-cp_all_to_all`` -- alternated A B A B (``--rounds``), and with ``--graphed`` each variant again
through ``torchpatches.cuda_graphs.graphed`` (one wrapper, a graph per variant: the collectives are captured into
the graph). A timed step starts on every rank together (a barrier, then each rank's queue drained): CUDA events
around it, the host's wall time to enqueue it; ``--back-to-back N`` also times N steps enqueued without a
synchronization (as a pipeline's loop runs them; on CUDA). Each rank measures itself; the table shows the slowest
rank (the step ends when its last rank does), the JSON keeps every rank. Outputs: each variant against ``vanilla``
of the same setting (the fused glue's rounding), and against one-gpu vanilla (what context parallelism itself
changes; the first setting's vanilla with ``--no-one-gpu``). ``--profile``: rank 0's GPU kernel time by class and
launches per step, per variant.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/flux_cp.py --json cp.json        # 2 GPUs
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/flux_cp.py --tiny                # CPU smoke (gloo)

The CPU smoke run uses what ``tests/patches/_context_parallel.py`` supplies for diffusers 0.42.1 on a host
without an accelerator (one reported device; a CPU kernel for the ring's flash attention) and forces the fused
ops' PyTorch tier.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _bench, _dit_models beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, Iterator, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _bench import GcPauses, profile, rel_err, save_json, state, time_back_to_back, time_steps, versions  # noqa: E402
from _dit_models import SPECS, flux_inputs, tiny_config_name  # noqa: E402

#: Models measured: FLUX.1-dev, FLUX.2's 2 + 12 blocks, Wan2.1-T2V-14B's widths, 4 of 40 blocks, 480x832x81, and
#: Qwen-Image's, 6 of 60 blocks (_dit_models.py; the CPU smoke run takes the harness's tiny models).
MODELS = ("flux1", "flux2", "wan", "qwenimage")
FLUX = ("flux1", "flux2")
#: Qwen-Image at 1024x1024 (64 x 64 = 4,096 packed tokens; the pipeline's default 1328x1328 gives 6,889, which
#: diffusers' equal-size sharder cannot split in two), 256 text tokens of which 230 valid, as _dit_models.py.
QWEN_SIDE = 64

#: mode -> (ContextParallelConfig's arguments but the degree's value, attention backend on CUDA, on CPU). The
#: "anything" modes are diffusers' uneven-shard forms (any sequence length; ``TemplatedUlyssesAnythingAttention`` /
#: ``TemplatedRingAnythingAttention`` in every attention call, even where the shards are equal).
MODES = {
    "ulysses": ({"ulysses_degree": None}, None, None),
    "ring": ({"ring_degree": None}, "_native_cudnn", "_native_flash"),
    "ulysses_anything": ({"ulysses_degree": None, "ulysses_anything": True}, None, None),
    "ring_anything": ({"ring_degree": None, "ring_anything": True}, "_native_cudnn", "_native_flash"),
}


def _barrier(device: torch.device) -> None:
    """Every rank here, and this rank's queue empty: the next step starts together everywhere."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
        torch.cuda.synchronize()
    else:
        dist.barrier()


@contextlib.contextmanager
def cpu_stand_ins(device: torch.device) -> Iterator[None]:
    """On a CPU-only host: what diffusers 0.42.1 lacks there (tests/patches/_context_parallel.py) and the
    fused ops' PyTorch tier (their Triton tier needs a GPU). Nothing on CUDA."""
    if device.type == "cuda":
        yield
        return
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "patches"))
    from _context_parallel import _cpu_flash_kernel, _one_device

    from torchpatches.ops import force_tier

    kernel = _cpu_flash_kernel()
    with _one_device(), force_tier("torch"):
        yield
    del kernel


def model_config(name: str, tiny: bool) -> Dict[str, Any]:
    if tiny:
        from harness import CONFIGS as HARNESS

        return dict(HARNESS[tiny_config_name(name)][1])
    return dict(SPECS[name].config)


def build(name: str, config: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    return _bench.build(SPECS[name].cls_name, config, device, dtype)


def model_inputs(name: str, config: Dict[str, Any], tiny: bool, device: torch.device,
                 dtype: torch.dtype, qwen_side: int = 0) -> Dict[str, Any]:
    """The model's inputs as its pipeline passes them, drawn from a seeded CPU generator (equal on every rank)."""
    if name in FLUX:
        side, text = (64, 8) if tiny else (1024, 512)
        return flux_inputs(name, config, side, text, device, dtype)
    if tiny:
        from harness import tiny_inputs

        return tiny_inputs(tiny_config_name(name), dtype=dtype, device=device)
    generator = torch.Generator(device="cpu").manual_seed(1)
    feed = SPECS[name].inputs(config, lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype),
                              device, dtype)
    if name == "qwenimage":
        side = qwen_side or QWEN_SIDE
        if side * side > feed["hidden_states"].shape[1]:
            raise SystemExit(f"--qwen-side {side}: the spec's inputs have {feed['hidden_states'].shape[1]} tokens")
        feed.update(hidden_states=feed["hidden_states"][:, : side * side].contiguous(),
                    img_shapes=[[(1, side, side)]])
    return feed


def parallel_model(name: str, mode: str, args: argparse.Namespace, device: torch.device,
                   dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import ContextParallelConfig

    config_args, cuda_backend, cpu_backend = MODES[mode]
    model = build(name, model_config(name, args.tiny), device, dtype)
    backend = cuda_backend if device.type == "cuda" else cpu_backend
    if backend is not None:
        model.set_attention_backend(backend)
    model.enable_parallelism(config=ContextParallelConfig(
        **{k: dist.get_world_size() if v is None else v for k, v in config_args.items()}))
    return model


def measure_setting(model: torch.nn.Module, feed: Dict[str, Any], args: argparse.Namespace,
                    device: torch.device) -> Dict[str, Any]:
    """Every variant of one setting, alternated: per variant the rounds' timings, its output, a profile."""
    step_of: Dict[str, Callable[[], Any]] = {}
    wrapper = None
    if args.graphed and device.type == "cuda":
        from torchpatches.cuda_graphs import graphed

        wrapper = graphed(model)
    variants = list(args.variants) + ([f"graphed:{v}" for v in args.variants] if wrapper is not None else [])
    for variant in variants:
        call = wrapper if variant.startswith("graphed:") else model
        step_of[variant] = lambda call=call: call(**feed)
    rows: Dict[str, Any] = {v: {"rounds": []} for v in variants}
    pauses = GcPauses()
    with torch.no_grad():
        for round_ in range(args.rounds):
            for variant in variants:
                with state(variant.split(":")[-1]):
                    step = step_of[variant]
                    together = functools.partial(_barrier, device)
                    cpu: List[float] = []
                    pauses.take()
                    with pauses:
                        times, host = time_steps(step, device, args.warmup, args.iters, before_each=together,
                                                 host_cpu=cpu)
                    timing = {"step_ms": statistics.median(times), "host_ms": statistics.median(host),
                              "steps_ms": [round(t, 2) for t in times], "hosts_ms": [round(h, 2) for h in host],
                              "host_cpu_ms": [round(c, 2) for c in cpu], "gc_steps": pauses.take()}
                    if args.back_to_back and device.type == "cuda":
                        with pauses:
                            b2b = time_back_to_back(step, args.back_to_back, 3, sync=together)
                        timing.update(back_to_back_ms=statistics.median(b2b), back_to_backs_ms=b2b,
                                      gc_back_to_back=pauses.take())
                    rows[variant]["rounds"].append(timing)
                    if round_ == 0:
                        rows[variant]["output"] = step()[0].float().cpu()
                        if args.profile and device.type == "cuda":
                            rows[variant]["profile"] = profile(step)  # "top": the 30 longest kernels (JSON)
    pauses.close()
    if wrapper is not None:
        rows["graph_info"] = repr(wrapper.info())
    return rows


def best(rounds: List[Dict[str, float]], key: str) -> Optional[float]:
    """The faster round's median (A B A B: the round the host's noise disturbed least)."""
    values = [r[key] for r in rounds if key in r]
    return min(values) if values else None


def summarize_setting(rows: Dict[str, Any], reference: torch.Tensor) -> Dict[str, Any]:
    """One rank's rows of a setting for the JSON: best rounds, all rounds, output errors, profile."""
    out: Dict[str, Any] = {}
    for variant, row in rows.items():
        if variant == "graph_info":
            out[variant] = row
            continue
        out[variant] = {
            "step_ms": best(row["rounds"], "step_ms"), "host_ms": best(row["rounds"], "host_ms"),
            "back_to_back_ms": best(row["rounds"], "back_to_back_ms"), "rounds": row["rounds"],
            "rel_err_vs_vanilla": rel_err(row["output"], rows["vanilla"]["output"]),
            "rel_err_vs_reference_vanilla": rel_err(row["output"], reference),
            **{k: row[k] for k in ("profile",) if k in row},
        }
    return out


def run_model(name: str, args: argparse.Namespace, device: torch.device, results: Dict[str, Any]) -> None:
    """Each setting measured, gathered from every rank, printed and saved (rank 0) before the next one starts."""
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = model_config(name, args.tiny)
    # seeded on the CPU: equal on every rank
    feed = model_inputs(name, config, args.tiny, device, dtype, args.qwen_side)
    entry = results.setdefault("models", {}).setdefault(name, {})
    reference = None
    for setting in (["one-gpu"] if args.one_gpu else []) + args.modes:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        model = (build(name, config, device, dtype) if setting == "one-gpu"
                 else parallel_model(name, setting, args, device, dtype))
        if args.gc_freeze:  # as a server does once its model is loaded: a full pass no longer walks it
            gc.collect()
            gc.freeze()
        rows = measure_setting(model, feed, args, device)
        gc.unfreeze()
        del model
        if reference is None:  # one GPU's vanilla; without that setting, the first setting's
            reference = rows["vanilla"]["output"]
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, summarize_setting(rows, reference))
        entry[setting] = gathered
        if dist.get_rank() == 0:
            print_setting(name, setting, entry, time.perf_counter() - t0)
            save_json(args.json, results)


def slowest(entry: Dict[str, Any], setting: str, variant: str, key: str) -> Optional[float]:
    values = [rank[variant][key] for rank in entry[setting]]
    return None if None in values else max(values)


def _x(value: Optional[float], base: Optional[float]) -> str:
    return f"{value / base:8.3f}x" if value is not None and base else f"{'-':>9}"


def print_rounds(setting: str, entry: Dict[str, Any]) -> None:
    """Every round, the slowest rank: step / back to back ms and their ratios to vanilla (torchpatches should be at
    or under 1 in every round), the ranks' thread CPU ms (median step) and Python's full GC passes in the timed stretches."""
    ranks = entry[setting]
    variants = [v for v in ranks[0] if v != "graph_info"]

    def worst(variant: str, index: int, key: str) -> float:
        return max(rank[variant]["rounds"][index].get(key) or 0.0 for rank in ranks)

    for index in range(len(ranks[0]["vanilla"]["rounds"])):
        base = worst("vanilla", index, "step_ms"), worst("vanilla", index, "back_to_back_ms")
        cells = []
        for variant in variants:
            step, b2b = worst(variant, index, "step_ms"), worst(variant, index, "back_to_back_ms")
            cpu = max(statistics.median(r[variant]["rounds"][index].get("host_cpu_ms") or [0.0]) for r in ranks)
            full = [int(r[variant]["rounds"][index].get(k, {}).get("gc2", 0)) for r in ranks
                    for k in ("gc_steps", "gc_back_to_back")]
            cells.append(f"{variant} {step:.1f}/{b2b:.1f} ({step / base[0]:.3f}x/{b2b / base[1] if base[1] else 0:.3f}x)"
                         f" cpu {cpu:.1f} gc2 {sum(full)}")
        print(f"{'':<9} round {index + 1}: " + " | ".join(cells))


def print_setting(name: str, setting: str, entry: Dict[str, Any], seconds: float) -> None:
    """The setting's rows: the slowest rank's best round; ratios to this setting's vanilla and one GPU's."""
    if setting == next(iter(entry)):
        print(f"\n{name}: slowest of {len(entry[setting])} ranks, the best of the alternated rounds (ms)")
        print(f"{'setting':<16} {'variant':<15} {'step':>7} {'host':>7} {'b2b':>7} {'/vanilla':>9} {'b2b/van':>9} "
              f"{'/1gpu van':>9} {'rel err':>9}")
    rows = entry[setting][0]
    one = slowest(entry, "one-gpu", "vanilla", "step_ms") if "one-gpu" in entry else None
    for variant in (v for v in rows if v != "graph_info"):
        step, host, b2b = (slowest(entry, setting, variant, k) for k in ("step_ms", "host_ms", "back_to_back_ms"))
        err = max(rank[variant]["rel_err_vs_vanilla"] for rank in entry[setting])
        print(f"{setting:<16} {variant:<15} {step:7.1f} {host:7.1f} {b2b if b2b is not None else float('nan'):7.1f} "
              f"{_x(step, slowest(entry, setting, 'vanilla', 'step_ms'))} "
              f"{_x(b2b, slowest(entry, setting, 'vanilla', 'back_to_back_ms'))} {_x(step, one)} {err:9.2e}")
    print_rounds(setting, entry)
    if "graph_info" in rows:
        print(f"{'':<9} graphs (rank 0): {rows['graph_info']}")
    for variant, row in rows.items():
        if isinstance(row, dict) and "profile" in row:
            p = row["profile"]
            classes = " ".join(f"{k} {v:.1f}" for k, v in p["ms_by_class"].items())
            print(f"{'':<9} rank 0 {variant}: GPU {p['gpu_kernel_ms']:.1f} ms ({classes}), "
                  f"{p['launches_per_step']:.0f} launches")
    print(f"{'':<9} ({seconds:.0f} s)", flush=True)


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="flux1", help="comma-separated: flux1, flux2, wan, qwenimage")
    p.add_argument("--modes", default="ulysses,ring",
                   help="comma-separated: ulysses, ring, ulysses_anything, ring_anything")
    p.add_argument("--qwen-side", type=int, default=0, metavar="N",
                   help=f"qwenimage: N x N packed image tokens (default {QWEN_SIDE}; the pipeline's 1328x1328 is 83)")
    p.add_argument("--backend", default="nccl",
                   help="init_process_group's backend on CUDA (e.g. 'cpu:gloo,cuda:nccl', as diffusers' run command)")
    p.add_argument("--variants", default="vanilla,all",
                   help="comma-separated _bench.state variants, vanilla first (vanilla, all, -PATCH, ...)")
    p.add_argument("--no-one-gpu", dest="one_gpu", action="store_false",
                   help="skip the single-GPU reference setting")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--back-to-back", type=int, default=8, help="steps per unsynchronized run (0: none)")
    p.add_argument("--graphed", action="store_true", help="also every variant through cuda_graphs.graphed")
    p.add_argument("--profile", action="store_true", help="rank 0's kernel time by class, per variant")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.collect(); gc.freeze() once each setting's model is built (Python's full collections "
                        "then skip every object that existed by then)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny configs, gloo")
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants or args.variants[0] != "vanilla":
        p.error("--variants must start with vanilla (each setting's ratios are to it)")
    for value, known, what in ((args.models, MODELS, "model"), (args.modes, MODES, "mode")):
        unknown = sorted(set(value) - set(known))
        if unknown:
            p.error(f"unknown {what} {unknown}; expected some of {sorted(known)}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    if "RANK" not in os.environ:
        sys.exit("run one process per GPU: python -m torch.distributed.run --nproc-per-node 2 " + __file__)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if args.tiny else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(args.backend, device_id=device)
    else:
        dist.init_process_group("gloo")
    import torchpatches  # noqa: F401  (applies every eligible patch, as a user's import does)

    results: Dict[str, Any] = {"command": _bench.command_line(argv), "versions": versions(),
                               "world_size": dist.get_world_size(), "args": {k: v for k, v in vars(args).items()}}
    try:
        with cpu_stand_ins(device):
            for name in args.models:
                run_model(name, args, device, results)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
