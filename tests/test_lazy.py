"""``torchpatches._core.lazy``: a module imported at its first use."""
from __future__ import annotations

import pytest


def test_lazy_module_imports_once_at_the_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_lazy.lazy_module``: nothing imported until the first call, then the same module object without another
    import (a hot path's replacement for an ``import`` statement in its body)."""
    import importlib

    from torchpatches._core.lazy import lazy_module

    seen = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: seen.append(name) or real(name))
    get = lazy_module("json")
    assert seen == []
    import json

    assert get() is json and get() is json and seen == ["json"]
