"""Importing torchpatches never crashes, whatever the environment does to an import-time
shim, and each odd situation gives a clear state and a true reason (or a clear ValueError for a
wrong argument to the API)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Callable, Dict

import pytest

import torchpatches
from torchpatches._core import gates as _gates
from torchpatches._core.declare import Patch, Target
from torchpatches._core.registry import PatchState, Registry

from _fresh import Result, run_forked

REPO = Path(__file__).resolve().parents[1]
GREET = "def greet(name):\n    return 'hello ' + name\n"


def _run(code: str, *python_flags: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_vars)
    return subprocess.run([sys.executable, *python_flags, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def first_imports(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Result]:
    """The cases below that need a first ``import torchpatches`` but no interpreter flag: forks of one child."""
    cases = {
        "filterwarnings error": (_FILTERWARNINGS_ERROR, {"TORCHPATCHES_DISABLE": "rope,bogus_name"}),
        "policy finder": (_POLICY_FINDER, {}),
        **{f"stub {kind}": (_STUBBED_DIFFUSERS, {"TP_STUB_KIND": kind}) for kind in STUB_KINDS},
        "builtin loaders": (_BUILTIN_LOADERS, {}),
    }
    return dict(zip(cases, run_forked(list(cases.values()), tmp_path_factory.mktemp("first-imports"))))


def _loud(original: Callable[[str], str]) -> Callable[[str], str]:
    def greet(name: str) -> str:
        return original(name).upper()

    return greet


def _patch(path: str, fingerprint: str, **extra) -> Patch:
    return Patch(name="loud", summary="test", targets=(Target(path, _loud, frozenset({fingerprint})),), **extra)


# ---- warnings as errors -----------------------------------------------------------------------


def test_unknown_disable_name_under_warnings_as_errors_does_not_break_import() -> None:
    result = _run(
        """
        import logging, torchpatches
        print(sorted(state.state.value for state in torchpatches.status().values()) != [])
        """,
        "-W", "error", TORCHPATCHES_DISABLE="rope,bogus_name",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True"]
    assert "bogus_name" in result.stderr  # still said, through the logger, when warnings raise


_FILTERWARNINGS_ERROR = """
    import warnings
    warnings.simplefilter("error")   # what pytest's filterwarnings = error does
    import torchpatches
    print(torchpatches.status()["rope"].state.value)
"""


def test_unknown_disable_name_under_pytest_filterwarnings_error(first_imports: Dict[str, Result]) -> None:
    result = first_imports["filterwarnings error"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["disabled"]


# ---- import-policy finders ----------------------------------------------------------------------


_POLICY_FINDER = """
    import sys
    import torch  # torch >= 2.15 asks for triton while it imports: a policy blocking it breaks torch itself
    class Policy:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("diffusers", "triton", "flashinfer"):
                raise PermissionError("blocked by policy: " + name)
            return None
    sys.meta_path.insert(0, Policy())
    import torchpatches
    status = torchpatches.status()
    print(status["rope"].state.value, "|", status["rope"].reason)
