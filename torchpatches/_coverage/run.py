"""``torchpatches.coverage(model, ...)`` (one call, watched, then timed on a GPU) and ``python -m torchpatches
coverage SCRIPT`` (a whole script, watched, in this process)."""
from __future__ import annotations

import os
import runpy
import sys
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .._doctor.diagnose import versions
from . import modules as _modules
from .observe import Recorder, recording
from .report import EXAMPLES, CoverageReport
from .timing import time_call


def coverage(api: Any, model: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> CoverageReport:
    """Run ``model(*args, **kwargs)`` once, watched; on CUDA, time it with and without torchpatches."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"torchpatches.coverage needs an nn.Module to call, got {type(model).__name__}")
    with recording() as recorder:
        model(*args, **kwargs)
    report = build_report(api, type(model).__name__, recorder, [model])
    report.timing = time_call(api, lambda: model(*args, **kwargs), _device(args, kwargs))
    return report


def coverage_script(api: Any, script: str, argv: List[str]) -> CoverageReport:
    """Run ``script`` as ``__main__`` with ``argv``, watched; the models are the modules its globals hold (and the
    components of the pipelines they hold). Not timed: a script's calls cannot be repeated from outside."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does
    try:
        with recording() as recorder:
            try:
                namespace = runpy.run_path(script, run_name="__main__")
            except SystemExit as stop:
                if stop.code not in (None, 0):
                    raise
                namespace = {}
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    report = build_report(api, script, recorder, _models_in(namespace.values()))
    report.timing = {"skipped": "not timed: time one call with torchpatches.coverage(model, ...)"}
    return report


def build_report(api: Any, target: str, recorder: Recorder, models: List[torch.nn.Module]) -> CoverageReport:
    names: Dict[int, str] = {}
    classes: Dict[type, int] = {}
    for model in models:
        names.update(_modules.named_objects(model))
        for cls, count in _modules.objects_by_class(model).items():
            classes[cls] = classes.get(cls, 0) + count
    rows = []
    for (pattern, cls, reason), calls in sorted(recorder.counts.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                          kv[0][2] or "")):
        seen = sorted(names[i] for i in recorder.objects[(pattern, cls, reason)] if i in names)
        rows.append({"pattern": pattern, "class": cls, "fused": reason is None, "calls": calls, "reason": reason,
                     "modules": seen[:EXAMPLES] + ([f"+{len(seen) - EXAMPLES} more"] if len(seen) > EXAMPLES else [])})
    targets = _modules.fusion_targets()
    status = api.status()
    not_applied = []
    for cls, count in classes.items():
        for pattern in _modules.targeting(cls, targets):
            entry = status.get(pattern)
            if entry is not None and entry.state is not api.PatchState.APPLIED:
                not_applied.append({"class": cls.__qualname__, "instances": count, "pattern": pattern,
                                    "state": entry.state.value, "reason": entry.reason})
    untargeted = [{"class": name, "instances": count} for name, count in _modules.untargeted(classes, targets)]
    return CoverageReport(target=target, versions=versions(api), rows=rows, not_applied=not_applied,
                          untargeted=untargeted)


def _models_in(values: Iterable[Any]) -> List[torch.nn.Module]:
    """The modules among ``values`` and the components of pipelines among them, without those inside another."""
    found: List[torch.nn.Module] = []
    for value in values:
        components = getattr(value, "components", None) if not isinstance(value, torch.nn.Module) else None
        candidates = list(components.values()) if isinstance(components, dict) else [value]
        found.extend(c for c in candidates if isinstance(c, torch.nn.Module) and all(c is not f for f in found))
    inner = {id(sub) for model in found for sub in list(model.modules())[1:]}
    return [model for model in found if id(model) not in inner]


def _device(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[torch.device]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None
