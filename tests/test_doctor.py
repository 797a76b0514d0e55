"""torchpatches.doctor and `python -m torchpatches doctor`: graph breaks mapped to patches, recompiles, fullgraph.

The FLUX.1 case is ground truth: the doctor runs the model with every patch reverted and with them applied,
and must find exactly the two breaks compile_warnings removes.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

import torchpatches
from torchpatches._doctor import capture as _capture, diagnose as _doctor, rows as _doctor_rows
from torchpatches import testing
from torchpatches._core.declare import Site
from torchpatches._doctor.sites import DeclaredSite

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(__file__).read_text().splitlines()


def _line_of(marker: str) -> int:
    return next(n for n, line in enumerate(SOURCE, 1) if line.rstrip().endswith(f"# {marker}"))


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in ("diffusers", "torch._dynamo")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)
    torch._dynamo.reset()


class ItemBranch(torch.nn.Module):
    """A user-written data-dependent branch: a graph break no patch covers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum().item() > 0:  # ITEM
            y = y * 2
        return y.relu()


class Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # FORWARD
        return self.lin(x).relu()


def _decorate(forward: Any) -> Any:
    @functools.wraps(forward)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:  # as diffusers' @apply_lora_scale wraps forwards
        return forward(self, *args, **kwargs)

    return wrapper


class Decorated(Plain):
    @_decorate  # DECORATED
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def _row_keys(rows: List[Dict[str, Any]]) -> List[Tuple[Any, ...]]:
    return sorted((Path(r["file"]).name, r["line"], r["reason"], r["status"], r["fixed_by"]) for r in rows)


# ---- FLUX.1 with 3-D ids: two breaks, both fixed by compile_warnings ------------------------------------------


@pytest.fixture(scope="module")
def flux_report() -> "_doctor.DoctorReport":
    pytest.importorskip("diffusers")
    with torch.no_grad():
        report = torchpatches.doctor(testing.build_model("flux1"), **testing.tiny_inputs("flux1", ids_3d=True))
    torch._dynamo.reset()
    return report


def test_flux_3d_ids_two_breaks_both_fixed(flux_report: "_doctor.DoctorReport") -> None:
    rows = [(Path(r.file).name, r.line, r.status, r.fixed_by) for r in flux_report.breaks]
    assert rows == [
        ("transformer_flux.py", 737, "fixed", "compile_warnings"),
        ("transformer_flux.py", 743, "fixed", "compile_warnings"),
    ]
    assert {r.reason for r in flux_report.breaks} == {"logging.Logger method not supported for non-export cases"}
    assert {r.function for r in flux_report.breaks} == {"FluxTransformer2DModel.forward"}
    assert flux_report.remaining == [] and flux_report.exit_code == 0
    assert flux_report.fullgraph_ok is True
    assert flux_report.graphs == {"without_patches": 3, "with_patches": 1}
    assert flux_report.recompiles == []


def test_flux_report_json_schema(flux_report: "_doctor.DoctorReport") -> None:
    data = json.loads(json.dumps(flux_report.to_json()))
    assert data["schema"] == "torchpatches.doctor/2"
    assert {"breaks", "recompiles", "fullgraph_ok", "patches", "graphs", "exit_code"} <= set(data)
    assert (data["verdict"], data["not_judged"], data["fullgraph_why"], data["applied_by_workload"]) == ("clean", "", "", [])
    for row in data["breaks"]:
        assert {"file", "line", "reason", "fixed_by", "status", "function", "stack"} <= set(row)
    assert data["patches"]["compile_warnings"]["state"] == "applied"


def test_flux_table_names_the_patch(flux_report: "_doctor.DoctorReport") -> None:
    text = str(flux_report)
    assert "transformer_flux.py:737" in text and "fixed by compile_warnings" in text
    assert "fullgraph=True: compiles (tried)" in text
    # the status table is part of the report (its name column is as wide as the longest patch name)
    assert re.search(r"^compile_warnings +applied", text, re.MULTILINE)


