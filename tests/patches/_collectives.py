"""What the context-parallel collective patches' unit tests share (``test_cp_all_to_all``, ``test_cp_ring_attention``;
their one-rank gloo group is the ``group`` fixture of this folder's conftest): a call counter for a functional
collective, a dispatch mode that passes every op through, a plain tensor subclass."""
from __future__ import annotations

from typing import Any, List

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def counted_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> List[int]:
    """One entry per call of ``owner.<name>`` for the test (the original still runs)."""
    calls: List[int] = []
    real = getattr(owner, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class Sub(torch.Tensor):
    pass
