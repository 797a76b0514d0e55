"""The model runner: every diffusion transformer torchpatches serves (FLUX.1, FLUX.2, Wan 2.x, QwenImage, SD3.5) and the
families it fuses nothing in yet (FLUX.3, QwenImage 2.1, Z-Image, Krea 2, Wan 2.2 TI2V, HunyuanVideo 1.5, LTX-2,
Ideogram 4, Kandinsky 6, Chroma, HiDream-I1), eager and compiled, with and without torchpatches, in one table per
model; ``--plot`` draws the charts.

Production widths, random bf16 weights built on the GPU, batch 1, the inputs each diffusers pipeline passes
(``_dit_models.py`` says which shapes, layer subsets and inputs). For each model, in one process:

  eager/vanilla        every torchpatches patch reverted (``torchpatches.disabled()``): stock diffusers
  eager/all            every patch applied (what ``import torchpatches`` gives)
  eager/-NAME          every patch but the fused pattern NAME, for each pattern that runs on the model (found by
                       ``torchpatches.coverage`` on one eager step: the pattern fused at least one call)
  regional/vanilla     regional compile, ``fullgraph=True``: each of the model's ``_repeated_blocks``
                       (diffusers' ``compile_repeated_blocks``), or each block where the model declares none
  regional/all         the same with every patch applied
  full/vanilla         ``torch.compile(fullgraph=True)`` of the whole model; where ``--full-layers`` names a
  full/all             subset (FLUX.1: 2 + 4 blocks, a 57-block full compile takes minutes) it runs on those
                       blocks (weights shared) and is compared with ``full/eager-vanilla`` on the same blocks
  graph/vanilla        the eager step through ``torchpatches.cuda_graphs.graphed`` (one CUDA graph per patch state, both
  graph/all            rows share one wrapper and its memory pool; first call = warm-up + capture); CPU: eager calls
  after/vanilla        the eager steps again after the compiles (a process where torch.compile has run enqueues
  after/all            eager steps slower); ``--after-compile`` compiles a 3-op function first instead, so that
                       every eager row is in that state

Rows of a phase are timed in rounds, A B C .. A B C .. (``--rounds``), CUDA events, ``--steps`` steps per row
and round after ``--warmup``; the median over all rounds, and the spread of the round medians. Each compiled
row has its own code object (Dynamo caches per code object), so vanilla and patched compiled code live side by
side and alternate without recompiling; a recompile during timing is reported. Per row: step ms, ratio to eager
vanilla and to the faster vanilla compile, GPU kernel ms by class (GEMM / attention / other) and launches per
step (torch.profiler), host ms (wall time of enqueueing one step on an empty queue), GPU idle ms (step minus
kernel time), ||out - ref|| / ||ref|| against eager vanilla (compiled + patches also against its vanilla
compile), and the GPU's median SM clock, power and share of samples with a power/thermal clock-event reason
while the row was timed (``nvidia-smi -lms 50`` in the background). Inductor's caches are off. ``--json PATH``
is rewritten after every first call and round, so a run cut short keeps what it measured.

A model's eager rows are "fresh" only in a process where nothing was compiled yet: on a GPU, run one model per
process and merge the files (``--summary``). ``--summary FILE...`` prints the tables of earlier runs (a file of
``--json``, or a per-GPU results file such as ``results/h200.json``, whose ``dit`` section it reads); with
``--json`` it writes them merged into one file. ``--plot DIR`` draws, from the run or from ``--summary``'s files,
``DIR/dit-<gpu>-step.png`` (step time per model and variant, labelled with ratios) and ``DIR/dit-<gpu>-gpu-time.png``
(GPU time by class, GEMM / attention / other, and the rest of the step: host / idle), with matplotlib.

    python benchmarks/dit.py --models wan --json wan.json                      # GPU, one model
    python benchmarks/dit.py --models flux1 --variants eager,each,graph,regional --rounds 3 --json flux1.json
    python benchmarks/dit.py --summary flux1.json wan.json --json dit.json --plot docs/img
    python benchmarks/dit.py --tiny                                            # CPU smoke test, all models
    python benchmarks/dit.py --tiny --models sd3 --variants eager,each,regional,full,after --plot /tmp/charts
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench, _dit_models beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

from _dit_models import SPECS, Spec, layers_of, tiny_config_name, with_layers  # noqa: E402

GROUPS = {"eager": ("eager/vanilla", "eager/all"), "regional": ("regional/vanilla", "regional/all"),
          "full": ("full/vanilla", "full/all"), "after": ("after/vanilla", "after/all"),
          "graph": ("graph/vanilla", "graph/all")}
COMPILED = ("regional", "full")
CLOCKS: Optional[_bench.Clocks] = None  # the GPU's clock and power while rows are timed (main, on CUDA)


# ---- which fused patterns run on a model ------------------------------------------------------------


def pattern_activity(model: torch.nn.Module, feed: Dict[str, Any]) -> Tuple[Dict[str, Dict[str, Any]], Any]:
    """Per fusion pattern, in one eager step with every patch applied (``torchpatches.coverage``): calls ``fused``,
    calls handed to diffusers' code (``declined``) and why; and coverage's own timing (on CUDA: the step with and
    without torchpatches, alternated)."""
    import torchpatches

    report = torchpatches.coverage(model, **feed)
    found: Dict[str, Dict[str, Any]] = {}
    for row in report.rows:
        entry = found.setdefault(row["pattern"], {"fused": 0, "declined": 0, "reasons": []})
        if row["fused"]:
            entry["fused"] += row["calls"]
        else:
            entry["declined"] += row["calls"]
            entry["reasons"].append(f"{row['class']} x{row['calls']}: {row['reason']}")
    return found, report.timing


def runs(activity: Dict[str, Any]) -> bool:
    return activity.get("fused", 0) > 0


# ---- compiled variants -------------------------------------------------------------------------------


def _full_entry(model: torch.nn.Module, kwargs: Dict[str, Any]) -> Any:
    return model(**kwargs)


def _region_entry(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return self._call_impl(*args, **kwargs)  # what Module.compile() compiles


def fresh(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object: Dynamo keeps compiled code per code object, so each
    variant's compiled code stays valid beside the others'."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag.replace('-', '_')}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def regions(model: torch.nn.Module, spec: Spec) -> List[torch.nn.Module]:
    """The modules regional compilation compiles: the model's ``_repeated_blocks``, else every block."""
    repeated = getattr(model, "_repeated_blocks", None) or ()
    found = [m for m in model.modules() if type(m).__name__ in repeated]
    return found or [block for attr in spec.block_lists for block in getattr(model, attr)]