def test_flux_fixable_when_the_patch_is_disabled() -> None:
    pytest.importorskip("diffusers")
    with torch.no_grad(), torchpatches.disabled("compile_warnings"):
        report = torchpatches.doctor(testing.build_model("flux1"), **testing.tiny_inputs("flux1", ids_3d=True))
        assert torchpatches.status()["compile_warnings"].state.value == "disabled"  # the doctor left it off
    assert [(r.line, r.status, r.fixable_by) for r in report.breaks] == [
        (737, "fixable", "compile_warnings"), (743, "fixable", "compile_warnings"),
    ]
    assert all("disabled" in r.why for r in report.breaks)
    assert report.exit_code == 1 and report.fullgraph_ok is False


# ---- a user's own break, not covered ----------------------------------------------------------------------


def test_item_branch_is_open_with_a_hint() -> None:
    report = torchpatches.doctor(ItemBranch(), torch.ones(2, 4))
    assert [(os.path.realpath(r.file), r.line, r.status, r.fixed_by) for r in report.breaks] == [
        (os.path.realpath(__file__), _line_of("ITEM"), "open", None)
    ]
    row = report.breaks[0]
    assert "item()" in row.reason and row.function == "ItemBranch.forward"
    assert "capture_scalar_outputs" in row.hint
    assert report.fullgraph_ok is False and report.fullgraph_error
    assert report.exit_code == 1
    assert "hint for" in str(report)


# ---- recompiles -------------------------------------------------------------------------------------------


def test_recompile_on_a_new_batch_size() -> None:
    compiled = torch.compile(Plain(), backend="eager")

    def workload() -> None:
        compiled(torch.randn(1, 4))
        compiled(torch.randn(3, 4))

    report = torchpatches.doctor(workload)
    assert len(report.recompiles) == 1
    row = report.recompiles[0]
    assert (os.path.realpath(row.file), row.line) == (os.path.realpath(__file__), _line_of("FORWARD"))
    assert row.function == "Plain.forward"
    assert "size mismatch at index 0" in row.reason and "expected 1, actual 3" in row.reason
    assert "mark_dynamic" in row.remedy and "dynamic=True" in row.remedy
    assert report.breaks == [] and report.exit_code == 0 and report.fullgraph_ok is True


@pytest.mark.parametrize("how", ["module", "method"])
def test_recompile_of_a_decorated_forward_names_the_forward(how: str) -> None:
    model = Decorated()
    compiled = torch.compile(model, backend="eager") if how == "module" else torch.compile(model.forward, backend="eager")

    def workload() -> None:
        compiled(torch.randn(1, 4))
        compiled(torch.randn(3, 4))

    [row] = torchpatches.doctor(workload).recompiles
    assert (row.function, os.path.realpath(row.file), row.line) == (
        "Decorated.forward", os.path.realpath(__file__), _line_of("DECORATED")
    )


def test_marked_dynamic_does_not_recompile() -> None:
    compiled = torch.compile(Plain(), backend="eager")

    def workload() -> None:
        first = torch.randn(2, 4)  # not 1: Dynamo specializes sizes 0 and 1 even when marked
        torch._dynamo.mark_dynamic(first, 0)
        compiled(first)
        compiled(torch.randn(3, 4))

    assert torchpatches.doctor(workload).recompiles == []


# ---- the CLI agrees with the API --------------------------------------------------------------------------
# End to end (a `python -m torchpatches` process): the FLUX case (slow) and the hostile script below. The other
# CLI cases call main(argv) in this process; each run of a script is still a child process of its own.


def _cli(*args: str, cwd: Path, env: Any = None, **kwargs: Any) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "torchpatches", "doctor", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600, **kwargs,
    )


def _main(capsys: pytest.CaptureFixture, *argv: str) -> Tuple[int, str, str]:
    """``python -m torchpatches doctor ARGV`` in this process: (exit status, stdout, stderr)."""
    from torchpatches.__main__ import main

    try:
        code = main(["doctor", *argv])
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


