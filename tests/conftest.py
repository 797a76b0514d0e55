"""Shared fixtures: throwaway modules on sys.path to patch, so registry tests touch nothing real."""
from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Callable

import pytest


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
