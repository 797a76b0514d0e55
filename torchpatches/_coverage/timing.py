"""The watched call timed on a GPU with and without torchpatches, as the project's benchmarks time: warm-up first,
then the two variants alternated A B A B, each call between CUDA events, the median of each."""
from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, Optional

import torch

WARMUP = 2  # calls of each variant before timing (kernel selection, caches, allocator)
ROUNDS = 7  # timed calls of each variant, alternated


def time_call(api: Any, call: Callable[[], Any], device: Optional[torch.device]) -> Dict[str, Any]:
    """``{"eager_ms", "torchpatches_ms", "ratio", "rounds"}`` on CUDA, else ``{"skipped": why}``."""
    if device is None or device.type != "cuda":
        where = "no tensor input" if device is None else f"on {device.type}"
        return {"skipped": f"not timed: {where} (timing needs CUDA)"}
    variants = {"eager": lambda: _disabled(api, call), "torchpatches": call}
    for run in variants.values():
        for _ in range(WARMUP):
            run()
    times: Dict[str, list] = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, run in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize(device)
            times[name].append(start.elapsed_time(end))
    eager, patched = statistics.median(times["eager"]), statistics.median(times["torchpatches"])
    return {"eager_ms": eager, "torchpatches_ms": patched, "ratio": patched / eager, "rounds": ROUNDS}


def _disabled(api: Any, call: Callable[[], Any]) -> Any:
    with api.disabled():
        return call()