# the CLI's process plumbing (fresh Pythons, files, exit codes), the same on every torch release; what
# Dynamo reports per release is the in-process doctor tests' subject
@pytest.mark.once
@pytest.mark.slow
def test_cli_and_api_agree_on_flux(tmp_path: Path, flux_report: "_doctor.DoctorReport") -> None:
    script = tmp_path / "flux_3d.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torchpatches import testing
        compiled = torch.compile(testing.build_model("flux1"), backend="eager")
        with torch.no_grad():
            compiled(**testing.tiny_inputs("flux1", ids_3d=True))
        print("the script's own output")
    """))
    done = _cli("--json-out", "report.json", str(script), cwd=tmp_path)  # the table on stdout, JSON in the file
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert done.stdout.count("the script's own output") == 3  # each run's prints, as under python
    assert _row_keys(data["breaks"]) == _row_keys(flux_report.to_json()["breaks"])
    assert data["fullgraph_ok"] is True and data["graphs"] == flux_report.graphs
    assert "fixed by compile_warnings" in done.stdout


# the CLI's process plumbing: see test_cli_and_api_agree_on_flux
@pytest.mark.once
def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "item.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_doctor import ItemBranch
        torch.compile(ItemBranch(), backend="eager")(torch.ones(2, int(sys.argv[1])))
    """))
    out_file = tmp_path / "report.json"
    # "4" reaches the script as sys.argv[1]; the table goes to stdout, the JSON to the file
    code, out, _ = _main(capsys, "--no-baseline", "--no-fullgraph", "--json-out", str(out_file), str(script), "4")
    assert code == 1
    data = json.loads(out_file.read_text())
    api = torchpatches.doctor(ItemBranch(), torch.ones(2, 4))
    assert _row_keys(data["breaks"]) == _row_keys(api.to_json()["breaks"])
    assert data["exit_code"] == 1 and data["breaks"][0]["hint"] and data["verdict"] == "breaks"
    assert "hint for" in out and "graph breaks: 1 site(s), 1 remain" in out

    assert _main(capsys, str(tmp_path / "missing.py"))[0] == 2
    assert _main(capsys)[0] == 2
    assert _main(capsys, "--bogus", str(script))[0] == 2


def test_a_failing_workload_is_reported() -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    report = _doctor.diagnose(torchpatches, boom, target="boom", fullgraph=False)
    assert report.errors == {"without_patches": "RuntimeError: boom", "with_patches": "RuntimeError: boom"}
    assert report.fullgraph_ok is None and report.exit_code == 1 and report.verdict == "run_failed"


# ---- classification, without compiling ---------------------------------------------------------------------


def _break(file: str, line: int, reason: str = "logging.Logger method not supported", stack: Any = None) -> _capture.GraphBreak:
    frames = stack or (_capture.Frame(file, line, "forward"),)
    return _capture.GraphBreak(file, line, "forward", reason, "", (), "", tuple(frames), reason)