@contextlib.contextmanager
def regional(blocks: List[torch.nn.Module], compiled: Callable[..., Any]) -> Iterator[None]:
    """Each block runs through ``compiled`` (as ``Module.compile`` arranges) for the ``with`` block."""
    for block in blocks:
        block._compiled_call_impl = functools.partial(compiled, block)
    try:
        yield
    finally:
        for block in blocks:
            block._compiled_call_impl = None


@contextlib.contextmanager
def swapped(model: torch.nn.Module, lists: Dict[str, torch.nn.ModuleList]) -> Iterator[None]:
    """The model's block lists replaced by ``lists`` (the same list objects every time: no guard churn)."""
    saved = {attr: getattr(model, attr) for attr in lists}
    for attr, blocks in lists.items():
        setattr(model, attr, blocks)
    try:
        yield
    finally:
        for attr, blocks in saved.items():
            setattr(model, attr, blocks)


def subset_lists(model: torch.nn.Module, spec: Spec, layers: Tuple[int, ...]) -> Dict[str, torch.nn.ModuleList]:
    """The first n - 1 blocks and the last of each list (SD3's last block differs from the others)."""
    out = {}
    for attr, n in zip(spec.block_lists, layers):
        blocks = list(getattr(model, attr))
        if not 1 <= n <= len(blocks):
            raise ValueError(f"--full-layers: {attr} has {len(blocks)} blocks, asked for {n}")
        out[attr] = torch.nn.ModuleList(blocks[: n - 1] + blocks[-1:])
    return out


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---- rows --------------------------------------------------------------------------------------------


