"""``python -m torchpatches doctor SCRIPT``: each run of the script in its own child process.

A script changes the process it runs in: it reads stdin to its end, ``os.chdir``s, edits ``sys.argv``,
``sys.path``, ``os.environ``, module globals, registers ``atexit`` handlers, starts workers. Three runs
in one process would leak all of that from one run into the next, so each run (without torchpatches,
with it, the fullgraph trial) is a fresh interpreter started as ``python SCRIPT ARGS`` would be: the
same interpreter and flags (``-O``, ``-X``...), working directory, environment and arguments, the
script as ``__main__`` with ``sys.path[0]`` its directory. Measured cost: one interpreter start and
``import torch`` per run (the script pays those under ``python`` too).

- stdin is read once and replayed: every run reads the same bytes, the ones an earlier run read first
  and then the rest of the stream (read only as a run asks for it, so an endless stream does not stall
  the doctor). An interactive terminal is passed to each run as it is: the script asks again each run.
- With ``--json`` every run's file descriptor 1 is the doctor's stderr, so nothing the script or the
  processes it starts write (``print``, ``sys.__stdout__``, ``os.write(1, ...)``, ``os.system``,
  workers, ``atexit`` handlers) reaches the doctor's stdout, which carries the report alone.
- Results come back through a file in a private temporary directory (pickled: same interpreter, same
  package), never through the script's streams. A run that ends its process itself (``os._exit``, a
  signal) is reported as a failed run.

The run without torchpatches sets ``TORCHPATCHES_DISABLE=all`` in its environment, so processes the
script starts are unpatched too.
"""
from __future__ import annotations

import os
import pickle
import runpy
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Dict, IO, List, Optional, Sequence, Union

from . import diagnose as _doctor
from .capture import Capture, in_progress
from .report import DoctorReport

__all__ = ["diagnose_script", "script_workload", "child_main", "StdinReplay"]

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above torchpatches/

# The child's program: import torchpatches from where this process found it, then hand over. The
# package's directory leaves sys.path again, so the script sees the sys.path `python SCRIPT` gives it.
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, {root!r}); import torchpatches; "
    "from torchpatches._doctor import script as _doctor_script; "
    "sys.path.remove({root!r}); _doctor_script.child_main(torchpatches, sys.argv[1:])"
)


def script_workload(path: str, argv: Sequence[str]) -> Callable[[], Any]:
    """A workload that runs ``path`` as ``__main__`` with ``argv``, as ``python path argv...`` would
    (``sys.argv[0]`` as given, ``__file__`` absolute, ``sys.path[0]`` the script's directory)."""
    absolute = os.path.abspath(path)

    def run() -> Any:
        sys.argv = [path, *argv]
        if getattr(sys.flags, "safe_path", False):
            pass  # python -P: neither the script's directory nor -c's "" goes first
        elif sys.path:
            sys.path[0] = os.path.dirname(absolute)
        else:
            sys.path.insert(0, os.path.dirname(absolute))
        runpy.run_path(absolute, run_name="__main__")

    return run


# ---- the child ----------------------------------------------------------------------------------


def _dump(path: str, value: Any) -> None:
    with open(path, "wb") as handle:
        pickle.dump(value, handle)


def _load(path: str) -> Any:
    with open(path, "rb") as handle:
        return pickle.load(handle)


def child_main(api: Any, argv: List[str]) -> None:
    """One run: ``MODE RESULT BASELINE SCRIPT ARGS...`` (BASELINE: the result file of the run without
    torchpatches, or ""); writes its result to RESULT before the script's ``atexit`` handlers run."""
    mode, result, baseline, script, *args = argv
    workload = script_workload(script, args)
    errors: _doctor.Errors = {}
    applied: List[str] = []
    before = _load(baseline) if baseline else {"capture": None, "errors": {}, "applied": []}

    def finish(captured: Optional[Capture], trial: Optional[_doctor.Trial] = None) -> None:
        captured = captured if captured is not None else Capture()
        if mode == "without_patches":
            _dump(result, {"capture": captured, "errors": errors, "applied": applied})
        elif mode == "with_patches":
            _dump(result, _doctor.build_report(api, script, before["capture"], captured,
                                               {**before["errors"], **errors}, before["applied"]))
        else:
            _dump(result, trial or _doctor.Trial(captured, errors.get("fullgraph", "")))

    _finish_on_os_exit(finish, errors, mode)
    if mode == "without_patches":
        finish(_doctor.run_unpatched(api, workload, errors, applied)[0])
    elif mode == "with_patches":
        finish(_doctor.run(workload, errors, "with_patches"))
    else:
        finish(None, _doctor.fullgraph_trial(workload))


def _finish_on_os_exit(finish: Callable[[Optional[Capture]], None], errors: _doctor.Errors, mode: str) -> None:
    """A script that ends with ``os._exit(n)`` (skipping teardown) still has its run reported: the result is
    written from the capture in progress, then this process ends as the script asked. Not in processes
    forked from it (multiprocessing's workers end with ``os._exit`` too)."""
    real_exit, pid = os._exit, os.getpid()

    def _exit(code: int) -> None:
        if os.getpid() == pid:
            os._exit = real_exit
            try:
                if code:
                    errors.setdefault(mode, f"os._exit({code})")
                finish(in_progress())
            except BaseException:  # noqa: BLE001 - the script asked to end now: it ends
                pass
        real_exit(code)

    os._exit = _exit


