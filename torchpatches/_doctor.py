"""The doctor: a user's graph breaks and recompiles, each mapped to the patch that removes it.

    report = torchpatches.doctor(model, **inputs)     # compiles model (backend "eager"), one call
    report = torchpatches.doctor(workload)            # a zero-argument callable: every compile inside it
    print(report); report.to_json(); report.exit_code

    python -m torchpatches doctor script.py [args]    # the same for a script run as __main__

What it does: runs the workload with every torchpatches patch reverted (the baseline), then as
configured (the patches ``status()`` shows), then once more with ``fullgraph`` semantics to see whether
that compiles; it captures Dynamo's graph breaks and recompiles in each run (:mod:`torchpatches._capture`).
A break seen in the baseline but not with the patches is *fixed*, by the patch that declares its site
(:class:`torchpatches.Site`); a break that remains is *fixable* when a patch declares its site but is
disabled or skipped (the reason is the patch's), else *open*, with a one-line hint where a standard one
exists. Recompiles are reported with the guard that failed and the usual remedy; the doctor fixes none.

Between runs it calls ``torch._dynamo.reset()``: code compiled before the doctor ran is compiled again
on its next call. The doctor never changes whether a patch is on once it returns.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ._capture import Capture, GraphBreak, Recompile, capture
from ._sites import DeclaredSite, declared_sites, enclosing_function, find_site, find_sites

__all__ = ["doctor", "diagnose", "DoctorReport", "BreakRow", "RecompileRow", "SCHEMA"]

#: Version of the JSON layout (``DoctorReport.to_json``); bumped only when a field changes meaning or goes.
SCHEMA = "torchpatches.doctor/1"


class BreakRow(NamedTuple):
    """One graph-break site (several breaks at one line and of one kind are one row, ``count`` of them)."""

    file: str
    line: int
    function: str
    reason: str
    status: str  # "fixed", "fixable" or "open"
    fixed_by: Optional[str]  # the patch that removed it (status "fixed")
    fixable_by: Optional[str]  # the patch that would remove it but is not applied (status "fixable")
    why: str  # why it is fixable-but-not-fixed, or a note on a fixed/open row
    hint: str  # for open rows: the standard remedy, when there is one
    count: int  # times Dynamo logged it in the run it belongs to (re-traces count again)
    gb_id: str
    stack: Tuple[Tuple[str, int, str], ...]

    def to_json(self) -> Dict[str, Any]:
        data = self._asdict()
        data["stack"] = [{"file": f, "line": n, "function": fn} for f, n, fn in self.stack]
        return data


class RecompileRow(NamedTuple):
    function: str
    file: str
    line: int
    reason: str  # the first guard that failed, as Dynamo words it
    remedy: str
    count: int

    def to_json(self) -> Dict[str, Any]:
        return self._asdict()


class DoctorReport:
    """The doctor's findings. ``str()`` is a table for people, ``to_json()`` the stable form for tools."""

    def __init__(
        self,
        target: str,
        breaks: List[BreakRow],
        recompiles: List[RecompileRow],
        fullgraph_ok: Optional[bool],
        fullgraph_error: str,
        graphs: Dict[str, Optional[int]],
        patches: Any,
        notes: List[str],
        errors: Dict[str, str],
        versions: Dict[str, str],
    ) -> None:
        self.target = target
        self.breaks = breaks
        self.recompiles = recompiles
        self.fullgraph_ok = fullgraph_ok
        self.fullgraph_error = fullgraph_error
        self.graphs = graphs
        self.patches = patches
        self.notes = notes
        self.errors = errors
        self.versions = versions

    @property
    def remaining(self) -> List[BreakRow]:
        return [row for row in self.breaks if row.status != "fixed"]

    @property
    def exit_code(self) -> int:
        """0 when no graph break remains (and ``fullgraph`` did not fail), 1 otherwise."""
        if self.remaining or self.fullgraph_ok is False or "with_patches" in self.errors:
            return 1
        return 0

    def to_json(self) -> Dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "versions": self.versions,
            "breaks": [row.to_json() for row in self.breaks],
            "recompiles": [row.to_json() for row in self.recompiles],
            "fullgraph_ok": self.fullgraph_ok,
            "fullgraph_error": self.fullgraph_error,
            "graphs": self.graphs,
            "patches": {
                name: {"state": entry.state.value, "reason": entry.reason} for name, entry in self.patches.items()
            },
            "errors": self.errors,
            "notes": self.notes,
            "exit_code": self.exit_code,
        }

    def __repr__(self) -> str:
        return (
            f"DoctorReport(target={self.target!r}, breaks={len(self.breaks)}, remaining={len(self.remaining)}, "
            f"recompiles={len(self.recompiles)}, fullgraph_ok={self.fullgraph_ok})"
        )

    def __str__(self) -> str:
        return _format(self)


