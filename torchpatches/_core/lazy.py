"""A module imported at its first use and read from a closure after that: :func:`lazy_module`.

For hot paths that need a module they must not import when they are imported themselves (the Triton tiers import
triton; the ops register ``torch.library`` ops, which a patch module loads only with its target). An ``import``
statement in a function body runs the import system's ``_handle_fromlist`` on every call: about a microsecond of
Python per fused op call, hundreds of calls per step.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

__all__ = ["lazy_module"]


def lazy_module(name: str) -> Callable[[], ModuleType]:
    """A function that returns the module ``name`` (absolute), importing it at its first call."""
    loaded: list = []

    def module() -> ModuleType:
        if not loaded:
            loaded.append(importlib.import_module(name))
        return loaded[0]

    module.__qualname__ = module.__name__ = f"lazy_module({name!r})"
    return module
