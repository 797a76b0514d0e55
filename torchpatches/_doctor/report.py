"""The doctor's report: its rows, its verdict, its JSON (``torchpatches.doctor/2``) and its table.

Built by :mod:`torchpatches._doctor.diagnose` (the runs) from rows that :mod:`torchpatches._doctor.rows` classifies.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

__all__ = ["DoctorReport", "BreakRow", "RecompileRow", "SCHEMA", "EXIT_NOT_JUDGED", "short_path"]

#: Version of the JSON layout (``DoctorReport.to_json``); bumped when a field changes meaning, goes, or comes.
#: /2 (from /1): ``verdict``, ``not_judged``, ``fullgraph_why`` and ``applied_by_workload`` are new;
#: ``exit_code`` 3 is new (not judged); ``fullgraph_ok`` is null also when the trial cannot be judged.
SCHEMA = "torchpatches.doctor/2"

#: Exit status when the doctor cannot give a verdict (nothing was compiled).
EXIT_NOT_JUDGED = 3


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
    """The doctor's findings. ``str()`` is a table for people, ``to_json()`` the stable form for tools.

    ``fullgraph_ok`` is True/False when the trial judged it, None with ``fullgraph_why`` otherwise;
    ``not_judged`` says why no verdict at all can be given (then ``exit_code`` is 3).
    """

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
        fullgraph_why: str = "",
        not_judged: str = "",
        applied_by_workload: Optional[List[str]] = None,
    ) -> None:
        self.target, self.breaks, self.recompiles, self.graphs = target, breaks, recompiles, graphs
        self.fullgraph_ok, self.fullgraph_error, self.fullgraph_why = fullgraph_ok, fullgraph_error, fullgraph_why
        self.patches, self.notes, self.errors, self.versions = patches, notes, errors, versions
        self.not_judged = not_judged
        self.applied_by_workload = list(applied_by_workload or [])

    @property
    def remaining(self) -> List[BreakRow]:
        return [row for row in self.breaks if row.status != "fixed"]

    @property
    def verdict(self) -> str:
        """"breaks" (some remain, or fullgraph fails), "run_failed" (the run with patches raised),
        "not_judged" (nothing to judge: see ``not_judged``) or "clean"."""
        if self.remaining or self.fullgraph_ok is False:
            return "breaks"
        if "with_patches" in self.errors:
            return "run_failed"
        if self.not_judged:
            return "not_judged"
        return "clean"

    @property
    def exit_code(self) -> int:
        """0 clean, 1 graph breaks remain (or ``fullgraph`` fails, or the run with patches failed), 3 not judged."""
        return {"clean": 0, "not_judged": EXIT_NOT_JUDGED}.get(self.verdict, 1)

    def to_json(self) -> Dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "versions": self.versions,
            "verdict": self.verdict,
            "not_judged": self.not_judged,
            "breaks": [row.to_json() for row in self.breaks],
            "recompiles": [row.to_json() for row in self.recompiles],
            "fullgraph_ok": self.fullgraph_ok,
            "fullgraph_error": self.fullgraph_error,
            "fullgraph_why": self.fullgraph_why,
            "graphs": self.graphs,
            "patches": {
                name: {"state": entry.state.value, "reason": entry.reason} for name, entry in self.patches.items()
            },
            "applied_by_workload": self.applied_by_workload,
            "errors": self.errors,
            "notes": self.notes,
            "exit_code": self.exit_code,
        }

    def __repr__(self) -> str:
        return (
            f"DoctorReport(target={self.target!r}, breaks={len(self.breaks)}, remaining={len(self.remaining)}, "
            f"recompiles={len(self.recompiles)}, fullgraph_ok={self.fullgraph_ok}, verdict={self.verdict!r})"
        )

    def __str__(self) -> str:
        return _format(self)


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


def _status_cell(row: BreakRow) -> str:
    if row.status == "fixed":
        return f"fixed by {row.fixed_by}" if row.fixed_by else "gone (no patch declares it)"
    if row.status == "fixable":
        return f"fixable by {row.fixable_by}: {row.why}"
    return "open" + (f": {row.why}" if row.why else "")


def _format(report: DoctorReport) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items() if k != "python")
    out = [f"torchpatches doctor: {report.target} ({versions})"]
    graphs = report.graphs
    if graphs.get("without_patches") is not None:
        out.append(f"graphs compiled: {graphs['without_patches']} without torchpatches, {graphs['with_patches']} with")
    elif graphs.get("with_patches") is not None:
        out.append(f"graphs compiled: {graphs['with_patches']}")
    if report.not_judged:
        out.append(f"verdict: not judged: {report.not_judged}")
    if report.fullgraph_ok is None:
        out.append("fullgraph=True: " + (report.fullgraph_why or "not tried"))
    else:
        out.append("fullgraph=True: " + ("compiles (tried)" if report.fullgraph_ok else f"fails (tried): {report.fullgraph_error}"))
    for name, error in report.errors.items():
        out.append(f"run {name.replace('_', ' ')} raised {error}")
    if report.applied_by_workload:
        out.append(f"warning: the workload applied {', '.join(report.applied_by_workload)} itself in the run "
                   "without torchpatches: that baseline was patched")

    remaining = report.remaining
    out.append("")
    out.append(f"graph breaks: {len(report.breaks)} site(s), {len(remaining)} remain")
    if report.breaks:
        rows = [("where", "function", "reason", "status")]
        rows += [(f"{short_path(row.file)}:{row.line}", row.function, _clip(row.reason, 60), _status_cell(row))
                 for row in report.breaks]
        out.extend(_table(rows))
        for row in remaining:
            if row.hint:
                out.append(f"  hint for {short_path(row.file)}:{row.line}: {row.hint}")

    out.append("")
    out.append(f"recompiles: {sum(r.count for r in report.recompiles)}")
    for recompile in report.recompiles:
        times = f" (x{recompile.count})" if recompile.count > 1 else ""
        out.append(f"  {recompile.function} at {short_path(recompile.file)}:{recompile.line}{times}: {recompile.reason}")
        out.append(f"    remedy: {recompile.remedy}")

    out.append("")
    out.append(str(report.patches))
    for note in report.notes:
        out.append(f"note: {note}")
    return "\n".join(out)
