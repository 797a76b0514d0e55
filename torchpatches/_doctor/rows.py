"""The doctor's rows: each graph break classified (fixed / fixable / open, by which patch), each
recompile with the guard that failed and the usual remedy, and a hint for breaks no patch covers.

Pure functions of captured events (:mod:`torchpatches._doctor.capture`), ``status()`` and the declared sites
(:mod:`torchpatches._doctor.sites`); the runs that produce the events are in :mod:`torchpatches._doctor.diagnose`.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .capture import Capture, GraphBreak, Recompile
from .report import BreakRow, RecompileRow
from .sites import DeclaredSite, enclosing_function, find_site, find_sites

__all__ = ["break_rows", "recompile_rows", "remedy", "clean_reason"]


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


def remedy(reason: str) -> str:
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


def clean_reason(reason: str) -> str:
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


def break_rows(
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


def recompile_rows(events: Sequence[Recompile]) -> List[RecompileRow]:
    grouped: Dict[Tuple[str, str, int, str], int] = {}
    for event in events:
        reason = clean_reason(event.reasons[0]) if event.reasons else "unknown (Dynamo gave no guard failure)"
        # A bare name, or a copy compiled inside a factory (a patch's replacement: "_torchpatches_factory.<locals>.
        # forward"): name it by the def around its first line in the file, as the user reads it.
        plain = "." in event.function and "<locals>" not in event.function
        name = event.function if plain else enclosing_function(event.file, event.line) or event.function
        key = (name, event.file, event.line, reason)
        grouped[key] = grouped.get(key, 0) + 1
    return [RecompileRow(f, file, line, reason, remedy(reason), n) for (f, file, line, reason), n in grouped.items()]


