"""A module imported at its first use and read from a closure after that: :func:`lazy_module`; a patch's
replacement code named by ``"module:attribute"`` and imported with its target: :func:`body`.

For hot paths that need a module they must not import when they are imported themselves (the Triton tiers import
triton; the ops register ``torch.library`` ops, which a patch module loads only with its target). An ``import``
statement in a function body runs the import system's ``_handle_fromlist`` on every call: about a microsecond of
Python per fused op call, hundreds of calls per step.
"""
from __future__ import annotations

import importlib
from types import ModuleType
import operator
from typing import Any, Callable, Union

__all__ = ["lazy_module", "body", "resolve", "reference_name"]

#: The attribute on a :func:`body` function that names what it stands for (``"module:attribute"``).
BODY_REFERENCE = "__torchpatches_body__"


def lazy_module(name: str) -> Callable[[], ModuleType]:
    """A function that returns the module ``name`` (absolute), importing it at its first call."""
    loaded: list = []

    def module() -> ModuleType:
        if not loaded:
            loaded.append(importlib.import_module(name))
        return loaded[0]

    module.__qualname__ = module.__name__ = f"lazy_module({name!r})"
    return module


def reference_name(reference: Any) -> str:
    """The last name of a ``"module:attribute"`` reference (``"make"`` of ``"m:Cls.make"``); ValueError when
    ``reference`` is not such a str."""
    if not isinstance(reference, str) or ":" not in reference:
        raise ValueError(f"a body reference must be 'module:attribute', got {reference!r}")
    return reference.rsplit(":", 1)[1].rsplit(".", 1)[-1]


def resolve(reference: Union[str, Callable[..., Any]]) -> Callable[..., Any]:
    """The object a ``"module:attribute"`` reference names (imported now); a callable is returned as it is."""
    if callable(reference):
        return reference
    reference_name(reference)  # the check
    module_name, attribute = reference.split(":", 1)
    return operator.attrgetter(attribute)(importlib.import_module(module_name))


def body(reference: str) -> Callable[..., Any]:
    """A function that calls what ``reference`` (``"module:attribute"``, absolute) names, importing its module at
    the first call. A patch declares its ``make_replacement`` this way so that ``import torchpatches`` compiles no
    replacement code: the registry calls it only when the target's module has loaded."""
    name = reference_name(reference)
    loaded: list = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not loaded:
            loaded.append(resolve(reference))
        return loaded[0](*args, **kwargs)

    call.__qualname__ = call.__name__ = name
    setattr(call, BODY_REFERENCE, reference)
    return call