def _captured(*events: _capture.GraphBreak) -> _capture.Capture:
    result = _capture.Capture()
    result.breaks.extend(events)
    return result


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tuple[str, str]:
    """A module with one logger.warning site, imported, and a patch declaring it."""
    path = tmp_path / "tp_doctor_site.py"
    path.write_text("import logging\nlogger = logging.getLogger()\ndef f(x):\n    logger.warning('x')\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import tp_doctor_site  # noqa: F401

    yield str(path), "tp_doctor_site:f"
    sys.modules.pop("tp_doctor_site", None)


def _status(state: str, target_state: str = "applied", reason: str = "r") -> Any:
    from types import SimpleNamespace

    class _State:
        def __init__(self, value: str) -> None:
            self.value = value

    target = SimpleNamespace(path="tp_doctor_site:f", state=_State(target_state), reason=reason)
    return {"p": SimpleNamespace(state=_State(state), reason=reason, targets=(target,))}


def test_rows_fixed_fixable_open_and_drift(user_module: Tuple[str, str]) -> None:
    path, function = user_module
    sites = [DeclaredSite("p", function, Site("logger.warning", "when x", function=function))]
    site_break, other = _break(path, 4), _break(path, 5, "Unsupported Tensor.item() call")

    fixed = _doctor_rows.break_rows(_captured(site_break, other), _captured(other), _status("applied"), sites)
    assert [(r.line, r.status, r.fixed_by) for r in fixed] == [(5, "open", None), (4, "fixed", "p")]

    fixable = _doctor_rows.break_rows(_captured(site_break), _captured(site_break), _status("disabled", "disabled", "off"), sites)
    assert [(r.status, r.fixable_by, r.why) for r in fixable] == [("fixable", "p", "p is disabled: off")]

    drift = _doctor_rows.break_rows(_captured(site_break), _captured(site_break), _status("applied"), sites)
    assert drift[0].status == "open" and "still breaks" in drift[0].why

    undeclared = _doctor_rows.break_rows(_captured(other), _captured(), _status("applied"), sites)
    assert undeclared[0].status == "fixed" and undeclared[0].fixed_by is None

    # A break below the site (inside the called logger) is matched through the traced stack.
    deep = _break("/elsewhere/logging.py", 99, stack=(_capture.Frame(path, 4, "f"), _capture.Frame("/elsewhere/logging.py", 99, "warning")))
    assert _doctor_rows.break_rows(_captured(deep), _captured(), _status("applied"), sites)[0].fixed_by == "p"


def test_a_site_shared_by_targets_is_fixable_while_one_of_them_is_not_applied(user_module: Tuple[str, str]) -> None:
    """The @apply_lora_scale wrapper's warning: one site, declared by every LoRA forward it wraps."""
    from types import SimpleNamespace

    path, function = user_module
    site = Site("logger.warning", "when x", function=function)
    sites = [DeclaredSite("p", "m:A.forward", site), DeclaredSite("p", "m:B.forward", site)]
    state = lambda value: SimpleNamespace(value=value)  # noqa: E731
    targets = (SimpleNamespace(path="m:A.forward", state=state("applied"), reason="m:A.forward replaced"),
               SimpleNamespace(path="m:B.forward", state=state("skipped"), reason="m:B.forward differs"))
    status = {"p": SimpleNamespace(state=state("applied"), reason="1/2 target(s) patched", targets=targets)}
    rows = _doctor_rows.break_rows(_captured(_break(path, 4)), _captured(_break(path, 4)), status, sites)
    assert [(r.status, r.fixable_by, r.why) for r in rows] == [("fixable", "p", "p is skipped: m:B.forward differs")]

    applied = {"p": SimpleNamespace(state=state("applied"), reason="2/2", targets=(
        targets[0], SimpleNamespace(path="m:B.forward", state=state("applied"), reason="replaced")))}
    rows = _doctor_rows.break_rows(_captured(_break(path, 4)), _captured(_break(path, 4)), applied, sites)
    assert rows[0].status == "open" and "still breaks" in rows[0].why


@pytest.mark.parametrize(
    "reason, expected",
    [
        ("0/0: tensor 'x' size mismatch at index 0. expected 1, actual 3", "mark_dynamic(tensor, 0)"),
        ("tensor 'x' stride mismatch at index 0", "contiguous"),
        ("tensor 'x' dtype mismatch. expected Float, actual Half", "dtype"),
        ("___check_obj_id(L['self'], 1234)", "different object"),
        ("L['n'] == 3", "Python int/float"),
        ("len(L['xs']) == 2", "length"),
        ("0/1: ___check_type_id(fn, 94612220305936), type=<class 'Sequential'>", "shared entry wrapper"),
        ("something new", "recompiles_verbose"),
    ],
)
def test_remedies(reason: str, expected: str) -> None:
    assert expected in _doctor_rows.remedy(_doctor_rows.clean_reason(reason))


# ---- capture degrades instead of raising --------------------------------------------------------------------


def test_capture_notes_a_moved_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo import convert_frame, symbolic_convert

    def log_graph_break(self: Any, reason: Any) -> None:  # another signature
        return None

    monkeypatch.setattr(symbolic_convert.InstructionTranslatorBase, "log_graph_break", log_graph_break)
    monkeypatch.delattr(convert_frame, "get_and_maybe_log_recompilation_reasons")
    with _capture.capture() as captured:
        torch.compile(Plain(), backend="eager")(torch.ones(1, 4))
    assert any("graph breaks not captured" in note for note in captured.notes)
    assert any("recompiles not captured" in note for note in captured.notes)
    assert symbolic_convert.InstructionTranslatorBase.log_graph_break is log_graph_break  # not left hooked


def test_capture_restores_dynamo() -> None:
    from torch._dynamo import convert_frame, symbolic_convert

    before = (symbolic_convert.InstructionTranslatorBase.log_graph_break, convert_frame.get_and_maybe_log_recompilation_reasons)
    with _capture.capture():
        with _capture.capture():
            pass
        assert symbolic_convert.InstructionTranslatorBase.log_graph_break is not before[0]
    after = (symbolic_convert.InstructionTranslatorBase.log_graph_break, convert_frame.get_and_maybe_log_recompilation_reasons)
    assert after == before


def test_import_does_not_load_the_doctor() -> None:
    code = "import sys, torchpatches; print([m for m in ('torchpatches._doctor.diagnose', 'torchpatches._doctor.report', 'torchpatches._doctor.rows', 'torchpatches._doctor.script', 'torchpatches._doctor.capture', 'torchpatches._doctor.sites') if m in sys.modules])"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- scripts that do what scripts do ---------------------------------------------------------------------

_EXITING = """
import sys, torch
from torchpatches import testing

def main(code):
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    compiled(torch.ones(1, 4))
    torch._dynamo.reset()  # the script's own reset: what it compiles next is a first compile, not a recompile
    compiled(torch.ones(2, 4))
    print("argv", sys.argv[1:])
    sys.exit(code)

if __name__ == "__main__":
    main(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_script_with_main_guard_argv_reset_and_sys_exit(tmp_path: Path, capsys: pytest.CaptureFixture, code: int) -> None:
    """What each run's child process does with the script (`script_workload` + the runs), in this process;
    the child processes themselves are tested end to end below (test_cli_each_run_is_a_fresh_python...)."""
    from torchpatches._doctor.script import script_workload

    script = tmp_path / "exits.py"
    script.write_text(_EXITING)
    argv, path = sys.argv[:], sys.path[:]
    try:
        report = _doctor.diagnose(torchpatches, script_workload(str(script), [str(code)]), target=str(script))
    finally:
        sys.argv[:], sys.path[:] = argv, path
    data = report.to_json()
    assert capsys.readouterr().out.count(f"argv ['{code}']") == 3  # it ran as __main__, with its arguments
    assert data["breaks"] == [] and data["recompiles"] == []
    if code == 0:
        assert data["errors"] == {} and data["fullgraph_ok"] is True and report.exit_code == 0
    else:  # a run that did not finish is reported, and exit status 1 says the report is not clean
        assert data["errors"] == {"without_patches": "SystemExit: 3", "with_patches": "SystemExit: 3"}
        assert data["fullgraph_ok"] is None  # failing the same way with fullgraph says nothing about breaks
        assert any("fails the same way" in note for note in data["notes"])
        assert report.exit_code == 1


def test_cli_usage_errors_say_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = _main(capsys, str(tmp_path / "missing.py"))
    assert code == 2 and "no such script" in err and out == ""
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    code, out, err = _main(capsys, str(broken))
    assert code == 2 and "SyntaxError" in err and out == ""
    assert _main(capsys, str(tmp_path))[0] == 2  # a directory is not a script


# the CLI's process plumbing: see test_cli_and_api_agree_on_flux
@pytest.mark.once
def test_cli_with_the_patch_disabled_by_the_environment(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("diffusers")
    script = tmp_path / "ff.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torchpatches import testing
        model = testing.build_model("feedforward")
        torch.compile(model, backend="eager")(**testing.tiny_inputs("feedforward", scale=0.5))
    """))
    monkeypatch.setenv("TORCHPATCHES_DISABLE", "compile_warnings")  # the runs' processes read it
    out_file = tmp_path / "report.json"
    code, table, _ = _main(capsys, "--no-baseline", "--no-fullgraph", "--json-out", str(out_file), str(script))
    data = json.loads(out_file.read_text())
    assert code == 1
    assert data["patches"]["compile_warnings"]["state"] == "disabled"
    assert data["breaks"] and {row["status"] for row in data["breaks"]} == {"fixable"}
    assert {row["fixable_by"] for row in data["breaks"]} == {"compile_warnings"}
    assert all("TORCHPATCHES_DISABLE" in row["why"] for row in data["breaks"]), data["breaks"]
    # fullgraph_ok is False then: test_flux_fixable_when_the_patch_is_disabled (the same verdict code)
    assert "fixable by compile_warnings: compile_warnings is disabled" in table


