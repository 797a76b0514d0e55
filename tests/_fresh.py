"""First imports of torchpatches without paying a fresh interpreter for each.

A child process imports torch once (the 4-11 s every fresh process pays on a loaded 2-core machine),
then forks once per case: each fork sets its environment variables and runs its code, so the
``import torchpatches`` in it is a first import that reads the environment, as in a new process.
For import-time behaviour under environment variables and odd ``sys.modules``/``sys.meta_path`` states.
What needs an interpreter of its own (``-W error``, ``-OO``, a module imported before torch) keeps
``subprocess``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]

#: (code, environment changes: name -> value, or None to unset)
Case = Tuple[str, Dict[str, Optional[str]]]


class Result(NamedTuple):
    """What one fork printed and how it ended (the attributes of ``subprocess.CompletedProcess``)."""

    returncode: int
    stdout: str
    stderr: str


_SERVER = textwrap.dedent(
    r"""
    import io, json, os, sys, traceback
    prelude, cases, folder = json.loads(sys.stdin.read())
    exec(prelude, {"__name__": "__prelude__"})
    for index, (code, env) in enumerate(cases):
        pid = os.fork()
        if pid == 0:
            out, err = io.StringIO(), io.StringIO()
            sys.stdout, sys.stderr, status = out, err, 0
            try:
                for name, value in env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                exec(compile(code, "<case %d>" % index, "exec"), {"__name__": "__main__"})
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except BaseException:
                traceback.print_exc()
                status = 1
            with open(os.path.join(folder, "%d.json" % index), "w") as result:
                json.dump([status, out.getvalue(), err.getvalue()], result)
            os._exit(0)
        os.waitpid(pid, 0)
    """
)


def hiding(package: str) -> str:
    """Code that makes ``package`` and its submodules not installed, as far as any import can tell: every
    finder on ``sys.meta_path`` is asked through one that answers None for them (``find_spec`` too)."""
    return textwrap.dedent(
        f"""
        import importlib.abc, sys

        class Without(importlib.abc.MetaPathFinder):
            def __init__(self, finders):
                self.finders = finders
            def find_spec(self, name, path=None, target=None):
                if name == {package!r} or name.startswith({package!r} + "."):
                    return None
                for finder in self.finders:
                    spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
                    if spec is not None:
                        return spec
                return None

        sys.meta_path[:] = [Without(list(sys.meta_path))]
        """
    )


def run_forked(cases: Sequence[Case], folder: Path, prelude: str = "import torch") -> List[Result]:
    """Run each case's code in a fork of one child process that ran ``prelude`` (not importing torchpatches).

    ``folder`` receives one result file per case. The child gets this environment with the repository on
    ``PYTHONPATH`` and ``TORCHPATCHES_DISABLE`` unset; each case sets its own variables.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    env.pop("TORCHPATCHES_DISABLE", None)
    request = json.dumps([textwrap.dedent(prelude), [(textwrap.dedent(code), dict(e)) for code, e in cases],
                          str(folder)])
    server = subprocess.run([sys.executable, "-c", _SERVER], input=request, capture_output=True, text=True,
                            env=env, timeout=900)
    assert server.returncode == 0, server.stderr[-3000:]
    results = []
    for index in range(len(cases)):
        path = folder / f"{index}.json"
        assert path.exists(), f"case {index} left no result (the fork crashed): {server.stderr[-3000:]}"
        results.append(Result(*json.loads(path.read_text())))
    return results