# ---- stdin ----------------------------------------------------------------------------------------


class StdinReplay:
    """Feeds each run's stdin pipe the same stream: what was read from the source so far, then more of it.

    ``source`` is a file descriptor (read on demand, by one run's feeder at a time) or bytes.
    """

    def __init__(self, source: Union[int, bytes]) -> None:
        self._fd = source if isinstance(source, int) else None
        self._data = bytearray(b"" if isinstance(source, int) else source)
        self._eof = not isinstance(source, int)
        self._reading = False
        self._cond = threading.Condition()

    def feed(self, pipe: IO[bytes]) -> None:
        threading.Thread(target=self._pump, args=(pipe,), name="torchpatches-doctor-stdin", daemon=True).start()

    def _next(self, position: int) -> Optional[bytes]:
        """Bytes after ``position`` (reading the source if none are buffered); None at the end."""
        with self._cond:
            while position == len(self._data) and not self._eof and self._reading:
                self._cond.wait()
            if position < len(self._data) or self._eof:
                return bytes(self._data[position:]) or None
            self._reading = True
        try:
            chunk = os.read(self._fd, 65536)  # type: ignore[arg-type]
        except OSError:
            chunk = b""
        with self._cond:
            self._reading = False
            self._data += chunk
            self._eof = self._eof or not chunk
            self._cond.notify_all()
        return chunk or None

    def _pump(self, pipe: IO[bytes]) -> None:
        position = 0
        try:
            while True:
                data = self._next(position)
                if data is None:
                    break
                pipe.write(data)
                pipe.flush()
                position += len(data)
        except (OSError, ValueError):  # the run ended (or closed its stdin) before reading it all
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass


def _stdin_source() -> Optional[Union[int, bytes]]:
    """fd 0 to replay, or None to pass it as it is (a terminal) -- or bytes when fd 0 is not open."""
    try:
        os.fstat(0)
    except OSError:
        return b""
    return None if os.isatty(0) else 0


# ---- the parent -----------------------------------------------------------------------------------


def _stdout_fd(json_mode: bool) -> Optional[int]:
    if not json_mode:
        return None
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def _spawn(mode: str, result: str, baseline: str, script: str, args: Sequence[str], *, stdout: Optional[int],
           replay: Optional[StdinReplay]) -> Optional[str]:
    """Run one child; None when it wrote its result, else why it did not."""
    env = dict(os.environ)
    if mode == "without_patches":
        env["TORCHPATCHES_DISABLE"] = "all"
    # -O, -X, -W... as this interpreter was started (what multiprocessing's spawn passes on too)
    flags = getattr(subprocess, "_args_from_interpreter_flags", list)()
    command = [sys.executable, *flags, "-c", _BOOTSTRAP.format(root=_PACKAGE_PARENT), mode, result, baseline, script,
               *args]
    process = subprocess.Popen(command, env=env, stdout=stdout, stdin=subprocess.PIPE if replay else None)
    if replay is not None:
        replay.feed(process.stdin)  # type: ignore[arg-type]
    code = process.wait()
    if os.path.exists(result):
        return None
    return (f"the run ended its process before the doctor could read its result (exit status {code}: "
            "os._exit(), a signal, or a crash)")


def diagnose_script(api: Any, script: str, args: Sequence[str], *, json_mode: bool = False, baseline: bool = True,
                    fullgraph: bool = True, stdin: Optional[Union[int, bytes]] = -1) -> DoctorReport:
    """The doctor for a script, each run in a child process. ``stdin``: -1 for this process's stdin,
    bytes to replay, or None to pass fd 0 through."""
    source = _stdin_source() if stdin == -1 else stdin
    replay = StdinReplay(source) if source is not None else None
    stdout = _stdout_fd(json_mode)
    with tempfile.TemporaryDirectory(prefix="torchpatches-doctor-") as tmp:
        results: Dict[str, str] = {mode: os.path.join(tmp, mode) for mode in ("without_patches", "with_patches", "fullgraph")}
        errors: _doctor.Errors = {}

        def spawn(mode: str, baseline_file: str = "") -> Optional[Any]:
            failed = _spawn(mode, results[mode], baseline_file, script, args, stdout=stdout, replay=replay)
            if failed is None:
                try:
                    return _load(results[mode])
                except Exception as error:  # noqa: BLE001 - the script may have broken what pickle needs
                    failed = f"its result could not be read ({_doctor.error_text(error)})"
            errors[mode] = failed
            return None

        before = spawn("without_patches") if baseline else None
        report = spawn("with_patches", results["without_patches"] if before is not None else "")
        if report is None:
            report = _doctor.build_report(api, script, before["capture"] if before else None, Capture(),
                                          {**(before or {}).get("errors", {}), **errors},
                                          before["applied"] if before else [])
        if baseline and before is None:
            report.errors.setdefault("without_patches", errors.get("without_patches", ""))
            report.notes.append("no baseline: the run without torchpatches gave no result")
        trial = spawn("fullgraph") if fullgraph else None
        if fullgraph and trial is None:
            trial = _doctor.Trial(error=errors["fullgraph"])
    _doctor.judge_fullgraph(report, trial)
    return report