# ---- hints and remedies -------------------------------------------------------------------------

_BREAK_HINTS: Sequence[Tuple[str, str]] = (
    ("logging.Logger", "log through torchpatches.compile.warning_once(logger, ...) or OnceLogger (no graph break)"),
    ("warnings.warn", "warn through torchpatches.compile.warn_once(...) (no graph break)"),
    ("Tensor.item()", "keep the value a tensor (torch.where / torch.cond), or set torch._dynamo.config.capture_scalar_outputs = True"),
    ("Data-dependent", "keep the value a tensor (torch.where / torch.cond) instead of branching on it in Python"),
    ("data dependent", "keep the value a tensor (torch.where / torch.cond) instead of branching on it in Python"),
    ("builtin print", "drop the print, or torch._dynamo.config.reorderable_logging_functions.add(print)"),
    ("disable", "the function is excluded from compilation (torch.compiler.disable): the graph ends there by design"),
)


def _hint(event: GraphBreak) -> str:
    text = f"{event.reason}\n{event.detail}"
    if any(frame.function == "warn" and frame.file.endswith("warnings.py") for frame in event.stack) or (
        "warnings" in text and "warn" in text and "skipped" in text
    ):
        return _BREAK_HINTS[1][1]
    for needle, hint in _BREAK_HINTS:
        if needle in event.reason or needle in event.explanation:
            return hint
    return event.hints[0] if event.hints else ""


_SIZE = re.compile(r"size mismatch at index (\d+)")


def _remedy(reason: str) -> str:
    if re.search(r"___check_(type|obj)_id\(fn\b", reason):
        return (
            "another compiled module or function entered through Dynamo's shared entry wrapper: one compile per "
            "distinct one is expected; many of them count against torch._dynamo.config.recompile_limit"
        )
    size = _SIZE.search(reason)
    if size:
        dim = size.group(1)
        return (
            f"a size changed (dim {dim}): torch._dynamo.mark_dynamic(tensor, {dim}) before the first call, or "
            f"torch.compile(dynamic=True), or pad/bucket that dim to a few fixed sizes (warm up with each)"
        )
    if "stride mismatch" in reason:
        return "the strides changed: pass contiguous tensors (x.contiguous()) in every call"
    if "dtype mismatch" in reason or "device mismatch" in reason:
        return "a dtype/device changed: warm up with the dtype and device of the real calls"
    if "requires_grad mismatch" in reason or "grad_mode" in reason or "GLOBAL_STATE" in reason:
        return "the grad mode changed: warm up under the same torch.no_grad()/inference_mode() as the real calls"
    if "___stack" in reason or ".item()" in reason:
        return "a Python number read from a tensor was baked in: keep it a tensor, or torch._dynamo.config.capture_scalar_outputs = True"
    if "___check_obj_id" in reason or "id mismatch" in reason:
        return "a different object (module, function, config) than in the first call: reuse one object, or expect one compile each"
    if "___check_type_id" in reason or "type mismatch" in reason:
        return "an argument's type changed between calls"
    if re.search(r"len\(", reason):
        return "a list/tuple/dict length changed: keep it fixed, or pass the items as one tensor"
    if re.search(r"L\['[^']+'\] == ", reason):
        return "a Python int/float argument changed value: pass it as a tensor, or torch.compile(dynamic=True)"
    return "TORCH_LOGS=recompiles_verbose lists every guard that failed"


def _clean_reason(reason: str) -> str:
    first = reason.strip().splitlines()[0] if reason.strip() else ""
    first = re.sub(r"^\d+/\d+: ", "", first)
    return re.sub(r"\s{2,}#.*$", "", first).strip()


# ---- building the report -----------------------------------------------------------------------


def _key(event: GraphBreak) -> Tuple[str, int, str]:
    return (os.path.normcase(event.file), event.line, event.reason)