def test_api_after_the_users_own_reset() -> None:
    compiled = torch.compile(ItemBranch(), backend="eager")
    compiled(torch.ones(2, 4))
    torch._dynamo.reset()
    report = torchpatches.doctor(compiled, torch.ones(2, 4))  # a compiled module: the doctor compiles its original
    assert [(r.line, r.status) for r in report.breaks] == [(_line_of("ITEM"), "open")]


def test_a_recompiled_replacement_is_named_by_the_def_in_its_file() -> None:
    """A patch's replacement is a copy compiled inside a factory; its code says "_torchpatches_factory.<locals>"."""
    event = _capture.Recompile("_torchpatches_factory.<locals>.forward", __file__, _line_of("DECORATED"),
                               ("tensor 'x' size mismatch at index 0. expected 1, actual 3",))
    [row] = _doctor_rows.recompile_rows([event])
    assert row.function == "Decorated.forward" and "mark_dynamic" in row.remedy


@pytest.mark.parametrize(
    "name, expected",
    [
        ("torch_dynamo_resume_in_forward_at_737", "forward"),
        ("FluxTransformer2DModel.torch_dynamo_resume_in_forward_at_737", "FluxTransformer2DModel.forward"),
        ("FluxTransformer2DModel.forward", "FluxTransformer2DModel.forward"),
    ],
)
def test_resume_functions_are_named_by_the_function_they_resume(name: str, expected: str) -> None:
    assert _capture.clean_function_name(name) == expected