class Row:
    """One measured variant: how to enter its state, its step, and what was measured."""

    def __init__(self, key: str, variant: str, context: Callable[[], Any], step: Callable[[], Any],
                 ref: str = "eager/vanilla") -> None:
        self.key, self.variant, self.context, self.step, self.ref = key, variant, context, step, ref
        self.times: List[float] = []
        self.host: List[float] = []
        self.round_medians: List[float] = []
        self.recompiles = 0
        self.first_s: Optional[float] = None
        self.output: Optional[torch.Tensor] = None
        self.profile: Optional[Dict[str, Any]] = None
        self.error: Optional[str] = None
        self.windows: List[Tuple[float, float]] = []  # wall-clock stretches of the timed rounds (CLOCKS)
        self.back_to_back: List[float] = []  # ms per step of steps enqueued without a sync between them

    def first(self, device: torch.device) -> None:
        """The first call (a compile for compiled rows, Triton JIT for fused eager ones): its time and output."""
        with self.context(), grad_off():
            t = time.perf_counter()
            out = self.step()[0]
            if isinstance(out, list):  # one tensor per sample (Z-Image)
                out = torch.stack(out)
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.first_s = time.perf_counter() - t
            self.output = out.float().clone()

    def measure(self, device: torch.device, warmup: int, iters: int, back_to_back: int = 0) -> None:
        with self.context(), grad_off():
            before = graphs_compiled()
            with _bench.Clocks.window(self.windows):
                times, host = _bench.time_steps(self.step, device, warmup, iters)
                if back_to_back and device.type == "cuda":
                    self.back_to_back += _bench.time_back_to_back(self.step, back_to_back, 3)
            self.recompiles += graphs_compiled() - before
        self.times += times
        self.host += host
        self.round_medians.append(statistics.median(times))

    def record(self) -> Dict[str, Any]:
        row: Dict[str, Any] = {"variant": self.variant, "ref": self.ref, "first_call_s": self.first_s,
                               "error": self.error}
        if self.times:
            row.update(_bench.summary(self.times))
            med = row["median_ms"]
            row.update(round_medians_ms=self.round_medians, times_ms=self.times, host_ms=statistics.median(self.host),
                       spread=(max(self.round_medians) - min(self.round_medians)) / med, recompiles=self.recompiles)
        if self.back_to_back:
            row["back_to_back_ms"] = statistics.median(self.back_to_back)
        if CLOCKS is not None and self.windows:
            row["clocks"] = CLOCKS.stats(self.windows)
        if self.profile is not None:
            row["profile"] = self.profile
            if self.times:
                row["gpu_idle_ms"] = row["median_ms"] - self.profile["gpu_kernel_ms"]
        return row


def plan(wanted: List[str], patterns: List[str], subset: bool) -> List[Tuple[str, str]]:
    """(row key, variant) of the rows asked for; eager/vanilla (the reference) always."""
    keys = ["eager/vanilla"]
    for token in wanted:
        if token == "each":
            keys += [f"eager/-{p}" for p in patterns]
        elif token in GROUPS:
            keys += GROUPS[token]
        else:
            keys.append(token if "/" in token else f"eager/{token}")
    if not any(k.split("/")[0] in COMPILED for k in keys):
        keys = [k for k in keys if not k.startswith("after/")]  # "after" a compile: none ran
    if subset and any(k.startswith("full/") for k in keys):
        keys.append("full/eager-vanilla")
    seen: Dict[str, None] = dict.fromkeys(keys)
    return [(k, k.split("/", 1)[1].replace("eager-", "")) for k in seen]


# ---- one model ---------------------------------------------------------------------------------------


def load(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
         ) -> Tuple[torch.nn.Module, Dict[str, Any], Spec, Dict[str, Any]]:
    spec = SPECS[name]
    if args.tiny:
        from harness import tiny_inputs
        from harness import CONFIGS

        tiny = tiny_config_name(name)
        cls_name, config = CONFIGS[tiny]
        spec = Spec(cls_name, dict(config), spec.layer_keys, spec.block_lists, layers_of(spec, config), spec.inputs)
    else:
        cls_name, config = spec.cls_name, dict(spec.config)
    if name in args.layers:
        config = with_layers(spec, config, args.layers[name])
    model = _bench.build(cls_name, config, device, dtype)
    if args.tiny:
        feed = tiny_inputs(tiny, dtype=dtype, device=device)
    else:
        gen = torch.Generator(device="cpu").manual_seed(1)
        feed = spec.inputs(config, lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype),
                           device, dtype)
    return model, feed, spec, config


def auto_steps(step: Callable[[], Any], device: torch.device, target_ms: float) -> int:
    """Steps per row and round so that a round of one row takes about ``target_ms`` (6 to 60)."""
    times, _ = _bench.time_steps(step, device, 1, 2)
    return max(6, min(60, math.ceil(target_ms / max(min(times), 1e-3))))