def _group(events: Sequence[GraphBreak]) -> Dict[Tuple[str, int, str], Tuple[GraphBreak, int]]:
    grouped: Dict[Tuple[str, int, str], Tuple[GraphBreak, int]] = {}
    for event in events:
        key = _key(event)
        first, count = grouped.get(key, (event, 0))
        grouped[key] = (first, count + 1)
    return grouped


def _target_state(status: Any, declared: DeclaredSite) -> Tuple[str, str]:
    entry = status.get(declared.patch)
    if entry is None:
        return "unknown", f"patch {declared.patch} is not registered"
    for target in entry.targets:
        if target.path == declared.target:
            if entry.state.value in ("disabled", "skipped", "failed") and target.state.value != "applied":
                return entry.state.value, entry.reason
            return target.state.value, target.reason or entry.reason
    return entry.state.value, entry.reason


def _rows(
    baseline: Optional[Capture], patched: Capture, status: Any, sites: Sequence[DeclaredSite]
) -> List[BreakRow]:
    rows: List[BreakRow] = []
    remaining = _group(patched.breaks)
    before = _group(baseline.breaks) if baseline is not None else {}
    stack = lambda event: tuple((f.file, f.line, f.function) for f in event.stack)  # noqa: E731
    function = lambda event: enclosing_function(event.file, event.line) or event.function  # noqa: E731

    for key, (event, count) in before.items():
        if key in remaining:
            continue
        declared = find_site(event.stack, sites)
        if declared is not None:
            rows.append(BreakRow(event.file, event.line, function(event), event.reason, "fixed", declared.patch, None,
                                 declared.site.breaks, "", count, event.gb_id, stack(event)))
        else:
            rows.append(BreakRow(event.file, event.line, function(event), event.reason, "fixed", None, None,
                                 "gone with the patches applied, but no patch declares this site", "", count,
                                 event.gb_id, stack(event)))
    for key, (event, count) in remaining.items():
        matches = find_sites(event.stack, sites)
        if not matches:
            rows.append(BreakRow(event.file, event.line, function(event), event.reason, "open", None, None, "",
                                 _hint(event), count, event.gb_id, stack(event)))
            continue
        # A site several targets declare (a shared wrapper) breaks while any of them is not applied.
        states = [(declared, *_target_state(status, declared)) for declared in matches]
        declared, state, reason = next((entry for entry in states if entry[1] != "applied"), states[0])
        if state == "applied":
            rows.append(BreakRow(event.file, event.line, function(event), event.reason, "open", None, None,
                                 f"{declared.patch} declares this site and is applied, yet it still breaks "
                                 "(please report it)", _hint(event), count, event.gb_id, stack(event)))
        else:
            rows.append(BreakRow(event.file, event.line, function(event), event.reason, "fixable", None,
                                 declared.patch, f"{declared.patch} is {state}: {reason}", "", count, event.gb_id,
                                 stack(event)))
    order = {"open": 0, "fixable": 1, "fixed": 2}
    rows.sort(key=lambda row: (order[row.status], row.file, row.line))
    return rows


def _recompile_rows(events: Sequence[Recompile]) -> List[RecompileRow]:
    grouped: Dict[Tuple[str, str, int, str], int] = {}
    for event in events:
        reason = _clean_reason(event.reasons[0]) if event.reasons else "unknown (Dynamo gave no guard failure)"
        # A bare name, or a copy compiled inside a factory (a patch's replacement: "_torchpatches_factory.<locals>.
        # forward"): name it by the def around its first line in the file, as the user reads it.
        plain = "." in event.function and "<locals>" not in event.function
        name = event.function if plain else enclosing_function(event.file, event.line) or event.function
        key = (name, event.file, event.line, reason)
        grouped[key] = grouped.get(key, 0) + 1
    return [RecompileRow(f, file, line, reason, _remedy(reason), n) for (f, file, line, reason), n in grouped.items()]


# ---- running ------------------------------------------------------------------------------------