# ---- a script that does what scripts do, each run as under `python` ----------------------------------------

_HOSTILE = """
import atexit, multiprocessing, os, subprocess, sys
import torch
import torchpatches

def worker():
    print("from a multiprocessing worker", flush=True)

if __name__ == "__main__":
    line = sys.stdin.readline()                 # each run reads the same stdin
    os.chdir("data")                            # each run starts in the directory `python` starts in
    seen = [os.environ.get("TP_SEEN"), sys.argv[1:], sys.path[0] == os.path.dirname(os.path.abspath(__file__)),
            "/nowhere" in sys.path, getattr(torch, "_tp_seen", None)]
    os.environ["TP_SEEN"] = "1"; sys.argv.append("mutated"); sys.path.insert(0, "/nowhere"); torch._tp_seen = 1
    print("print")
    sys.__stdout__.write("sys.__stdout__\\n"); sys.__stdout__.flush()
    os.write(1, b"os.write\\n")
    os.system("echo os.system")
    subprocess.run([sys.executable, "-c", "print('a child process')"])
    process = multiprocessing.get_context("fork").Process(target=worker); process.start(); process.join()
    atexit.register(lambda: print("atexit"))
    if os.environ.get("TORCHPATCHES_DISABLE") == "all":
        torchpatches.apply("rope")              # the script patches the baseline itself
    torch.compile(torch.nn.Linear(4, 4), backend="eager")(torch.ones(int(line), 4))
    print("RUN", repr(line), seen, file=sys.stderr)
"""


