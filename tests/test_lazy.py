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


def test_body_imports_its_module_at_the_first_call_and_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """``body("module:attribute")``: a ``make_replacement`` that imports nothing until the registry calls it, then
    calls what the reference names with the same arguments (a dotted attribute walks into a class)."""
    import importlib

    from torchpatches._core.lazy import BODY_REFERENCE, body

    seen = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: seen.append(name) or real(name))
    dumps = body("json:dumps")
    decode = body("json:JSONDecoder.decode")
    assert seen == [] and getattr(dumps, BODY_REFERENCE) == "json:dumps" and dumps.__name__ == "dumps"
    assert dumps([1], separators=(",", ":")) == "[1]" and dumps({}) == "{}" and seen == ["json"]
    import json

    assert decode(json.JSONDecoder(), "[2]") == [2]


@pytest.mark.parametrize("reference", ["json.dumps", "", None, 3, ("json", "dumps")])
def test_body_refuses_what_is_not_a_module_attribute_reference(reference: object) -> None:
    from torchpatches._core.lazy import body, resolve

    with pytest.raises(ValueError, match="module:attribute"):
        body(reference)  # type: ignore[arg-type]
    if not callable(reference):
        with pytest.raises(ValueError, match="module:attribute"):
            resolve(reference)  # type: ignore[arg-type]


def test_every_declared_body_reference_names_a_callable() -> None:
    """A patch declares its replacement code by reference (``body()`` or a fused pattern's ``"module:attribute"``);
    a typo there would surface only when the target's module loads. Each reference resolves to a callable, in
    ``torchpatches.patches._bodies`` under the patch's own name."""
    import importlib

    from torchpatches._core.lazy import BODY_REFERENCE, resolve
    from torchpatches.patches import PATCH_MODULES

    seen = 0
    for name in PATCH_MODULES:
        for target in importlib.import_module(f"torchpatches.patches.{name}").PATCH.targets:
            reference = getattr(target.make_replacement, BODY_REFERENCE, None)
            if reference is None:
                continue
            seen += 1
            assert reference.split(":", 1)[0] == f"torchpatches.patches._bodies.{name}", (name, reference)
            assert callable(resolve(reference)), (name, reference)
    assert seen >= 20
