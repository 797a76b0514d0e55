"""What the tests of the torch-fix patches share (aot_compile_builtins, inductor_*; not a test module): whether a
patch applies on the running torch, and that it applies exactly where its target's source is the verified one."""
from __future__ import annotations

import importlib
from typing import Any, Callable

import pytest
import torch

import torchpatches
from torchpatches._core.gates import fingerprint


def applied(name: str, module: str) -> bool:
    """Whether ``name`` is applied once its target's ``module`` is imported (until then it is pending)."""
    importlib.import_module(module)
    return torchpatches.status()[name].state.value == "applied"


def skip_unless_applied(name: str, module: str) -> None:
    if not applied(name, module):
        pytest.skip(f"{name} does not apply on torch {torch.__version__}: {torchpatches.status()[name].reason}")


def assert_gated_by_fingerprint(name: str, module: str, original: Callable[[], Any], verified: str) -> None:
    """Applied exactly where the original (``original()`` read with the patch off) has the ``verified`` fingerprint,
    always on torch 2.11, and skipped with a fingerprint reason elsewhere."""
    with torchpatches.disabled(name):
        matches = fingerprint(original()) == verified
    assert applied(name, module) == matches, torchpatches.status()[name]
    if torch.__version__.startswith("2.11."):
        assert matches
    if not matches:
        assert "fingerprint" in torchpatches.status()[name].reason
