"""What the benchmarks share: building a model with random weights on the device, putting torchpatches into a
variant's state, timing steps (CUDA events) and host calls, classifying the profiler's kernels, comparing outputs,
and the versions a result was measured with. Not a benchmark itself; it imports public torchpatches names only.

Importing this module turns Inductor's caches off (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``,
``TORCHINDUCTOR_AUTOGRAD_CACHE=0``) unless the caller set them, so that every compile is a real one: import it
before anything imports torch._inductor.
"""
from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # the tests' harness

__all__ = ["build", "time_steps", "time_back_to_back", "kernel_class", "kernel_times", "profile", "state", "rel_err",
           "versions", "summary", "save_json", "compile_once", "command_line", "Clocks", "host_us_per_call",
           "GcPauses"]


def build(cls_name: str, config: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``diffusers.<cls_name>(**config)`` with seeded random weights, created on ``device`` in ``dtype``
    directly (a large model never passes through the host), in eval mode without grad. The parameters
    and persistent buffers a checkpoint loaded with ``torch_dtype=dtype`` keeps in float32 (the class's
    ``_keep_in_fp32_modules``: Wan's norms, modulation tables and time embedder) are float32, as
    ``from_pretrained`` leaves them."""
    import diffusers

    cls = getattr(diffusers, cls_name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            torch.manual_seed(0)
            model = cls(**config)
    finally:
        torch.set_default_dtype(previous)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    if dtype != torch.float32 and keep:
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            # diffusers' loader matches whole name components (model_loading_utils.load_model_dict_into_meta)
            if tensor.is_floating_point() and any(k in name.split(".") for k in keep):
                tensor.data = tensor.data.float()
    return model.eval().requires_grad_(False)


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int, iters: int,
               before_each: Optional[Callable[[], Any]] = None,
               host_cpu: Optional[List[float]] = None) -> Tuple[List[float], List[float]]:
    """(step ms from CUDA events, host ms to enqueue the step): host close to step means CPU-bound.

    Each step starts on an empty queue (the previous one synchronized), so host ms is the wall time of
    enqueueing ``step()`` alone. ``before_each`` runs before each timed step, outside the timing (a barrier
    that starts every rank's step together). ``host_cpu``, a list, receives this thread's CPU ms for the same
    stretch (``time.thread_time``): wall well above it means the thread waited (a sync, a busy host, a shared VM's
    other tenants), not that it worked."""
    for _ in range(warmup):
        step()
    times, host = [], []
    if device.type != "cuda":
        for _ in range(iters):
            if before_each is not None:
                before_each()
            t, cpu = time.perf_counter(), time.thread_time()
            step()
            times.append((time.perf_counter() - t) * 1e3)
            if host_cpu is not None:
                host_cpu.append((time.thread_time() - cpu) * 1e3)
        return times, times
    torch.cuda.synchronize()
    for _ in range(iters):
        if before_each is not None:
            before_each()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t, cpu = time.perf_counter(), time.thread_time()
        step()
        host.append((time.perf_counter() - t) * 1e3)
        if host_cpu is not None:
            host_cpu.append((time.thread_time() - cpu) * 1e3)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, host


def time_back_to_back(step: Callable[[], Any], iters: int, repeats: int,
                      sync: Callable[[], Any] = torch.cuda.synchronize) -> List[float]:
    """ms per step of ``iters`` steps enqueued without a synchronization between them (as a pipeline's loop runs
    them: the host's work for step n+1 overlaps the GPU's for step n), one figure per repeat, CUDA events.
    ``sync`` empties the queue before each repeat (a barrier too, where every rank must start together)."""
    per: List[float] = []
    for _ in range(repeats):
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) / iters)
    return per


class GcPauses:
    """Python's garbage-collector passes inside timed stretches: count and ms per generation (``gc.callbacks``).

    A full (generation 2) pass walks every tracked object of the process -- with torch and a diffusers model loaded,
    long enough to show in a host-bound step; under context parallelism the other rank waits for it at the next
    exchange. ``with pauses:`` marks a stretch; ``take()`` returns and clears what it saw:
    ``{"gc0": n, "gc0_ms": ms, ..., "gc2_ms": ms}``; ``close()`` when done."""

    def __init__(self) -> None:
        self._on = False
        self._started: Optional[float] = None
        self._seen: Dict[str, float] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: Dict[str, Any]) -> None:
        if not self._on:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            key = f"gc{info['generation']}"
            self._seen[key] = self._seen.get(key, 0) + 1
            self._seen[f"{key}_ms"] = self._seen.get(f"{key}_ms", 0.0) + (time.perf_counter() - self._started) * 1e3
            self._started = None

    def __enter__(self) -> "GcPauses":
        self._on = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._on = False

    def take(self) -> Dict[str, float]:
        seen, self._seen = self._seen, {}
        return {k: round(v, 3) for k, v in sorted(seen.items())}

    def close(self) -> None:
        """Stop listening (the callback leaves ``gc.callbacks``)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class Clocks:
    """The GPU's SM clock (MHz), power draw (W) and active clock-event (throttle) reasons, sampled every 50 ms by
    ``nvidia-smi -lms`` in the background, so a row's GPU time can be read against the clock it ran at (GEMM time
    rises when the elementwise kernels are fused away: the GPU runs into its power cap at a lower clock).

    ``window()`` marks a timed stretch; ``stats(windows)`` summarises the samples inside those stretches. Without
    ``nvidia-smi`` (CPU runs) every ``stats`` is None."""

    FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self) -> None:
        import shutil
        import subprocess
        import threading

        self.samples: List[Tuple[float, float, float, float, int]] = []
        self.proc = None
        if shutil.which("nvidia-smi") is None or not torch.cuda.is_available():
            return
        index = torch.cuda.current_device()
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", str(index), f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        import datetime

        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                reasons = int(parts[4], 16) if parts[4].startswith("0x") else 0
                self.samples.append((when, float(parts[1]), float(parts[2]), float(parts[3]), reasons))
            except (ValueError, IndexError):
                continue  # a header or an unsupported field: no sample

    @staticmethod
    @contextlib.contextmanager
    def window(windows: List[Tuple[float, float]]) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            windows.append((start, time.time()))

    def stats(self, windows: List[Tuple[float, float]]) -> Optional[Dict[str, float]]:
        """Median SM MHz, W and C over the samples inside ``windows``, and the share of them with a power or
        thermal clock-event reason set (nvidia-smi's bits 0x4 SW power cap, 0x8 HW slowdown, 0x20 SW thermal,
        0x40 HW thermal, 0x80 HW power brake)."""
        inside = [s for s in self.samples if any(a <= s[0] <= b for a, b in windows)]
        if not inside:
            return None
        return {"sm_mhz": statistics.median(s[1] for s in inside), "power_w": statistics.median(s[2] for s in inside),
                "temp_c": statistics.median(s[3] for s in inside),
                "capped_frac": sum(1 for s in inside if s[4] & 0xEC) / len(inside), "samples": len(inside)}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


_ATTENTION = re.compile(r"sdpa|flash|fmha|attention|attn", re.I)
_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|splitk|matmul|_mm_|sm90_", re.I)


def kernel_class(name: str) -> str:
    """"attention", "gemm" or "other" (norms, modulation, RoPE, gates, residuals, casts, copies) by kernel name."""
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "other"


def kernel_times(step: Callable[[], Any], steps: int = 2) -> List[Tuple[str, float, float]]:
    """(kernel name, GPU ms per step, launches per step) of every CUDA kernel and copy in ``steps`` steps after
    one unprofiled step, longest first (torch.profiler; CUDA only)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        if getattr(event, "device_type", None) != DeviceType.CUDA:
            continue
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = event.self_cuda_time_total
        kernels.append((event.key[:140], us / steps / 1e3, event.count / steps))
    kernels.sort(key=lambda row: -row[1])
    return kernels


def profile(step: Callable[[], Any], steps: int = 2) -> Dict[str, Any]:
    """GPU time per step by kernel class and kernel launches per step, from torch.profiler (CUDA only)."""
    kernels = kernel_times(step, steps)
    by_class: Dict[str, float] = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for key, ms, _ in kernels:
        by_class[kernel_class(key)] += ms
    return {
        "gpu_kernel_ms": sum(row[1] for row in kernels),
        "ms_by_class": by_class,
        "launches_per_step": sum(row[2] for row in kernels),
        "top": kernels[:30],
    }


@contextlib.contextmanager
def state(variant: str) -> Iterator[None]:
    """Put torchpatches into a variant's state for the block; the previous state afterwards.

    ``vanilla``: every patch reverted (stock diffusers); ``all``: every patch applied (what ``import torchpatches``
    gives); ``-NAME``: every patch but NAME. A trailing ``+`` (a repeated measurement) is ignored."""
    import torchpatches

    base = variant.rstrip("+")
    if base == "vanilla":
        with torchpatches.disabled():
            yield
        return
    torchpatches.apply()
    if base == "all":
        yield
    elif base.startswith("-") and base[1:] in torchpatches.patch_names():
        with torchpatches.disabled(base[1:]):
            yield
    else:
        raise ValueError(f"unknown variant {variant!r}: vanilla, all or -NAME")


def host_us_per_call(fn: Callable[[], Any], batch: int, repeats: int, sync: Callable[[], Any]) -> float:
    """Median wall microseconds per call over ``repeats`` batches of ``batch`` calls, ``sync`` before each batch
    (after three untimed calls). With calls whose kernels finish at once, a batch's wall time is host time."""
    for _ in range(3):
        fn()
    per: List[float] = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        per.append((time.perf_counter() - t0) / batch * 1e6)
    sync()
    return statistics.median(per)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def summary(times: List[float]) -> Dict[str, float]:
    """Median, 10th and 90th percentile of step times (ms)."""
    ordered = sorted(times)
    return {"median_ms": statistics.median(times), "p10_ms": ordered[len(times) // 10],
            "p90_ms": ordered[min(len(times) - 1, (len(times) * 9) // 10)]}


def versions() -> Dict[str, str]:
    """torch, diffusers, CUDA, Python, triton, torchpatches (and its git commit where the tree is a checkout), GPU."""
    import diffusers

    import torchpatches

    info = {"torch": torch.__version__, "diffusers": diffusers.__version__, "cuda": str(torch.version.cuda),
            "python": sys.version.split()[0], "torchpatches": torchpatches.__version__}
    commit = _git_commit()
    if commit:
        info["commit"] = commit
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "absent"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _git_commit() -> Optional[str]:
    """The short commit of the checkout this file is in, ``+`` when it has changes; outside a git checkout (a copy
    of the tree sent to a GPU machine) the environment's ``BENCH_COMMIT``, else None."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return os.environ.get("BENCH_COMMIT") or None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("BENCH_COMMIT") or None
    return head.stdout.strip() + ("+" if dirty else "")


def save_json(path: Optional[str], results: Dict[str, Any]) -> None:
    """Rewrite ``path`` with ``results`` (partial results survive a timeout); nothing without a path."""
    if path:
        with open(path, "w") as handle:
            json.dump(results, handle, indent=2)


def compile_once(device: torch.device) -> None:
    """A 3-op ``torch.compile``: afterwards the process is in the state where any compile has run (eager steps were
    measured to enqueue slower there)."""
    torch.compile(lambda x: (x * 2).sin().sum())(torch.ones(4, device=device))


def command_line(argv: Optional[Iterable[str]] = None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join([os.path.basename(sys.argv[0])] + args)


def collect(path: str, sections: Dict[str, str]) -> None:
    """Put JSON files into the per-GPU results file ``path`` (``results/h200.json``), each under its section name
    (the benchmark that wrote it: ``dit``, ``fused_ops``, ...), replacing that section; the other sections stay."""
    results: Dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as handle:
            results = json.load(handle)
    for section, source in sections.items():
        with open(source) as handle:
            results[section] = json.load(handle)
    gpus = {str((data.get("versions") or {}).get("gpu")) for data in results.values() if isinstance(data, dict)}
    gpus.discard("None")
    if len(gpus) > 1:
        raise SystemExit(f"{path}: sections measured on different devices: {sorted(gpus)}")
    with open(path, "w") as handle:
        json.dump(dict(sorted(results.items())), handle, indent=1)
        handle.write("\n")


if __name__ == "__main__":
    # python benchmarks/_bench.py collect results/h200.json dit=dit.json fused_ops=ops.json
    if len(sys.argv) < 4 or sys.argv[1] != "collect" or not all("=" in a for a in sys.argv[3:]):
        sys.exit("usage: python benchmarks/_bench.py collect RESULTS.json SECTION=FILE...")
    collect(sys.argv[2], dict(a.split("=", 1) for a in sys.argv[3:]))
