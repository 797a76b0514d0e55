"""The doctor: a user's graph breaks and recompiles, each mapped to the patch that removes it.

    report = torchpatches.doctor(model, **inputs)     # compiles model (backend "eager"), one call
    report = torchpatches.doctor(workload)            # a zero-argument callable: every compile inside it
    print(report); report.to_json(); report.exit_code

    python -m torchpatches doctor script.py [args]    # the same for a script, each run in its own process

What it does: runs the workload with every torchpatches patch reverted (the baseline), then as
configured (the patches ``status()`` shows), then once more with ``fullgraph`` semantics to see whether
that compiles; it captures Dynamo's graph breaks and recompiles in each run (:mod:`torchpatches._doctor.capture`).
A break seen in the baseline but not with the patches is *fixed*, by the patch that declares its site
(:class:`torchpatches.Site`); a break that remains is *fixable* when a patch declares its site but is
disabled or skipped (the reason is the patch's), else *open* (:mod:`torchpatches._doctor.rows`).
What the runs cannot show is *not judged*, with the reason: nothing compiled, or a fullgraph trial
that passed while graph breaks happened.

Between runs of a workload in this process it calls ``torch._dynamo.reset()``: code compiled before
the doctor ran is compiled again on its next call. The doctor never changes whether a patch is on
once it returns. This module never imports the package ``__init__``: its callers pass it in (``api``).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .capture import Capture, capture
from .report import BreakRow, DoctorReport, RecompileRow, SCHEMA
from .rows import break_rows, recompile_rows
from .sites import declared_sites

__all__ = ["doctor", "diagnose", "DoctorReport", "BreakRow", "RecompileRow", "SCHEMA"]

#: What a run records when it fails: run name ("without_patches", ...) -> "Type: first line".
Errors = Dict[str, str]


def error_text(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()


def versions(api: Any) -> Dict[str, str]:
    """The versions a report names: torch, torchpatches, Python, and diffusers where it is imported."""
    import torch

    versions = {"torch": torch.__version__, "torchpatches": api.__version__, "python": sys.version.split()[0]}
    diffusers = sys.modules.get("diffusers")
    if diffusers is not None:
        versions["diffusers"] = getattr(diffusers, "__version__", "?")
    return versions


def _reset() -> None:
    import torch

    torch._dynamo.reset()


def run(workload: Callable[[], Any], errors: Errors, name: str) -> Capture:
    """Run ``workload`` once under :func:`capture`; a failure (an exception, ``sys.exit(n)``, n != 0)
    is recorded in ``errors[name]`` -- a failing run is a finding, not a crash of the doctor."""
    _reset()
    with capture() as captured:
        try:
            workload()
        except SystemExit as stop:
            if stop.code not in (None, 0):
                errors[name] = f"SystemExit: {stop.code}"
        except Exception as error:  # noqa: BLE001
            errors[name] = error_text(error)
    return captured


@contextlib.contextmanager
def watch_applies(registry: Any, turned_on: Optional[List[str]] = None) -> Iterator[List[str]]:
    """Names of the patches turned on while the block runs (``torchpatches.apply``/``only``/... all end in
    the registry's ``apply`` or ``restore``): in the baseline run, the workload patching it itself."""
    turned_on = [] if turned_on is None else turned_on

    def watching(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def watched(*args: Any, **kwargs: Any) -> Any:
            before = registry.wanted()
            try:
                return method(*args, **kwargs)
            finally:
                after = registry.wanted()
                turned_on.extend(name for name, off in after.items()
                                 if off is None and before.get(name) is not None and name not in turned_on)

        return watched

    registry.apply, registry.restore = watching(registry.apply), watching(registry.restore)
    try:
        yield turned_on
    finally:
        del registry.apply, registry.restore  # the instance attributes: the class's methods are back


def run_unpatched(api: Any, workload: Callable[[], Any], errors: Errors,
                  applied: Optional[List[str]] = None) -> Tuple[Capture, List[str]]:
    """The baseline: every patch reverted. Returns the capture and the patches the workload applied itself
    (also filled into ``applied`` as they come)."""
    with api.disabled(), watch_applies(api._registry, applied) as applied:
        before = run(workload, errors, "without_patches")
    return before, applied


def build_report(api: Any, target: str, before: Optional[Capture], after: Capture, errors: Errors,
                 applied: List[str]) -> DoctorReport:
    """The report of the runs so far (the fullgraph verdict is added by :func:`judge_fullgraph`), in the
    process of the run with patches: ``status()``, the declared sites and the versions are read here."""
    notes: List[str] = []
    for captured in (before, after):
        if captured is not None:
            notes.extend(note for note in captured.notes if note not in notes)
    if before is None:
        notes.append("no baseline run: breaks the patches removed are not listed")
    if applied:
        notes.append(f"the workload applied {', '.join(applied)} itself (torchpatches.apply/only) in the run "
                     "without torchpatches: breaks those patches remove are not listed as fixed")
    status = api.status()
    report = DoctorReport(
        target=target,
        breaks=break_rows(before, after, status, declared_sites()),
        recompiles=recompile_rows(after.recompiles),
        fullgraph_ok=None,
        fullgraph_error="",
        graphs={"without_patches": before.graphs if before is not None else None, "with_patches": after.graphs},
        patches=status,
        notes=notes,
        errors=errors,
        versions=versions(api),
        applied_by_workload=applied,
    )
    if after.graphs == 0 and not after.breaks and "with_patches" not in errors:
        report.not_judged = (
            "nothing was compiled in the run with patches (torch.compile was never entered): there is "
            "nothing to judge; give the doctor a module or function and its inputs, doctor(model, **inputs), "
            "or a workload that calls a compiled one"
        )
    return report


class Trial:
    """The fullgraph trial's outcome: its capture (None if not run), its error, or why it did not run."""

    def __init__(self, captured: Optional[Capture] = None, error: str = "", not_run: str = "") -> None:
        self.captured, self.error, self.not_run = captured, error, not_run


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


def fullgraph_trial(workload: Callable[[], Any], fullgraph_workload: Optional[Callable[[], Any]] = None) -> Trial:
    """Run the workload with fullgraph semantics: ``fullgraph_workload`` (compiling with
    ``fullgraph=True``) if given, else the workload under ``error_on_graph_break(True)``."""
    errors: Errors = {}
    if fullgraph_workload is not None:
        return Trial(run(fullgraph_workload, errors, "fullgraph"), errors.get("fullgraph", ""))
    with _error_on_graph_break() as unavailable:
        if unavailable is not None:
            return Trial(not_run=unavailable)
        captured = run(workload, errors, "fullgraph")
    return Trial(captured, errors.get("fullgraph", ""))


def judge_fullgraph(report: DoctorReport, trial: Optional[Trial]) -> None:
    """Set ``fullgraph_ok``: True only when the trial compiled and nothing says graph breaks happen."""
    ok: Optional[bool] = None
    why = ""
    if trial is None:
        why = "not tried"
    elif trial.not_run:
        why = f"not tried: {trial.not_run}"
    elif trial.error and trial.error == report.errors.get("with_patches"):
        # A script's sys.exit(3), its own exception: the trial says nothing about graph breaks.
        why = "not judged: the workload fails the same way without it"
    elif trial.error:
        ok = False
    elif trial.captured is not None and trial.captured.breaks:
        why = (f"not judged: {len(trial.captured.breaks)} graph break(s) happened in the trial without failing "
               "it: the workload turns fullgraph semantics off (torch._dynamo.error_on_graph_break(False)) or "
               "catches the error")
    elif report.remaining:
        why = (f"not judged: the trial compiled, yet {len(report.remaining)} graph break site(s) remain in the "
               "run with patches: the runs differ")
    elif report.not_judged or (trial.captured is not None and trial.captured.graphs == 0):
        why = "not judged: nothing was compiled in the trial"
    else:
        ok = True
    report.fullgraph_ok, report.fullgraph_error, report.fullgraph_why = ok, trial.error if trial else "", why
    if why and why != "not tried":
        report.notes.append(f"fullgraph {why}")


def diagnose(
    api: Any,
    workload: Callable[[], Any],
    *,
    target: str,
    fullgraph_workload: Optional[Callable[[], Any]] = None,
    baseline: bool = True,
    fullgraph: bool = True,
) -> DoctorReport:
    """The doctor's procedure for a workload in this process (``torchpatches.doctor`` ends here).

    ``api`` is the ``torchpatches`` package (passed in, so this module does not import it from below).
    """
    errors: Errors = {}
    before, applied = run_unpatched(api, workload, errors) if baseline else (None, [])
    after = run(workload, errors, "with_patches")
    report = build_report(api, target, before, after, errors, applied)
    judge_fullgraph(report, fullgraph_trial(workload, fullgraph_workload) if fullgraph else None)
    _reset()
    return report


def _describe(obj: Any) -> str:
    base = getattr(obj, "_orig_mod", None) or getattr(obj, "_torchdynamo_orig_callable", None) or obj
    name = getattr(base, "__qualname__", None) or type(base).__qualname__
    return name


def _unwrap_partials(fn: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, Tuple[Any, ...], Dict[str, Any]]:
    """``functools.partial(model, **inputs)`` is ``model`` called with ``inputs``."""
    while isinstance(fn, functools.partial):
        fn, args, kwargs = fn.func, (*fn.args, *args), {**fn.keywords, **kwargs}
    return fn, args, kwargs


def doctor(api: Any, fn_or_module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> DoctorReport:
    """``torchpatches.doctor(fn_or_module, *args, **kwargs)``; ``api`` is the ``torchpatches`` package."""
    import torch

    if not callable(fn_or_module):
        raise TypeError(f"doctor() needs a module or a callable, got {type(fn_or_module).__name__}")
    fn_or_module, args, kwargs = _unwrap_partials(fn_or_module, tuple(args), dict(kwargs))
    target = _describe(fn_or_module)
    compiled_from = getattr(fn_or_module, "_orig_mod", None) or getattr(fn_or_module, "_torchdynamo_orig_callable", None)
    is_module = isinstance(fn_or_module, torch.nn.Module)
    if compiled_from is None and not is_module and not args and not kwargs:
        return diagnose(api, fn_or_module, target=target)
    original = compiled_from if compiled_from is not None else fn_or_module

    def workload() -> Any:
        return torch.compile(original, backend="eager")(*args, **kwargs)

    def fullgraph_workload() -> Any:
        return torch.compile(original, backend="eager", fullgraph=True)(*args, **kwargs)

    return diagnose(api, workload, target=target, fullgraph_workload=fullgraph_workload)