def make_rows(name: str, model: torch.nn.Module, feed: Dict[str, Any], spec: Spec, wanted: List[str],
              running: List[str], sub: Optional[Tuple[int, ...]]) -> List[Row]:
    """The rows asked for, each with its context (patch state, compiled regions, subset) and step."""
    step = functools.partial(model, **feed)
    sub_lists = subset_lists(model, spec, sub) if sub else {}
    blocks = regions(model, spec)
    rows = []
    graph_step: Optional[Callable[..., Any]] = None
    for key, variant in plan(wanted, running, bool(sub)):
        kind = key.split("/", 1)[0]
        ctx = functools.partial(_context, variant, sub_lists if kind == "full" else {}, model)
        if kind == "regional":
            compiled = torch.compile(fresh(_region_entry, f"{name}_{variant}"), fullgraph=True)
            rows.append(Row(key, variant, functools.partial(_context, variant, {}, model, blocks, compiled), step))
        elif key == "full/eager-vanilla":
            rows.append(Row(key, variant, ctx, step, ref=key))
        elif kind == "full":
            compiled = torch.compile(fresh(_full_entry, f"{name}_{variant}"), fullgraph=True)
            rows.append(Row(key, variant, ctx, functools.partial(compiled, model, feed),
                            ref="full/eager-vanilla" if sub else "eager/vanilla"))
        elif kind == "graph":  # one wrapper: each patch state finds its own graph, one memory pool
            if graph_step is None:
                from torchpatches.cuda_graphs import graphed

                graph_step = functools.partial(graphed(model), **feed)
            rows.append(Row(key, variant, ctx, graph_step))
        else:
            rows.append(Row(key, variant, ctx, step))
    return rows


