"""Version gates treat local and dev builds deliberately; fingerprints follow source, not bytecode."""
from __future__ import annotations

import pytest
from packaging.version import Version

from torchpatches._core import gates as _gates


@pytest.mark.parametrize(
    "version, release",
    [
        ("2.11.0", "2.11.0"),
        ("2.11.0+cu130", "2.11.0"),  # PyPI CUDA wheels and the GPU machine
        ("2.11.0a0+git6ddfef5", "2.11.0"),  # NVIDIA containers / source builds
        ("2.12.0.dev20260301+cpu", "2.12.0"),  # nightlies gate as the release they lead to
        ("2.11.1rc2", "2.11.1"),
        ("2.11", "2.11"),
    ],
)
def test_builds_gate_as_their_release(version, release):
    assert _gates.release_version(version) == Version(release)


@pytest.mark.parametrize(
    "installed, verdict",
    [
        ("2.11.0", None),
        ("2.11.0+cu130", None),
        ("2.11.0a0+git6ddfef5", None),
        ("2.11.3", None),
        ("2.10.1", "outside"),
        ("2.12.0.dev20260301", "outside"),
        ("2.13.0+cpu", "outside"),
        (None, "not installed"),
        ("not-a-version", "cannot read"),
    ],
)
def test_check_requirements(monkeypatch, installed, verdict):
    monkeypatch.setattr(_gates, "installed_version", lambda dist: installed)
    reason = _gates.check_requirements({"torch": ">=2.11,<2.12"})
    if verdict is None:
        assert reason is None
    else:
        assert verdict in reason and "torch" in reason


def test_invalid_specifier_is_a_reason_not_a_crash():
    assert "invalid version specifier" in _gates.check_requirements({"torch": "~~2"})


def test_fingerprint_follows_source(make_module):
    import importlib

    first = importlib.import_module(make_module("def f(x):\n    return x + 1\n"))
    same = importlib.import_module(make_module("def f(x):\n    return x + 1\n"))
    other = importlib.import_module(make_module("def f(x):\n    return x + 2\n"))
    assert _gates.fingerprint(first.f) == _gates.fingerprint(same.f)
    assert _gates.fingerprint(first.f) != _gates.fingerprint(other.f)
    assert len(_gates.fingerprint(first.f)) == 16


def test_fingerprint_of_a_decorated_function_covers_the_wrapper_too(make_module):
    import importlib

    def decorated(wrapper_body: str) -> str:
        return (
            "import functools\n"
            "def deco(fn):\n"
            "    @functools.wraps(fn)\n"
            "    def wrapper(*args):\n"
            f"        {wrapper_body}\n"
            "    return wrapper\n"
            "@deco\n"
            "def f(x):\n"
            "    return x + 1\n"
        )

    plain = importlib.import_module(make_module(decorated("return fn(*args)")))
    same = importlib.import_module(make_module(decorated("return fn(*args)")))
    changed_wrapper = importlib.import_module(make_module(decorated("return fn(*args) * 2")))
    assert _gates.fingerprint(plain.f) == _gates.fingerprint(same.f)
    assert _gates.fingerprint(plain.f) != _gates.fingerprint(changed_wrapper.f)
    assert _gates.fingerprint(plain.f) != _gates.fingerprint(plain.f.__wrapped__)


def test_fingerprint_of_builtin_raises_type_error():
    with pytest.raises(TypeError):
        _gates.fingerprint(len)


def test_a_verified_source_is_not_compiled_again_until_its_file_changes(make_module, monkeypatch):
    """``disabled()`` and ``apply()`` fingerprint every target on each switch: the second fingerprint of the same
    running code reuses the first verification; an edit on disk is read and verified again, and fails."""
    import importlib
    import os
    from pathlib import Path

    module = importlib.import_module(make_module("def f(x):\n    return x + 1\n"))
    first = _gates.fingerprint(module.f)
    compiled = []
    real = _gates._compiles_to
    monkeypatch.setattr(_gates, "_compiles_to", lambda *args: compiled.append(args) or real(*args))
    assert _gates.fingerprint(module.f) == first and compiled == []
    path = Path(module.__file__)
    stamp = os.stat(path)
    path.write_text("def f(x):\n    return x + 2\n")
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))
    with pytest.raises(_gates.SourceMismatch):
        _gates.fingerprint(module.f)
    assert len(compiled) == 1