def _error_text(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()


def _versions() -> Dict[str, str]:
    import torch

    from . import __version__

    versions = {"torch": torch.__version__, "torchpatches": __version__, "python": sys.version.split()[0]}
    diffusers = sys.modules.get("diffusers")
    if diffusers is not None:
        versions["diffusers"] = getattr(diffusers, "__version__", "?")
    return versions


def _reset() -> None:
    import torch

    torch._dynamo.reset()


def _run(workload: Callable[[], Any], errors: Dict[str, str], name: str) -> Capture:
    _reset()
    with capture() as captured:
        try:
            workload()
        except SystemExit as stop:
            if stop.code not in (None, 0):
                errors[name] = f"SystemExit: {stop.code}"
        except Exception as error:  # noqa: BLE001 - a failing run is a finding, not a crash of the doctor
            errors[name] = _error_text(error)
    return captured


@contextlib.contextmanager
def _error_on_graph_break() -> Iterator[Optional[str]]:
    """fullgraph semantics for every compile inside (yields None), or the reason it is not possible."""
    import torch

    switch = getattr(torch._dynamo, "error_on_graph_break", None)
    if switch is None:
        yield "torch._dynamo.error_on_graph_break is not available on this torch"
        return
    with switch(True):
        yield None


def diagnose(
    workload: Callable[[], Any],
    *,
    target: str,
    fullgraph_workload: Optional[Callable[[], Any]] = None,
    baseline: bool = True,
    fullgraph: bool = True,
) -> DoctorReport:
    """The doctor's procedure for any workload (the API and the CLI both end here).

    ``fullgraph_workload`` runs the fullgraph trial (compiling with ``fullgraph=True``); without it the
    workload itself runs under ``torch._dynamo.error_on_graph_break(True)``.
    """
    import torchpatches

    errors: Dict[str, str] = {}
    notes: List[str] = []
    before: Optional[Capture] = None
    if baseline:
        with torchpatches.disabled():
            before = _run(workload, errors, "without_patches")
    after = _run(workload, errors, "with_patches")
    status = torchpatches.status()

    fullgraph_ok: Optional[bool] = None
    fullgraph_error = ""
    if fullgraph:
        trial_errors: Dict[str, str] = {}
        if fullgraph_workload is not None:
            _run(fullgraph_workload, trial_errors, "fullgraph")
            fullgraph_ok = "fullgraph" not in trial_errors
        else:
            with _error_on_graph_break() as unavailable:
                if unavailable is None:
                    _run(workload, trial_errors, "fullgraph")
                    fullgraph_ok = "fullgraph" not in trial_errors
                else:
                    notes.append(f"fullgraph not tried: {unavailable}")
        fullgraph_error = trial_errors.get("fullgraph", "")
        if fullgraph_ok is False and fullgraph_error == errors.get("with_patches"):
            # The workload fails the same way without fullgraph (a script's sys.exit(3), its own exception):
            # the trial says nothing about graph breaks.
            fullgraph_ok, fullgraph_error = None, ""
            notes.append("fullgraph not judged: the workload fails the same way without it")
    _reset()

    for captured in (before, after):
        if captured is not None:
            notes.extend(note for note in captured.notes if note not in notes)
    if not baseline:
        notes.append("no baseline run: breaks the patches removed are not listed")
    return DoctorReport(
        target=target,
        breaks=_rows(before, after, status, declared_sites()),
        recompiles=_recompile_rows(after.recompiles),
        fullgraph_ok=fullgraph_ok,
        fullgraph_error=fullgraph_error,
        graphs={"without_patches": before.graphs if before is not None else None, "with_patches": after.graphs},
        patches=status,
        notes=notes,
        errors=errors,
        versions=_versions(),
    )


def _describe(obj: Any) -> str:
    base = getattr(obj, "_orig_mod", None) or getattr(obj, "_torchdynamo_orig_callable", None) or obj
    name = getattr(base, "__qualname__", None) or type(base).__qualname__
    return name


def doctor(fn_or_module: Any, *args: Any, **kwargs: Any) -> DoctorReport:
    """Graph breaks, recompiles and ``fullgraph`` for ``fn_or_module(*args, **kwargs)`` under ``torch.compile``.

    ``fn_or_module`` (an ``nn.Module`` or a function, or the result of ``torch.compile`` on one) is compiled
    by the doctor with ``backend="eager"`` -- graph breaks and recompiles happen in Dynamo, before any
    backend -- and called once with the arguments. A callable that takes no arguments and is neither a
    module nor compiled is a *workload*: it is called as it is, and every compile inside it is captured
    (use this for several calls, e.g. to see a recompile on a new batch size).
    """
    import torch

    compiled_from = getattr(fn_or_module, "_orig_mod", None) or getattr(fn_or_module, "_torchdynamo_orig_callable", None)
    is_module = isinstance(fn_or_module, torch.nn.Module)
    if not callable(fn_or_module):
        raise TypeError(f"doctor() needs a module or a callable, got {type(fn_or_module).__name__}")
    if compiled_from is None and not is_module and not args and not kwargs:
        return diagnose(fn_or_module, target=_describe(fn_or_module))
    original = compiled_from if compiled_from is not None else fn_or_module

    def workload() -> Any:
        return torch.compile(original, backend="eager")(*args, **kwargs)

    def fullgraph_workload() -> Any:
        return torch.compile(original, backend="eager", fullgraph=True)(*args, **kwargs)

    return diagnose(workload, target=_describe(fn_or_module), fullgraph_workload=fullgraph_workload)


def script_workload(path: str, argv: Sequence[str], stdout: Optional[Any] = None) -> Callable[[], Any]:
    """A workload that runs ``path`` as ``__main__`` with ``argv``, as ``python path argv...`` would.

    ``sys.argv`` and ``sys.path[0]`` are the script's while it runs and restored after; with ``stdout``
    the script's prints go there (the CLI sends them to stderr when it prints JSON).
    """
    import runpy

    path = os.path.abspath(path)

    def run() -> Any:
        saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
        sys.argv = [path, *argv]
        if sys.path:
            sys.path[0] = os.path.dirname(path)
        else:
            sys.path.insert(0, os.path.dirname(path))
        redirect = contextlib.redirect_stdout(stdout) if stdout is not None else contextlib.nullcontext()
        try:
            with redirect:
                runpy.run_path(path, run_name="__main__")
        finally:
            sys.argv = saved_argv
            if saved_path0 is not None:
                sys.path[0] = saved_path0

    return run


# ---- the table ----------------------------------------------------------------------------------


def short_path(path: str) -> str:
    """A path as people read it: relative to the working directory, or from ``site-packages/`` on."""
    marker = f"site-packages{os.sep}"
    if marker in path:
        return path.split(marker, 1)[1]
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if not relative.startswith("..") else path


def _table(rows: List[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _format(report: DoctorReport) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items() if k != "python")
    out = [f"torchpatches doctor: {report.target} ({versions})"]
    graphs = report.graphs
    if graphs.get("without_patches") is not None:
        out.append(f"graphs compiled: {graphs['without_patches']} without torchpatches, {graphs['with_patches']} with")
    elif graphs.get("with_patches") is not None:
        out.append(f"graphs compiled: {graphs['with_patches']}")
    if report.fullgraph_ok is None:
        out.append("fullgraph=True: not tried")
    else:
        out.append("fullgraph=True: " + ("compiles (tried)" if report.fullgraph_ok else f"fails (tried): {report.fullgraph_error}"))
    for name, error in report.errors.items():
        out.append(f"run {name.replace('_', ' ')} raised {error}")

    remaining = report.remaining
    out.append("")
    out.append(f"graph breaks: {len(report.breaks)} site(s), {len(remaining)} remain")
    if report.breaks:
        rows = [("where", "function", "reason", "status")]
        for row in report.breaks:
            if row.status == "fixed":
                status = f"fixed by {row.fixed_by}" if row.fixed_by else "gone (no patch declares it)"
            elif row.status == "fixable":
                status = f"fixable by {row.fixable_by}: {row.why}"
            else:
                status = "open" + (f": {row.why}" if row.why else "")
            where = f"{short_path(row.file)}:{row.line}"
            rows.append((where, row.function, _clip(row.reason, 60), status))
        out.extend(_table(rows))
        hints = [(row, row.hint) for row in remaining if row.hint]
        for row, hint in hints:
            out.append(f"  hint for {short_path(row.file)}:{row.line}: {hint}")

    out.append("")
    out.append(f"recompiles: {sum(r.count for r in report.recompiles)}")
    for row in report.recompiles:
        times = f" (x{row.count})" if row.count > 1 else ""
        out.append(f"  {row.function} at {short_path(row.file)}:{row.line}{times}: {row.reason}")
        out.append(f"    remedy: {row.remedy}")

    out.append("")
    out.append(str(report.patches))
    for note in report.notes:
        out.append(f"note: {note}")
    return "\n".join(out)