def _guarded(name: str, row: Row, what: str, action: Callable[[], None]) -> None:
    """``action()``; an exception (a compile that fails, memory) marks the row failed instead of ending the run."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - a failing variant must not cost the others
        row.error = f"{what}: {type(error).__name__}: {error}"[:500]
        print(f"[{name}] {row.key}: FAILED {row.error}", flush=True)


def run_phases(name: str, rows: List[Row], args: argparse.Namespace, device: torch.device, steps: int,
               save: Callable[[], None]) -> None:
    """Eager and graph rows, then compiled rows with the eager "after" rows: first calls (compiles) first, so that
    the rounds alternate steady states; then the profiles. Saved as it goes (a call cut short keeps the rest)."""
    fresh_rows = ("eager/", "graph/")  # before any compile
    phases = [[r for r in rows if r.key.startswith(fresh_rows)], [r for r in rows if not r.key.startswith(fresh_rows)]]
    for phase in phases:
        for row in phase:
            _guarded(name, row, "first call", functools.partial(row.first, device))
            if row.error is None:
                print(f"[{name}] {row.key}: first call {row.first_s:.1f} s", flush=True)
            save()
        for _ in range(args.rounds):
            for row in phase:
                if row.error is None:
                    _guarded(name, row, "timing", functools.partial(row.measure, device, args.warmup, steps,
                                                                    args.back_to_back))
            save()
    if device.type == "cuda" and not args.no_profile:
        for row in rows:
            if row.error is None:
                _guarded(name, row, "profile", functools.partial(_profile_row, row))
        save()


def _profile_row(row: Row) -> None:
    with row.context(), grad_off():
        row.profile = _bench.profile(row.step)


def run_model(name: str, args: argparse.Namespace, results: Dict[str, Any]) -> None:
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch._dynamo.reset()
    t0 = time.perf_counter()
    model, feed, spec, config = load(name, args, device, dtype)
    layers = layers_of(spec, config)
    sub = args.full_layers.get(name)
    sub = tuple(min(n, most) for n, most in zip(sub, layers)) if sub is not None else None
    sub = sub if sub != layers else None
    entry: Dict[str, Any] = {
        "class": spec.cls_name, "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "layers": list(layers), "model_layers": list(spec.full_layers), "full_compile_layers": list(sub or layers),
        "dtype": str(dtype), "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "build_s": time.perf_counter() - t0, "rows": {}}
    results["models"][name] = entry
    print(f"[{name}] {spec.cls_name}, layers {'+'.join(map(str, layers))} of {'+'.join(map(str, spec.full_layers))},"
          f" {entry['params_b']:.2f} B params, built in {entry['build_s']:.1f} s", flush=True)

    step = functools.partial(model, **feed)
    with _bench.state("all"), grad_off():
        entry["patterns"], entry["coverage_timing"] = pattern_activity(model, feed)
    running = [p for p, a in entry["patterns"].items() if runs(a)]
    print(f"[{name}] fused patterns that run: {', '.join(running) or 'none'}", flush=True)
    with _bench.state("vanilla"), grad_off():
        steps = args.steps or auto_steps(step, device, args.round_ms)
    entry["steps_per_round"], entry["rounds"] = steps, args.rounds

    wanted = [v for v in args.variants if not (v == "after" and args.after_compile)]
    rows = make_rows(name, model, feed, spec, wanted, running, sub)
    by_key = {row.key: row for row in rows}

    def save() -> None:
        entry["rows"] = {row.key: row.record() for row in rows}
        finish(entry, by_key)
        _bench.save_json(args.json, results)

    run_phases(name, rows, args, device, steps, save)
    print_model(name, entry)
    del model, feed, step, rows, by_key
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        entry["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def _context(variant: str, lists: Dict[str, torch.nn.ModuleList], model: torch.nn.Module,
             blocks: Optional[List[torch.nn.Module]] = None, compiled: Optional[Callable[..., Any]] = None
             ) -> Iterator[None]:
    with _bench.state(variant), swapped(model, lists):
        with (regional(blocks, compiled) if compiled is not None else contextlib.nullcontext()):
            yield


def finish(entry: Dict[str, Any], rows: Dict[str, Row]) -> None:
    """Ratios (to the row's eager vanilla and to the faster vanilla compile) and output errors."""
    table = entry["rows"]

    def ratio(key: str, field: str = "median_ms") -> Optional[float]:
        row, ref = table.get(key, {}), table.get(table.get(key, {}).get("ref", ""), {})
        return row[field] / ref[field] if field in row and field in ref else None

    compiled = [r for r in (ratio("regional/vanilla"), ratio("full/vanilla")) if r is not None]
    best = min(compiled) if compiled else None
    entry["best_vanilla_compile"] = ({"regional/vanilla": ratio("regional/vanilla"), "full/vanilla":
                                     ratio("full/vanilla")} if compiled else None)
    compiled_b2b = [r for r in (ratio(k, "back_to_back_ms") for k in ("regional/vanilla", "full/vanilla"))
                    if r is not None]
    for key, row in table.items():
        if "back_to_back_ms" in row:
            r = ratio(key, "back_to_back_ms")
            row["back_to_back_vs_eager_vanilla"] = r
            row["back_to_back_vs_vanilla_compile"] = r / min(compiled_b2b) if r is not None and compiled_b2b else None
    for key, row in table.items():
        r = ratio(key)
        row["ratio_vs_eager_vanilla"] = r
        row["ratio_vs_vanilla_compile"] = r / best if r is not None and best else None
        out, ref = rows[key].output, rows.get(row["ref"])
        if out is not None and ref is not None and ref.output is not None:
            row["rel_err_vs_eager_vanilla"] = _bench.rel_err(out, ref.output)
        twin = rows.get(key.split("/")[0] + "/vanilla")
        if (key.split("/")[0] in COMPILED and rows[key].variant != "vanilla" and twin is not None
                and twin.output is not None and out is not None):
            row["rel_err_vs_vanilla_compile"] = _bench.rel_err(out, twin.output)


# ---- output ------------------------------------------------------------------------------------------


def _f(value: Optional[float], fmt: str, width: int, unit: str = "") -> str:
    return (format(value, fmt) + unit if value is not None else "-").rjust(width)


def print_model(name: str, entry: Dict[str, Any]) -> None:
    layers = "+".join(map(str, entry["layers"]))
    note = ""
    if entry["full_compile_layers"] != entry["layers"]:
        note = (f"; full compile on {'+'.join(map(str, entry['full_compile_layers']))} blocks, its ratios against"
                f" full/eager-vanilla on the same blocks")
    print(f"\n{name}: {entry['class']}, {layers} of {'+'.join(map(str, entry['model_layers']))} layers, "
          f"{entry['params_b']:.2f} B params, {entry['steps_per_round']} steps x {entry['rounds']} rounds{note}")
    print(f"{'variant':<24}{'median ms':>10}{'spread':>8}{'/eager':>8}{'/compile':>9}{'GEMM':>8}{'attn':>7}"
          f"{'other':>7}{'launch':>7}{'host ms':>8}{'idle ms':>8}{'err/eager':>10}{'err/comp':>9}{'first s':>8}"
          f"{'SM MHz':>7}{'W':>5}{'capped':>7}")
    for key, row in entry["rows"].items():
        if row.get("error"):
            print(f"{key:<24} FAILED: {row['error'][:100]}")
            continue
        prof = row.get("profile") or {}
        by = prof.get("ms_by_class", {})
        clocks = row.get("clocks") or {}
        flag = f"  ({row['recompiles']} recompiles while timed)" if row.get("recompiles") else ""
        spread = 100 * row["spread"] if "spread" in row else None
        print(f"{key:<24}{_f(row.get('median_ms'), '.2f', 10)}{_f(spread, '.1f', 8, '%')}"
              f"{_f(row.get('ratio_vs_eager_vanilla'), '.3f', 8, 'x')}"
              f"{_f(row.get('ratio_vs_vanilla_compile'), '.3f', 9, 'x')}"
              f"{_f(by.get('gemm'), '.1f', 8)}{_f(by.get('attention'), '.1f', 7)}{_f(by.get('other'), '.1f', 7)}"
              f"{_f(prof.get('launches_per_step'), '.0f', 7)}{_f(row.get('host_ms'), '.1f', 8)}"
              f"{_f(row.get('gpu_idle_ms'), '.1f', 8)}{_f(row.get('rel_err_vs_eager_vanilla'), '.2e', 10)}"
              f"{_f(row.get('rel_err_vs_vanilla_compile'), '.2e', 9)}{_f(row.get('first_call_s'), '.1f', 8)}"
              f"{_f(clocks.get('sm_mhz'), '.0f', 7)}{_f(clocks.get('power_w'), '.0f', 5)}"
              f"{_f(clocks.get('capped_frac'), '.0%', 7)}{flag}")
    patterns = entry.get("patterns", {})
    runs_ = [f"{p} ({a['fused']}/{a['fused'] + a['declined']} calls fused)" for p, a in patterns.items() if runs(a)]
    print(f"  fused patterns that run: {', '.join(runs_) or 'none'}")
    for pattern, activity in patterns.items():
        for reason in activity.get("reasons", []):
            print(f"  {pattern}: diffusers' code ran for {reason}")
    b2b = [f"{key} {row['back_to_back_ms']:.2f} ms ({_f(row.get('back_to_back_vs_eager_vanilla'), '.3f', 0, 'x')} "
           f"eager, {_f(row.get('back_to_back_vs_vanilla_compile'), '.3f', 0, 'x')} compile)"
           for key, row in entry["rows"].items() if "back_to_back_ms" in row]
    if b2b:
        print("  back to back (steps enqueued without a sync, as a pipeline's loop; median): " + "; ".join(b2b))


def print_summary(models: Dict[str, Dict[str, Any]]) -> None:
    """One line per model: the headline figures (eager + patches against eager and against the faster vanilla
    compile, compiled + patches against vanilla compile, "other" GPU ms and launches, host ms fresh / after)."""
    head = [("model", 10), ("layers", 7), ("eager ms", 9), ("all", 8), ("best compile", 16), ("all/comp", 9),
            ("graph/comp", 11), ("reg+tp", 8), ("full+tp", 8), ("other ms van/all/comp", 23),
            ("launches van/all/comp", 23),
            ("host all/after", 16), ("err all", 9), ("err comp", 9)]
    print("\n" + "".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(head)))
    for name, entry in models.items():
        rows = entry.get("rows", {})

        def get(key: Optional[str], field: str) -> Optional[float]:
            return (rows.get(key) or {}).get(field) if key else None

        def prof(key: Optional[str], field: str) -> Optional[float]:
            p = (rows.get(key) or {}).get("profile") or {} if key else {}
            return p.get("ms_by_class", {}).get("other") if field == "other" else p.get(field)

        def twin(kind: str) -> Optional[float]:
            all_, van = get(f"{kind}/all", "median_ms"), get(f"{kind}/vanilla", "median_ms")
            return all_ / van if all_ and van else None

        def three(field: str, fmt: str) -> str:
            return "/".join(_f(prof(k, field), fmt, 0) for k in ("eager/vanilla", "eager/all", best))

        ratios = {k: v for k, v in (entry.get("best_vanilla_compile") or {}).items() if v is not None}
        best = min(ratios, key=ratios.__getitem__) if ratios else None
        sub = entry["full_compile_layers"]
        subset = f"@{'+'.join(map(str, sub))}" if best == "full/vanilla" and sub != entry["layers"] else ""
        cells = [name.ljust(10), "+".join(map(str, entry["layers"])).rjust(7),
                 _f(get("eager/vanilla", "median_ms"), ".1f", 9), _f(get("eager/all", "ratio_vs_eager_vanilla"),
                 ".3f", 8, "x"), (f"{ratios[best]:.3f}x {best.split('/')[0]}{subset}" if best else "-").rjust(16),
                 _f(get("eager/all", "ratio_vs_vanilla_compile"), ".3f", 9, "x"),
                 _f(get("graph/all", "ratio_vs_vanilla_compile"), ".3f", 11, "x"), _f(twin("regional"), ".3f", 8, "x"),
                 _f(twin("full"), ".3f", 8, "x"), three("other", ".1f").rjust(23),
                 three("launches_per_step", ".0f").rjust(23),
                 f"{_f(get('eager/all', 'host_ms'), '.1f', 0)}/{_f(get('after/all', 'host_ms'), '.1f', 0)}".rjust(16),
                 _f(get("eager/all", "rel_err_vs_eager_vanilla"), ".1e", 9), _f(get(best, "rel_err_vs_eager_vanilla"),
                 ".1e", 9)]
        print("".join(cells))