"""


def test_a_finder_that_raises_something_other_than_import_error(first_imports: Dict[str, Result]) -> None:
    result = first_imports["policy finder"]
    assert result.returncode == 0, result.stderr[-3000:]
    state, reason = result.stdout.strip().split(" | ")
    assert state == "skipped"
    assert "PermissionError" in reason and "blocked by policy" in reason


# ---- zips, late installs, stubs ---------------------------------------------------------------


def test_target_imported_from_a_zip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / "bundle.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("tp_zipped/__init__.py", "")
        zf.writestr("tp_zipped/mod.py", GREET)
    monkeypatch.syspath_prepend(str(archive))
    module = importlib.import_module("tp_zipped.mod")
    original = module.greet
    fingerprint = _gates.fingerprint(original)
    for name in ("tp_zipped.mod", "tp_zipped"):
        del sys.modules[name]
    registry = Registry([_patch("tp_zipped.mod:greet", fingerprint)])
    registry.apply()
    assert registry.status()["loud"].state is PatchState.PENDING
    module = importlib.import_module("tp_zipped.mod")  # through zipimport, hooked
    try:
        assert module.greet("a") == "HELLO A"
        assert registry.status()["loud"].state is PatchState.APPLIED
        registry.revert()
        assert module.greet("a") == "hello a"
    finally:
        for name in ("tp_zipped.mod", "tp_zipped"):
            sys.modules.pop(name, None)


def test_package_installed_after_torchpatches_was_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    package = "tp_late_pkg"
    registry = Registry([_patch(f"{package}.mod:greet", _fingerprint_of_greet(tmp_path),
                                requires={package: ">=1.0"})])
    registry.apply()
    status = registry.status()["loud"]
    assert status.state is PatchState.SKIPPED and "not installed" in status.reason
    # "pip install" while the process runs
    (site / package).mkdir()
    (site / package / "__init__.py").write_text("__version__ = '1.2'\n")
    (site / package / "mod.py").write_text(GREET)
    importlib.invalidate_caches()
    try:
        assert "not installed" not in registry.status()["loud"].reason
        module = importlib.import_module(f"{package}.mod")
        assert module.greet("a") == "HELLO A"
        assert registry.status()["loud"].state is PatchState.APPLIED
        registry.revert()
    finally:
        for name in (f"{package}.mod", package):
            sys.modules.pop(name, None)


def _fingerprint_of_greet(tmp_path: Path) -> str:
    """The fingerprint GREET has in any module (it hashes the function's source)."""
    path = tmp_path / "tp_greet_source.py"
    path.write_text(GREET)
    spec = importlib.util.spec_from_file_location("tp_greet_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _gates.fingerprint(module.greet)


def test_target_module_put_in_sys_modules_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stub inserted into sys.modules never goes through the import system: still no false 'pending'."""
    import types

    stub = types.ModuleType("tp_stubbed")
    stub.greet = lambda name: "stub"  # type: ignore[attr-defined]
    registry = Registry([_patch("tp_stubbed:greet", "0" * 16)])
    registry.apply()
    monkeypatch.setitem(sys.modules, "tp_stubbed", stub)
    status = registry.status()["loud"]
    assert status.state is PatchState.SKIPPED, status
    assert "tp_stubbed:greet" in status.reason


_STUBBED_DIFFUSERS = """
    import os, sys, types, unittest.mock
    kind = os.environ['TP_STUB_KIND']
    if kind == "magicmock":
        for name in ("diffusers", "diffusers.models", "diffusers.models.embeddings"):
            sys.modules[name] = unittest.mock.MagicMock(name=name)
    elif kind == "lazy_getattr_raises":
        class Lazy(types.ModuleType):  # like diffusers' _LazyModule when a submodule fails to import
            def __getattr__(self, attribute):
                if attribute.startswith("__"):
                    raise AttributeError(attribute)
                raise RuntimeError("lazy import of " + attribute + " failed")
        for name in ("diffusers", "diffusers.models", "diffusers.models.embeddings"):
            sys.modules[name] = Lazy(name)
    else:
        for name in ("diffusers", "diffusers.models", "diffusers.models.embeddings"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["diffusers.models.embeddings"].apply_rotary_emb = lambda *a, **k: None
    import torchpatches
    status = torchpatches.status()["rope"]
    print(status.state.value, "|", status.reason)
"""
STUB_KINDS = ["magicmock", "lazy_getattr_raises", "types_stub"]


@pytest.mark.parametrize("kind", STUB_KINDS)
def test_stubbed_diffusers_modules(kind: str, first_imports: Dict[str, Result]) -> None:
    result = first_imports[f"stub {kind}"]
    assert result.returncode == 0, result.stderr[-3000:]
    state, reason = result.stdout.strip().split(" | ")
    assert state == "skipped", reason
    assert "diffusers" in reason


@pytest.mark.once  # -OO recompiles torch's and diffusers' bytecode (no .opt-2.pyc yet): 15-28 s
def test_optimized_and_stripped_docstrings() -> None:
    result = _run(
        """
        import torchpatches
        import diffusers.models.embeddings as emb
        import diffusers.models.transformers.transformer_flux
        original = emb.apply_rotary_emb.__torchpatches_original__
        status = torchpatches.status()
        print("TP", status["rope"].state.value, status["compile_warnings"].state.value)
        torchpatches.revert()
        print("TP", emb.apply_rotary_emb is original)
        """,
        "-OO",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Only our lines: an installed transformers 5.x prints "[ERROR] ... not documented" to stdout under -OO.
    ours = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("TP ")]
    assert ours == [["applied", "applied"], ["True"]], result.stdout[-3000:]


# ---- wrong argument types to the API ----------------------------------------------------------


@pytest.mark.parametrize("bad", [123, b"rope", ["rope", None], [["rope"]], 1.5, "", "  ", object()])
@pytest.mark.parametrize("call", ["apply", "revert"])
def test_wrong_argument_types_raise_a_clear_value_error(call: str, bad: object) -> None:
    before = {name: entry.state for name, entry in torchpatches.status().items()}
    with pytest.raises(ValueError, match="patch name"):
        getattr(torchpatches, call)(bad)
    assert {name: entry.state for name, entry in torchpatches.status().items()} == before


@pytest.mark.parametrize("bad", [123, b"rope", None, ""])
def test_wrong_argument_types_to_disabled(bad: object) -> None:
    with pytest.raises(ValueError, match="patch name"):
        with torchpatches.disabled(bad):  # type: ignore[arg-type]
            pass


def test_disabled_accepts_a_list_like_apply_and_revert() -> None:
    before = torchpatches.status()["rope"].state
    with torchpatches.disabled(["rope"]):  # type: ignore[arg-type]
        assert torchpatches.status()["rope"].state.value == "disabled"
    assert torchpatches.status()["rope"].state is before


# ---- wrong argument types to the declaration API (torchpatches.Patch / Target) -----------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: Target(123, _loud, frozenset({"0" * 16})),
        lambda: Target("m:f", "not callable", frozenset({"0" * 16})),
        lambda: Target("m:f", _loud, "0123456789abcdef"),  # a bare str would become a set of characters
        lambda: Target("m:f", _loud, frozenset({"0" * 16}), aliases="m2:f"),
        lambda: Target("m:f", _loud, frozenset({1})),
        lambda: Patch(name=None, summary="", targets=(Target("m:f", _loud, frozenset({"0" * 16})),)),
        lambda: Patch(name="p", summary="", targets=("m:f",)),
        lambda: Patch(name="p", summary="", targets=(Target("m:f", _loud, frozenset({"0" * 16})),),
                      requires={"torch": 2.11}),
        lambda: Patch(name="p", summary="", targets=(Target("m:f", _loud, frozenset({"0" * 16})),),
                      verifies={"m:g": "0123456789abcdef"}),
    ],
)
def test_declarations_with_wrong_types_raise_value_error(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


_BUILTIN_LOADERS = """
    import sys, importlib.machinery as m
    from torchpatches._core.import_hooks import when_imported
    names = [n for n in sys.builtin_module_names if n not in sys.modules and not n.startswith("_frozen")]
    name = names[0]
    before = m.BuiltinImporter.__dict__["exec_module"]
    seen = []
    when_imported(name, seen.append)
    __import__(name)
    print(m.BuiltinImporter.__dict__["exec_module"] is before, name in sys.modules)
"""


def test_builtin_module_loaders_are_never_hooked(first_imports: Dict[str, Result]) -> None:
    """BuiltinImporter is a class used as a loader: hooking it would change every builtin import."""
    result = first_imports["builtin loaders"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True"]
