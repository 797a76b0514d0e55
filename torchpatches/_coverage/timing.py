"""The watched call timed on a GPU with and without torchpatches, as the project's benchmarks time: warm-up first,
then the two variants alternated A B A B, each call between CUDA events, the median of each."""
from __future__ import annotations

import contextlib
import statistics
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional

import torch

WARMUP = 2  # calls of each variant before timing (kernel selection, caches, allocator)
ROUNDS = 7  # timed calls of each variant, alternated


def time_call(api: Any, call: Callable[[], Any], device: Optional[torch.device]) -> Dict[str, Any]:
    """``{"eager_ms", "torchpatches_ms", "ratio", "rounds"}`` on CUDA, else ``{"skipped": why}``."""
    if device is None or device.type != "cuda":
        where = "no tensor input" if device is None else f"on {device.type}"
        return {"skipped": f"not timed: {where} (timing needs CUDA)"}
    times = alternate({"eager": api.disabled, "torchpatches": contextlib.nullcontext}, call,
                      lambda: _cuda_ms(call, device))
    eager, patched = statistics.median(times["eager"]), statistics.median(times["torchpatches"])
    return {"eager_ms": eager, "torchpatches_ms": patched, "ratio": patched / eager, "rounds": ROUNDS}


def alternate(states: Mapping[str, Callable[[], ContextManager[Any]]], call: Callable[[], Any],
              timed: Callable[[], float]) -> Dict[str, List[float]]:
    """``timed()`` ROUNDS times in each state, states alternated, after WARMUP calls in each.

    The state is entered before the clock starts and left after it stops: switching every patch off and on
    is host work (reverting and applying each target) that is no part of either variant's call."""
    for state in states.values():
        with state():
            for _ in range(WARMUP):
                call()
    times: Dict[str, List[float]] = {name: [] for name in states}
    for _ in range(ROUNDS):
        for name, state in states.items():
            with state():
                times[name].append(timed())
    return times


def _cuda_ms(call: Callable[[], Any], device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)
