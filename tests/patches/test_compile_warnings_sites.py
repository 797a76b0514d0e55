"""Every warning site reachable from a diffusers transformer's forward is patched or deliberately not.

tools/warning_sites.py scans the installed diffusers (AST, from the forward of every class in
``diffusers.models.transformers.*`` through blocks, attention modules, processors and decorators) for
``logger.<method>``, ``warnings.warn``, ``deprecate(`` and ``print`` calls. Each one compiled code reaches
must be a declared site of a ``compile_warnings`` target; each one it does not reach must be in
``_table.NOT_COVERED`` with a reason. A diffusers release that adds a site fails here.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import textwrap
from pathlib import Path
from typing import Dict, Set, Tuple

import pytest

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402,F401  (applies the patches)
from torchpatches._doctor import sites as _sites  # noqa: E402
from torchpatches.patches import compile_warnings  # noqa: E402
from torchpatches.patches.compile_warnings import _table  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "warning_sites", Path(__file__).resolve().parents[2] / "tools" / "warning_sites.py"
)
warning_sites = importlib.util.module_from_spec(_spec)
sys.modules["warning_sites"] = warning_sites  # dataclasses look their module up by name
_spec.loader.exec_module(warning_sites)  # type: ignore[union-attr]

import diffusers  # noqa: E402

DIFFUSERS_ROOT = Path(diffusers.__file__).resolve().parent
# Older releases in the gate (0.40, 0.41) have fewer models; which targets apply there is checked in
# test_compile_warnings. A newer release runs the scan: a site it adds fails here, not in a user's compile.
pytestmark = pytest.mark.skipif(
    tuple(int(part) for part in diffusers.__version__.split(".")[:3] if part.isdigit()) < (0, 42, 1),
    reason=f"the site inventory is of diffusers 0.42.1; {diffusers.__version__} is older",
)


@pytest.fixture(scope="module")
def inventory() -> "warning_sites.Inventory":
    return warning_sites.scan(str(DIFFUSERS_ROOT))


@pytest.fixture(scope="module")
def declared() -> Dict[str, Set[Tuple[str, int]]]:
    """target path -> {(file relative to diffusers, first line of the call)} of the sites it removes.

    Found the way the doctor finds them (torchpatches._doctor.sites), from each declared Site's function and call.
    """
    for target in compile_warnings.PATCH.targets:
        importlib.import_module(target.module)
    root = _sites.normalize_path(str(DIFFUSERS_ROOT))
    found: Dict[str, Set[Tuple[str, int]]] = {}
    for entry in _sites.declared_sites([compile_warnings.PATCH]):
        module, qualname = entry.site.function.split(":", 1)
        path = _sites.normalize_path(sys.modules[module].__file__)
        spans = _sites.calls_in_function(path, qualname, entry.site.call)
        assert spans, f"{entry.target}: no {entry.site.call!r} call in {entry.site.function}"
        relative = os.path.relpath(path, root).replace(os.sep, "/")
        found.setdefault(entry.target, set()).update((relative, first) for first, _ in spans)
    return found


def _module_and_qualname(function: str) -> Tuple[str, str]:
    module, qualname = function.split(":", 1)
    return module, qualname


def test_every_forward_site_is_patched(inventory, declared) -> None:
    missing = [
        f"{site.file}:{site.line} {site.call} in {site.function}"
        for site in inventory.sites
        if (site.file, site.line) not in declared.get(site.function, set())
    ]
    assert not missing, (
        "warning sites reachable from a diffusers transformer's forward that compile_warnings does not patch "
        "(add a target, or list them in NOT_COVERED with a reason):\n  " + "\n  ".join(missing)
    )


def test_every_other_site_is_listed_with_a_reason(inventory) -> None:
    listed = {(_table._module(m), q, call) for m, q, call, why in _table.NOT_COVERED if why}
    missing = [
        f"{site.file}:{site.line} {site.call} in {site.function}"
        for site in inventory.elsewhere
        if (*_module_and_qualname(site.function), site.call) not in listed
    ]
    assert not missing, "sites in transformer modules neither patched nor listed in NOT_COVERED:\n  " + "\n  ".join(missing)


def test_declarations_are_not_stale(inventory, declared) -> None:
    """Every declared target and NOT_COVERED entry is a site the scan finds (nothing left over)."""
    on_forward: Dict[str, Set[Tuple[str, int]]] = {}
    for site in inventory.sites:
        on_forward.setdefault(site.function, set()).add((site.file, site.line))
    stale = [target for target in declared if not on_forward.get(target)]
    assert not stale, f"targets with no reachable site: {stale}"
    extra = {target: sorted(lines - on_forward[target]) for target, lines in declared.items() if lines - on_forward[target]}
    # A declared site line the scan did not list (a decorator's site declared on a forward it does not wrap, say).
    assert not extra, f"declared site lines the scan does not reach: {extra}"
    elsewhere = {(*_module_and_qualname(s.function), s.call) for s in inventory.elsewhere}
    listed = [(_table._module(m), q, call) for m, q, call, _ in _table.NOT_COVERED]
    assert [entry for entry in listed if entry not in elsewhere] == []


def test_inventory_numbers(inventory) -> None:
    """The counts the README and docs quote (diffusers 0.42.1)."""
    lora = [site for site in inventory.sites if site.file == "utils/peft_utils.py"]
    assert len(inventory.sites) == 77 and len(lora) == 40
    assert len({site.function for site in inventory.sites}) == len(compile_warnings.PATCH.targets) == 71
    assert len(inventory.elsewhere) == len(_table.NOT_COVERED) == 8
    assert ("models/transformers/transformer_flux.py", 737) in {(s.file, s.line) for s in inventory.sites}


# ---- the scanner itself can fail ------------------------------------------------------------------------


def _fake_package(tmp_path: Path) -> Path:
    root = tmp_path / "diffusers"
    (root / "models" / "transformers").mkdir(parents=True)
    (root / "utils").mkdir()
    for package in (root, root / "models", root / "models" / "transformers"):
        (package / "__init__.py").write_text("")
    (root / "utils" / "__init__.py").write_text("from .deprecation_utils import deprecate\n")
    (root / "utils" / "deprecation_utils.py").write_text("import warnings\ndef deprecate(*a):\n    warnings.warn('x')\n")
    (root / "models" / "modeling_utils.py").write_text("class ModelMixin:\n    pass\n")
    (root / "models" / "helpers.py").write_text(textwrap.dedent("""
        import logging
        logger = logging.getLogger(__name__)
        def decorate(fn):
            def wrapper(*a):
                logger.warning("in the wrapper")
                return fn(*a)
            return wrapper
        def helper():
            logger.info("reached through a function")
        def unused():
            logger.warning("never called")
    """))
    (root / "models" / "transformers" / "model.py").write_text(textwrap.dedent("""
        import logging
        import torch
        from ..modeling_utils import ModelMixin
        from ..helpers import decorate, helper
        from ...utils import deprecate
        logger = logging.getLogger(__name__)

        class Processor:
            def __call__(self, attn, x):
                deprecate("x", "1.0", "old")
                return x

        class Block:
            def __init__(self):
                self.processor = Processor()
            def forward(self, x):
                return self.processor(self, x)

        class Model(ModelMixin):
            def __init__(self):
                self.block = Block()
                logger.info("construction")
            @decorate
            def forward(self, x):
                if not torch.compiler.is_compiling():
                    logger.warning("eager only")
                self._inner()
                return self.block(x)
            def _inner(self):
                helper()
    """))
    return root


def test_scanner_follows_calls_decorators_and_skips_eager_only_branches(tmp_path: Path) -> None:
    found = warning_sites.scan(str(_fake_package(tmp_path)))
    forward = {(s.file.split("/")[-1], s.call, s.function.split(":")[1]) for s in found.sites}
    assert forward == {
        ("helpers.py", "logger.warning", "Model.forward"),  # the decorator's wrapper, attributed to forward
        ("helpers.py", "logger.info", "helper"),  # self._inner() -> helper()
        ("model.py", "deprecate", "Processor.__call__"),  # the processor the block builds
    }
    elsewhere = {(s.call, s.function.split(":")[1]) for s in found.elsewhere}
    assert elsewhere == {("logger.info", "Model.__init__"), ("logger.warning", "Model.forward")}
