"""Fixtures shared by the patch tests: every fused pattern applied, counters of the fused op bodies, and a one-rank
gloo process group for the context-parallel collective patches."""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Iterator

import pytest
import torch
from _fused_models import FUSED, patterns_applied


@pytest.fixture
def fused_on() -> Iterator[None]:
    """Every fused pattern applied for the test; the previous state restored after it."""
    with patterns_applied(FUSED):
        yield


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """How often each fused op body ran (``"<op>"``), and how often with a tensor requiring grad
    (``"<op> with grad"``)."""
    from torchpatches.ops import (
        _modulate as modulate,
        _qk_norm_rope as qk_norm_rope,
        _rms_modulate as rms_modulate,
        _rms_norm_rope as rms_norm_rope,
        _slices as slices,
        _swiglu as swiglu,
    )

    counts: Dict[str, int] = collections.Counter()
    for module in (modulate, qk_norm_rope, swiglu, slices, rms_norm_rope, rms_modulate):
        real = module._impl

        def counting(*args: Any, _real: Callable[..., Any] = real, _name: str = module.__name__, **kwargs: Any):
            name = _name.rsplit(".", 1)[1].lstrip("_")  # the op, not its private module
            counts[name] += 1
            if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                counts[f"{name} with grad"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "_impl", counting)
    return counts


@pytest.fixture(scope="module")
def group() -> Iterator[Any]:
    """The default process group of this process, one gloo rank, for a test module (set up once, torn down after)."""
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - another test left a default group
        pytest.skip("a default process group exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