# the CLI's process plumbing: see test_cli_and_api_agree_on_flux
@pytest.mark.once
def test_cli_each_run_is_a_fresh_python_and_json_stays_alone_on_stdout(tmp_path: Path) -> None:
    script = tmp_path / "hostile.py"
    script.write_text(_HOSTILE)
    (tmp_path / "data").mkdir()
    done = _cli("--json", str(script), "--", "b", cwd=tmp_path, input="3\n")
    data = json.loads(done.stdout)  # nothing the script or its processes wrote reached stdout
    runs = [line for line in done.stderr.splitlines() if line.startswith("RUN ")]
    assert runs == ["RUN '3\\n' [None, ['--', 'b'], True, False, None]"] * 3, done.stderr[-3000:]
    for text in ("print", "sys.__stdout__", "os.write", "os.system", "a child process", "from a multiprocessing "
                 "worker", "atexit"):
        assert done.stderr.count(text) >= 3, text
    assert data["errors"] == {} and data["graphs"] == {"without_patches": 1, "with_patches": 1}
    assert data["applied_by_workload"] == ["rope"] and any("applied rope itself" in n for n in data["notes"])
    assert data["verdict"] == "clean" and data["fullgraph_ok"] is True and done.returncode == 0


def test_a_run_that_ends_with_os_exit_is_still_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each run's child does when the script ends its process with os._exit(n) to skip teardown."""
    from torchpatches._doctor import script as _doctor_script

    class Ended(BaseException):
        pass

    def real_exit(code: int) -> None:
        raise Ended(code)

    monkeypatch.setattr(os, "_exit", real_exit)
    finished: List[Any] = []
    errors: Dict[str, str] = {}
    _doctor_script._finish_on_os_exit(finished.append, errors, "with_patches")
    with pytest.raises(Ended), _capture.capture():
        torch.compile(Plain(), backend="eager")(torch.ones(2, 4))
        os._exit(3)
    [captured] = finished
    assert captured.graphs == 1 and errors == {"with_patches": "os._exit(3)"}
    assert os._exit is real_exit  # the hook ran once and put the real one back


def test_stdin_is_replayed_to_every_run_and_an_endless_stream_does_not_stall() -> None:
    from torchpatches._doctor.script import StdinReplay

    read_end, write_end = os.pipe()
    os.write(write_end, b"3\n")  # the stream stays open: never an EOF
    replay = StdinReplay(read_end)
    try:
        for _ in range(3):  # each run reads one line, as a script would; each gets the same line
            run_read, run_write = os.pipe()
            replay.feed(os.fdopen(run_write, "wb"))
            with os.fdopen(run_read, "rb") as pipe:
                assert pipe.readline() == b"3\n"
    finally:
        os.close(write_end)


# ---- verdicts the doctor cannot know are "not judged" ----------------------------------------------------------


def test_a_workload_that_compiles_nothing_is_not_judged() -> None:
    model = Plain()
    for workload in (lambda: model(torch.ones(2, 4)), lambda: None):
        report = torchpatches.doctor(workload)
        assert report.graphs["with_patches"] == 0 and report.breaks == []
        assert report.verdict == "not_judged" and "nothing was compiled" in report.not_judged
        assert report.fullgraph_ok is None and report.exit_code == 3
        assert "not judged" in str(report) and report.to_json()["exit_code"] == 3


def test_a_partial_of_a_module_is_the_module_called_with_its_arguments() -> None:
    clean = torchpatches.doctor(functools.partial(Plain(), torch.ones(2, 4)))
    assert clean.graphs["with_patches"] == 1 and clean.verdict == "clean" and clean.fullgraph_ok is True
    report = torchpatches.doctor(functools.partial(functools.partial(ItemBranch()), x=torch.ones(2, 4)))
    assert [(r.line, r.status) for r in report.breaks] == [(_line_of("ITEM"), "open")] and report.exit_code == 1