def load_results(paths: List[str]) -> Dict[str, Any]:
    """The runs in ``paths`` merged into one ``{"versions", "commands", "models"}``; a later file's model replaces an
    earlier one's. A file is what ``--json`` wrote or a per-GPU results file (its ``dit`` section). Each model keeps
    its own ``command`` and ``versions``; the top-level ``versions`` are those all models share (else "mixed")."""
    import json

    models: Dict[str, Dict[str, Any]] = {}
    commands: List[str] = []
    for path in paths:
        with open(path) as handle:
            data = json.load(handle)
        data = data.get("dit", data)
        for name, entry in data.get("models", {}).items():
            entry.setdefault("command", data.get("command"))
            entry.setdefault("versions", data.get("versions", {}))
            models[name] = entry
        commands += data.get("commands") or ([data["command"]] if data.get("command") else [])
    gpus = {entry["versions"].get("gpu", "cpu") for entry in models.values()}
    if len(gpus) > 1:
        raise SystemExit(f"--summary: the files were measured on different devices ({', '.join(sorted(gpus))})")
    keys = dict.fromkeys(k for entry in models.values() for k in entry["versions"])
    versions = {}
    for key in keys:
        values = {str(entry["versions"].get(key)) for entry in models.values()}
        versions[key] = values.pop() if len(values) == 1 else "mixed"
    return {"versions": versions, "commands": list(dict.fromkeys(commands)), "models": models}


