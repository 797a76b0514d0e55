"""Shared fixtures: throwaway modules on sys.path to patch, so registry tests touch nothing real."""
from __future__ import annotations

import importlib
import os
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

# Inductor's start-up costs in every process that first compiles for the CPU (each xdist worker, each child
# process a test starts), on the 2-core CI machine. Children inherit both; a value set in the environment wins.
# - It checks each CPU vector ISA by compiling a probe and loading it in a fresh Python that imports torch
#   (~30 s, half of it skipped here): trust the ISAs the CPU reports for the base check.
# - A pool of compile workers (one per core, each importing torch, ~4 s) compiles nothing faster while both
#   cores run pytest workers: compile in the process.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """Write a module with a unique name under tmp_path; return its name (not imported yet)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created = []

    def make(source: str, prefix: str = "tp_fake") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        created.append(name)
        return name

    yield make
    for name in created:
        sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def _patches_left_as_found() -> Iterator[None]:
    """A test that leaves a patch off (a user's function rebound while ``disabled()`` re-applied: the patch is then
    skipped, correctly) would change what the tests after it in the worker see: the patches applied before a test
    are applied again after it. Only where torchpatches is already imported (a test may need it not to be)."""
    api = sys.modules.get("torchpatches")
    before = _applied(api)
    yield
    api = sys.modules.get("torchpatches")
    if api is not None and before:
        lost = sorted(before - _applied(api))
        if lost:
            api.apply(lost)


def _applied(api: object) -> set:
    if api is None or not hasattr(api, "status"):
        return set()
    return {name for name, entry in api.status().items() if entry.state.value == "applied"}
