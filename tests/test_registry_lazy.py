"""Lazy target tables (``LazyTargets``): built at the first import of their module, never before,
and reported correctly before (pending on that module) and after (every target listed)."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Callable, List, Tuple

import pytest

from torchpatches._core import gates as _gates
from torchpatches._core.declare import LazyTargets, Patch, Target
from torchpatches._core.registry import Registry
from torchpatches._core.status import PatchState

GREET = "def greet(name):\n    return 'hello ' + name\n"


def _loud(original):
    def greet(name):
        return original(name).upper()

    return greet


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tuple[str, str]:
    """A package ``pkg`` with a submodule ``pkg.sub`` defining ``greet``; (package name, fingerprint of greet).
    Neither is imported when the test starts."""
    name = f"tp_lazy_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "sub.py").write_text(GREET)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    fingerprint = _gates.fingerprint(importlib.import_module(f"{name}.sub").greet)
    for module in (f"{name}.sub", name):
        sys.modules.pop(module)
    yield name, fingerprint
    for module in (f"{name}.sub", name):
        sys.modules.pop(module, None)


def _lazy_patch(package_name: str, fingerprint: str, builds: List[int]) -> Patch:
    def build() -> Tuple[Target, ...]:
        builds.append(1)
        return (Target(f"{package_name}.sub:greet", _loud, frozenset({fingerprint})),)

    return Patch(name="loud", summary="shout", targets=LazyTargets(package_name, build))


def test_the_table_is_built_at_the_first_import_of_its_module(package) -> None:
    name, fingerprint = package
    builds: List[int] = []
    registry = Registry([_lazy_patch(name, fingerprint, builds)])
    registry.apply()
    before = registry.status()["loud"]
    assert (before.state, before.reason, before.targets) == (PatchState.PENDING, f"waits for {name} to be imported", ())
    assert builds == []

    importlib.import_module(name)  # the table's module: built now; its target's module is not imported yet
    assert builds == [1]
    after = registry.status()["loud"]
    assert after.state is PatchState.PENDING and after.reason == f"waits for {name}.sub to be imported"
    assert [(t.path, t.state) for t in after.targets] == [(f"{name}.sub:greet", PatchState.PENDING)]

    sub = importlib.import_module(f"{name}.sub")
    assert sub.greet("ada") == "HELLO ADA"
    assert registry.status()["loud"].state is PatchState.APPLIED and builds == [1]
    registry.revert()
    assert sub.greet("ada") == "hello ada"


def test_the_table_is_built_at_apply_when_its_module_is_already_imported(package) -> None:
    name, fingerprint = package
    sub = importlib.import_module(f"{name}.sub")
    builds: List[int] = []
    registry = Registry([_lazy_patch(name, fingerprint, builds)])
    assert builds == []  # not by the registry's construction
    registry.apply()
    assert builds == [1] and sub.greet("x") == "HELLO X"


def test_a_patch_that_is_off_lists_its_targets_once_the_module_is_imported(package) -> None:
    name, fingerprint = package
    builds: List[int] = []
    registry = Registry([_lazy_patch(name, fingerprint, builds)])
    registry.revert(reason="disabled by TORCHPATCHES_DISABLE")
    sub = importlib.import_module(f"{name}.sub")
    status = registry.status()["loud"]
    assert status.state is PatchState.DISABLED and status.reason == "disabled by TORCHPATCHES_DISABLE"
    assert [(t.path, t.state, t.reason) for t in status.targets] == [
        (f"{name}.sub:greet", PatchState.DISABLED, "disabled by TORCHPATCHES_DISABLE")]
    assert sub.greet("x") == "hello x"
    registry.apply()
    assert sub.greet("x") == "HELLO X"


@pytest.mark.parametrize("build, says", [
    (lambda: 1 / 0, "its target table did not build: ZeroDivisionError"),
    (lambda: (Target("elsewhere:greet", _loud, frozenset({"0" * 16})),), "must be in"),
    (lambda: (), "needs a tuple of Target objects"),
])
def test_a_table_that_does_not_build_fails_its_patch_not_the_import(package, build: Callable, says: str) -> None:
    name, _ = package
    registry = Registry([Patch(name="loud", summary="shout", targets=LazyTargets(name, build))])
    registry.apply()
    importlib.import_module(f"{name}.sub")  # does not raise
    status = registry.status()["loud"]
    assert status.state is PatchState.FAILED and says in status.reason, status.reason


def test_reading_targets_builds_the_table_once_also_from_two_threads(package) -> None:
    name, fingerprint = package
    builds: List[int] = []
    patch = _lazy_patch(name, fingerprint, builds)
    assert not patch.targets_built
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(patch.targets)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert builds == [1] and patch.targets_built and all(targets is seen[0] for targets in seen)
    assert name not in sys.modules  # building the table imports nothing


@pytest.mark.parametrize("module, build", [("", lambda: ()), ("m:f", lambda: ()), ("m", "not callable")])
def test_lazy_targets_declaration_is_checked(module: str, build) -> None:
    with pytest.raises(ValueError):
        LazyTargets(module, build)


# a fresh process: the lazy table's import order, the same on every torch release
@pytest.mark.once
def test_compile_warnings_table_waits_for_diffusers() -> None:
    """``import torchpatches`` declares compile_warnings without its 71 targets; diffusers' import builds them."""
    pytest.importorskip("diffusers")
    code = """
        import sys
        import torchpatches
        table = "torchpatches.patches.compile_warnings._table"
        status = torchpatches.status()["compile_warnings"]
        print(table in sys.modules, status.state.value, status.reason, len(status.targets), sep="|")
        import diffusers
        status = torchpatches.status()["compile_warnings"]
        print(table in sys.modules, status.state.value, len(status.targets), sep="|")
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TORCHPATCHES_DISABLE": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = result.stdout.strip().splitlines()
    assert before == "False|pending|waits for diffusers to be imported|0"
    assert after == "True|pending|71"


def test_a_target_loaded_while_a_module_it_verifies_is_half_run_applies_when_that_module_finishes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' ``normalization`` imports ``attention_processor`` before it defines ``RMSNorm``: sd3_qk_norm's
    target loads while the code the patch verifies does not exist yet. The patch applies when the verified
    module's body has run (before: it stayed pending until the next ``status()``, and ``applied_names`` missed it)."""
    name = f"tp_verify_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "target.py").write_text(GREET)
    verified = f"from {name} import target  # noqa: F401\n\n\ndef helper():\n    return 1\n"
    (tmp_path / name / "verified.py").write_text(verified)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    modules = (f"{name}.verified", f"{name}.target", name)
    greet_fp = _gates.fingerprint(importlib.import_module(f"{name}.target").greet)
    helper_fp = _gates.fingerprint(importlib.import_module(f"{name}.verified").helper)
    for module in modules:
        sys.modules.pop(module)
    patch = Patch(name="loud", summary="shout", targets=(Target(f"{name}.target:greet", _loud, frozenset({greet_fp})),),
                  verifies={f"{name}.verified:helper": frozenset({helper_fp})})
    registry = Registry([patch])
    registry.apply()
    try:
        importlib.import_module(f"{name}.verified")  # runs target's body first, then defines helper
        assert registry.applied_names() == ("loud",)
        assert sys.modules[f"{name}.target"].greet("ada") == "HELLO ADA"
    finally:
        registry.revert()
        for module in modules:
            sys.modules.pop(module, None)