def summarize(paths: List[str], json_path: Optional[str], plot_dir: Optional[str], plot_name: Optional[str]) -> None:
    """The tables and the summary of files written by earlier runs (one per model, say); merged into ``json_path``
    and drawn into ``plot_dir`` where given."""
    results = load_results(paths)
    print(" ".join(f"{k} {v}" for k, v in results["versions"].items()))
    for name, entry in results["models"].items():
        if entry.get("rows"):
            print_model(name, entry)
    print_summary(results["models"])
    _bench.save_json(json_path, results)
    if plot_dir:
        plot(results, plot_dir, plot_name)


def plot(results: Dict[str, Any], out_dir: str, name: Optional[str]) -> None:
    """The two charts of ``results`` into ``out_dir`` (matplotlib: needed here only)."""
    from _dit_charts import draw

    for path in draw(results, out_dir, name):
        print(f"wrote {path}")


# ---- command line ------------------------------------------------------------------------------------


def _per_model(text: str, default: Dict[str, Optional[Tuple[int, ...]]], models: List[str]
               ) -> Dict[str, Optional[Tuple[int, ...]]]:
    """``"wan=4,flux1=19+38"`` or ``"4"`` (every model; each block list) -> {model: layers or None ("all")}."""
    out = dict(default)
    for item in [i for i in text.split(",") if i]:
        target, _, value = item.rpartition("=")
        parsed = None if value == "all" else tuple(int(v) for v in value.split("+"))
        for name in ([target] if target else models):
            single = parsed is not None and len(parsed) == 1
            out[name] = parsed * len(SPECS[name].layer_keys) if single else parsed
    return out


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the harness's tiny configs on the CPU (PyTorch tiers)")
    parser.add_argument("--list", action="store_true", help="print each model's shapes and block subset, and exit")
    parser.add_argument("--models", default=",".join(SPECS))
    parser.add_argument("--variants", default=None,
                        help="groups eager,each,graph,regional,full,after or row names (regional/all, -adaln); "
                             "default eager,each,graph,regional,full,after (--tiny: eager,each)")
    parser.add_argument("--layers", default="", help="block counts: wan=4,flux1=19+38 (default: _dit_models.py)")
    parser.add_argument("--full-layers", default="",
                        help="blocks full compile runs on: flux1=2+4 (the default), NAME=all for the whole model")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row and round (default: ~--round-ms)")
    parser.add_argument("--round-ms", type=float, default=2000.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before each row's round (2; tiny 1)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-grad", action="store_true",
                        help="steps under torch.no_grad() as diffusers' pipelines run them (default: inference_mode)")
    parser.add_argument("--after-compile", action="store_true",
                        help="compile a 3-op function first: every eager row then runs after a torch.compile")
    parser.add_argument("--back-to-back", type=int, default=0, metavar="N",
                        help="also each row's ms per step over N steps enqueued without a sync (3 per round)")
    parser.add_argument("--json", help="write the results here (with --summary: the files merged)")
    parser.add_argument("--summary", nargs="+", metavar="JSON", help="print the tables of earlier runs and exit")
    parser.add_argument("--plot", metavar="DIR", help="draw the step-time and GPU-time charts into DIR (matplotlib)")
    parser.add_argument("--plot-name", metavar="PREFIX",
                        help="the charts' file name prefix (default dit-<gpu>: dit-h200, dit-cpu)")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(SPECS)}")
    args.models = models
    default = "eager,each" if args.tiny else "eager,each,graph,regional,full,after"
    args.variants = [v for v in (args.variants or default).split(",") if v]
    args.layers = {k: v for k, v in _per_model(args.layers, {}, models).items() if v is not None}
    args.full_layers = _per_model(args.full_layers, {} if args.tiny else {"flux1": (2, 4)}, models)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    if args.tiny:
        args.steps = args.steps or 2
    return args


