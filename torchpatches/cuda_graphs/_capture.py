"""Capturing and replaying one CUDA graph for :mod:`torchpatches.cuda_graphs` (the only code here that needs CUDA).

A backend has a ``device_type`` (the tensors it serves), ``pool(device)`` (a memory pool its graphs share) and
``capture(run, device, pool, warmup)`` -> (replay, output). Tests inject a fake backend with the same three
members, so the wrapper's bookkeeping is tested on the CPU.

The capture follows ``torch.cuda.graphs``' rules: ``warmup`` eager calls on a side stream first (lazy
initialisation -- cuBLAS handles and workspaces, Triton compiles, caches a model builds on its first call --
happens there, outside the graph and its pool), then one call captured into the pool. Anything that raises
while capturing (a host synchronisation such as ``.item()``, a data-dependent shape, pageable host copies of
offloading hooks) is a :class:`CaptureFailed`; what raised during the warm-up is the model's own error.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Tuple

import torch

_log = logging.getLogger("torchpatches")

__all__ = ["CaptureFailed", "CudaBackend"]


class CaptureFailed(RuntimeError):
    """The call ran eagerly but could not be captured; ``__cause__`` is what CUDA or the model raised."""


class CudaBackend:
    """Graphs through ``torch.cuda.CUDAGraph``."""

    device_type = "cuda"

    def pool(self, device: torch.device) -> Any:
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], Any], device: torch.device, pool: Any, warmup: int
                ) -> Tuple[Callable[[], None], Any]:
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    run()  # an error here is the model's: it propagates
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    output = run()
            except Exception as error:  # noqa: BLE001 - any failure while capturing means: run this call eagerly
                torch.cuda.synchronize()  # the failed capture's stream is out of capture mode before we go on
                _end_generator_capture(device)
                raise CaptureFailed(f"{type(error).__name__}: {error}".strip()[:400]) from error
        index = device.index

        def replay() -> None:
            if torch.cuda.current_device() == index:
                graph.replay()  # on the current stream, after the copies into the static inputs
            else:
                with torch.cuda.device(index):
                    graph.replay()

        return replay, output


def _end_generator_capture(device: torch.device) -> None:
    """Put the device's default CUDA generator back out of capture mode after a failed capture.

    ``CUDAGraph.capture_end`` raises on an invalidated capture before it runs the generator's epilogue (torch
    2.11-2.15), so the generator stays "capturing" and every later random op on the device fails with "Offset
    increment outside graph capture encountered unexpectedly". One capture that succeeds runs the prologue and
    epilogue again; a one-element fill keeps the graph non-empty (an empty one warns)."""
    try:
        graph = torch.cuda.CUDAGraph()
        scratch = torch.empty(1, device=device)
        with torch.cuda.graph(graph):
            scratch.fill_(0.0)
    except Exception as error:  # noqa: BLE001 - the capture's own failure is what the caller reports
        _log.debug("cuda_graphs: the generator of %s stays in capture mode: %s", device, error)
