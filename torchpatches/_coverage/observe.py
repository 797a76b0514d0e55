"""The recorder the eager fusion patterns report to while :func:`torchpatches.coverage` watches a call.

Each patched call tells it its outcome (``record``): fused, or handed to diffusers' code with the reason; the
predicates a fused body asks tell it why they said no (``note``), and the last such note before a body gives the
call back is the reason. Nothing is recorded, and nothing costs more than one global read per call, while no
recorder is installed (``_fused_common.observer`` is None).
"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch

from ..patches import _fused_common

#: (pattern, class of the patched object, reason or None when fused)
Key = Tuple[str, str, Optional[str]]


class Recorder:
    """Counts per (pattern, class, reason) and the objects each outcome happened on (by id, not kept alive)."""

    def __init__(self) -> None:
        self.counts: Dict[Key, int] = collections.Counter()
        self.objects: Dict[Key, Set[int]] = collections.defaultdict(set)
        self._notes: List[str] = []
        self._thread = threading.get_ident()

    def note(self, text: str) -> None:
        if threading.get_ident() == self._thread:
            self._notes.append(text)

    def last_note(self) -> Optional[str]:
        return self._notes[-1] if self._notes else None

    @torch.compiler.disable  # under torch.compile: recorded eagerly, beside the graph
    def record(self, pattern: str, owner: Any, reason: Optional[str]) -> None:
        if threading.get_ident() != self._thread:  # another thread's calls are not the watched call
            return
        key = (pattern, type(owner).__name__, reason)
        self.counts[key] += 1
        self.objects[key].add(id(owner))
        self._notes.clear()


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Install a recorder for the block; always removed after it. Not reentrant: one watched call at a time."""
    if _fused_common.observer is not None:
        raise RuntimeError("torchpatches.coverage is already watching a call (it does not nest)")
    recorder = Recorder()
    _fused_common.observer = recorder
    try:
        yield recorder
    finally:
        _fused_common.observer = None