#: What the steps run under: ``torch.inference_mode()``, or ``torch.no_grad()`` as diffusers' pipelines run
#: (``--no-grad``; tensors made under inference mode carry no version counter, so torchpatches' per-step caches,
#: ``patches/_per_step.py``, cannot be used there and each block rebuilds its tables and masks as diffusers does).
NO_GRAD = False


def grad_off() -> Any:
    return torch.no_grad() if NO_GRAD else torch.inference_mode()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    global NO_GRAD
    NO_GRAD = args.no_grad
    if args.summary:
        summarize(args.summary, args.json, args.plot, args.plot_name)
        return 0
    if args.list:
        for name in args.models:
            print(f"{name:15s} {SPECS[name].about}")
        return 0
    if args.plot:
        import _dit_charts

        _dit_charts.require_matplotlib()  # before the run, not after it
    import torchpatches

    results: Dict[str, Any] = {"versions": _bench.versions(), "command": _bench.command_line(argv),
                               "after_compile": args.after_compile,
                               "grad": "no_grad" if args.no_grad else "inference_mode", "models": {}}
    forced = contextlib.nullcontext()
    if args.tiny:  # CPU: the patterns run their fused path through the PyTorch tier
        from torchpatches.ops import force_tier

        forced = force_tier("torch")
    if args.after_compile:
        _bench.compile_once(torch.device("cpu" if args.tiny else "cuda"))
    global CLOCKS
    CLOCKS = None if args.tiny else _bench.Clocks()
    try:
        with forced:
            for name in args.models:
                run_model(name, args, results)
                _bench.save_json(args.json, results)
    finally:
        if CLOCKS is not None:
            CLOCKS.close()
    print_summary(results["models"])
    print("\n" + " ".join(f"{k} {v}" for k, v in results["versions"].items()))
    print(torchpatches.status())
    if args.plot:
        plot(load_results([args.json]) if args.json else results, args.plot, args.plot_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