@pytest.mark.parametrize("how", ["error_on_graph_break(False)", "caught"])
def test_fullgraph_is_not_true_while_a_break_is_open(how: str) -> None:
    compiled = torch.compile(ItemBranch(), backend="eager")

    def workload() -> None:
        if how == "caught":
            try:
                compiled(torch.ones(2, 4))
            except Exception:  # noqa: BLE001 - the user's own error handling swallows fullgraph's error
                torch._dynamo.reset()
                ItemBranch()(torch.ones(2, 4))
        else:
            with torch._dynamo.error_on_graph_break(False):
                compiled(torch.ones(2, 4))

    report = torchpatches.doctor(workload)
    assert [row.status for row in report.breaks] == ["open"]
    assert report.fullgraph_ok is None and report.fullgraph_why.startswith("not judged")
    assert report.exit_code == 1 and "fullgraph=True: not judged" in str(report)


def test_a_workload_that_patches_the_baseline_is_named() -> None:
    before = {name: entry.state for name, entry in torchpatches.status().items()}

    def workload() -> None:
        torchpatches.apply("rope")
        torch.compile(Plain(), backend="eager")(torch.ones(2, 4))

    report = torchpatches.doctor(workload)
    assert report.applied_by_workload == ["rope"] and "applied rope itself" in str(report)
    assert {name: entry.state for name, entry in torchpatches.status().items()} == before


# ---- a closed stdout, and `--` for the script ---------------------------------------------------------------


class _ClosedPipe:
    """A stdout whose reader has gone (``| head -c 10``), on a real descriptor the idiom can dup over."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "w")

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self._file.fileno()


# the CLI's process plumbing: see test_cli_and_api_agree_on_flux
@pytest.mark.once
def test_a_closed_stdout_exits_141_without_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchpatches import __main__ as cli

    script = tmp_path / "quiet.py"
    script.write_text("import torch\ntorch.compile(torch.nn.Linear(4, 4), backend='eager')(torch.ones(1, 4))\n")
    for argv in (["--json"], ["doctor", "--json", "--no-baseline", "--no-fullgraph", str(script)]):
        monkeypatch.setattr(sys, "stdout", _ClosedPipe(tmp_path / "stdout"))
        assert cli.run(argv) == cli.EXIT_BROKEN_PIPE == 141  # not 1: "failed" / "breaks remain"


@pytest.mark.parametrize(
    "argv, options, script_args",
    [
        (["s.py", "--", "b"], ["s.py"], ["--", "b"]),
        (["--json", "s.py", "--json", "-x"], ["--json", "s.py"], ["--json", "-x"]),
        (["--json-out", "r.json", "s.py", "a"], ["--json-out", "r.json", "s.py"], ["a"]),
        (["--", "-s.py", "a"], ["--", "-s.py"], ["a"]),
    ],
)
def test_everything_after_the_script_is_the_scripts(argv: List[str], options: List[str], script_args: List[str]) -> None:
    from torchpatches.__main__ import _split_script

    assert _split_script(argv) == (options, script_args)


# ---- the doctor's modules import nothing from the package above them ---------------------------------------


DOCTOR = ROOT / "torchpatches" / "_doctor"


@pytest.mark.parametrize("module", ["__init__", "diagnose", "report", "rows", "script", "capture", "sites"])
def test_no_upward_import(module: str) -> None:
    import ast

    tree = ast.parse((DOCTOR / f"{module}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(alias.name == "torchpatches" for alias in node.names), ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            assert node.module != "torchpatches" or node.level, ast.dump(node)
            if node.level and node.module is None:  # from . / .. import x: x must be a module, not an __init__'s name
                package = DOCTOR if node.level == 1 else DOCTOR.parent
                assert node.level <= 2, ast.dump(node)
                for alias in node.names:
                    assert (package / f"{alias.name}.py").exists() or (package / alias.name).is_dir(), alias.name
