"""``python -m torchpatches`` (the status command) under hostile conditions: ``python -OO``, a
closed stdout, torch not installed.

The doctor's own CLI cases are in test_doctor.py.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _fresh import hiding
from torchpatches import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *flags: str, **kwargs: object) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], env=env, timeout=600, **kwargs)


# ---- docstrings are not text (python -OO strips them) --------------------------------------------------------


def test_no_docstring_is_used_as_text_in_the_package() -> None:
    """``X.__doc__.anything`` / ``__doc__.anything`` crash under -OO, where ``__doc__`` is None."""
    found = []
    for path in sorted((ROOT / "torchpatches").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                inner = node.value
                if (isinstance(inner, ast.Name) and inner.id == "__doc__") or (
                    isinstance(inner, ast.Attribute) and inner.attr == "__doc__"
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_main_without_docstrings(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(cli, "__doc__", None)  # as under python -OO
    assert cli.main(["--json"]) == 0
    assert "rope" in json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        cli.main(["--help"])


@pytest.mark.slow  # -OO compiles torch's and diffusers' bytecode again where no .opt-2.pyc is cached
def test_python_OO_status() -> None:
    done = _python("import runpy, sys; sys.argv = ['x', '--json']; runpy.run_module('torchpatches', run_name='__main__')",
                   "-OO", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rope" in json.loads(done.stdout)


# ---- a closed stdout --------------------------------------------------------------------------------------------


def test_status_json_into_a_closed_pipe_exits_141_quietly() -> None:
    """``python -m torchpatches --json | head -c 10``: no BrokenPipeError traceback, not exit status 1."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        done = _python("import runpy, sys; sys.argv = ['x', '--json']; runpy.run_module('torchpatches', run_name='__main__')",
                       stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert done.returncode == cli.EXIT_BROKEN_PIPE == 141
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


# ---- torch not installed -------------------------------------------------------------------------------------

_WITHOUT_TORCH = hiding("torch") + """
import runpy
sys.argv = ["x", "--json"]
runpy.run_module("torchpatches", run_name="__main__")
"""


def test_without_torch_every_patch_is_skipped_and_the_exit_status_is_0() -> None:
    done = _python(_WITHOUT_TORCH, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    states = {name: entry["state"] for name, entry in json.loads(done.stdout).items()}
    assert set(states.values()) == {"skipped"}, states
    assert all("torch is not installed" in entry["reason"] for entry in json.loads(done.stdout).values())
