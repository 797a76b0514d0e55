"""Applying (at import, at ``importlib.reload(torchpatches)``, on a module load) adopts
or skips; it never raises, whatever verifying a target raises."""
from __future__ import annotations

import importlib
import linecache
from pathlib import Path
from typing import Any, Callable

import pytest

from torchpatches._core import gates as _gates
from torchpatches._core.declare import Patch, Target
from torchpatches._core.registry import PatchState, Registry

SOURCE = 'PREFIX = "hello "\n\ndef greet(name):\n    return PREFIX + name\n'


def _loud(original: Callable[[str], str]) -> Callable[[str], str]:
    return lambda name: original(name).upper()


@pytest.mark.parametrize(
    "edit",
    [
        'PREFIX = "hello "\n\ndef greet(name):\n    """unterminated\n    return PREFIX + name\n',  # tokenize fails
        'PREFIX = "hello "\n\ndef greet(name):\n    return PREFIX + name + "!"\n',  # other code than runs
        "",  # the file emptied
    ],
)
def test_a_target_whose_source_cannot_be_verified_is_skipped(make_module: Callable[..., str], edit: str) -> None:
    name = make_module(SOURCE)
    module = importlib.import_module(name)
    fingerprint = _gates.fingerprint(module.greet)
    Path(module.__file__).write_text(edit)  # edited on disk after import
    linecache.clearcache()
    registry = Registry([Patch(name="loud", summary="t", targets=(Target(f"{name}:greet", _loud, frozenset({fingerprint})),))])
    registry.apply(["loud"])  # must not raise
    assert registry.status()["loud"].state is PatchState.SKIPPED
    assert module.greet("a") == "hello a"  # the original stays


def test_anything_raised_while_locating_skips(make_module: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    name = make_module(SOURCE)
    fingerprint = _gates.fingerprint(importlib.import_module(name).greet)

    def raises(*args: Any) -> str:
        raise _gates.SourceMismatch("as reload(torchpatches) met it for dispatch_attention_fn")

    monkeypatch.setattr("torchpatches._core.slot.marked_original", raises)
    registry = Registry([Patch(name="loud", summary="t", targets=(Target(f"{name}:greet", _loud, frozenset({fingerprint})),))])
    registry.apply(["loud"])
    status = registry.status()["loud"]
    assert status.state is PatchState.SKIPPED and "SourceMismatch" in status.reason
