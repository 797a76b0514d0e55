"""Where a patch's declared sites are in the running code, and which site a graph break hit.

A :class:`~torchpatches._core.declare.Site` names a function and the call in it that breaks graphs; this
module finds the lines of those calls by parsing the function's source file (``ast``), so the lines
always belong to the code that is installed -- a declaration holds no line numbers that could drift.
A graph break hits a site when any frame of its traced stack is in the site's file on one of those lines.
Only modules already imported are looked at (a break cannot come from a module that never loaded).
"""
from __future__ import annotations

import ast
import functools
import importlib
import os
import sys
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from .._core.declare import Patch, Site

__all__ = [
    "DeclaredSite", "declared_sites", "site_lines", "calls_in_function", "find_site", "find_sites", "normalize_path",
    "enclosing_function",
]


class DeclaredSite(NamedTuple):
    patch: str
    target: str  # the target path whose replacement removes the break
    site: Site


def normalize_path(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))


def declared_sites(patches: Optional[Iterable[Patch]] = None) -> List[DeclaredSite]:
    """Every site every patch declares (the patch declarations torchpatches registered, by default)."""
    if patches is None:
        from ..patches import PATCH_MODULES

        patches = []
        for name in PATCH_MODULES:
            try:
                patches.append(importlib.import_module(f"{__name__.partition('.')[0]}.patches.{name}").PATCH)
            except Exception:  # noqa: BLE001 - a broken patch file is reported by status(), not here
                continue
    found: List[DeclaredSite] = []
    for patch in patches:
        for target in patch.targets:
            found.extend(DeclaredSite(patch.name, target.path, site) for site in getattr(target, "sites", ()))
    return found


def call_matches(call: ast.Call, pattern: str) -> bool:
    """Does ``call`` have the form ``pattern`` names ("logger.warning", "warnings.warn", "deprecate")?"""
    func = call.func
    if "." in pattern:
        owner, method = pattern.rsplit(".", 1)
        if not isinstance(func, ast.Attribute) or func.attr != method:
            return False
        value = func.value
        name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""
        if owner == "logger":
            return name == "logger" or name.endswith("_logger")
        return name == owner
    return isinstance(func, ast.Name) and func.id == pattern


def _find_def(tree: ast.Module, qualname: str) -> Optional[ast.AST]:
    scope: Sequence[ast.AST] = tree.body
    node: Optional[ast.AST] = None
    for part in qualname.split("."):
        node = next(
            (n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part),
            None,
        )
        if node is None:
            return None
        scope = node.body  # type: ignore[attr-defined]
    return node


@functools.lru_cache(maxsize=None)
def _parse(path: str, mtime: float) -> Optional[ast.Module]:
    try:
        with open(path, encoding="utf-8") as handle:
            return ast.parse(handle.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def calls_in_function(path: str, qualname: str, pattern: str) -> Tuple[Tuple[int, int], ...]:
    """(first line, last line) of every ``pattern`` call inside ``qualname`` (nested defs included)."""
    try:
        tree = _parse(path, os.path.getmtime(path))
    except OSError:
        return ()
    node = _find_def(tree, qualname) if tree is not None else None
    if node is None:
        return ()
    spans = []
    for child in ast.walk(node):
        if isinstance(child, ast.Call) and call_matches(child, pattern):
            spans.append((child.lineno, getattr(child, "end_lineno", None) or child.lineno))
    return tuple(sorted(spans))


def site_lines(site: Site) -> Optional[Tuple[str, FrozenSet[int]]]:
    """(normalized file, lines) of a site in the code that is imported now; None if its module is not."""
    module_name, qualname = site.function.split(":", 1)
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None) if module is not None else None
    if not path:
        return None
    lines = set()
    for first, last in calls_in_function(path, qualname, site.call):
        lines.update(range(first, last + 1))
    return normalize_path(path), frozenset(lines)


def find_sites(frames: Iterable[Tuple[str, int, str]], sites: Sequence[DeclaredSite]) -> List[DeclaredSite]:
    """Every declaration of the site a graph break hit (the innermost traced frame on a site's line).

    Several targets can declare one site: the ``@apply_lora_scale`` wrapper's warning is declared by every
    LoRA forward it wraps, and the traced stack does not say which model's wrapper it was.
    """
    resolved: Dict[int, Optional[Tuple[str, FrozenSet[int]]]] = {}
    for file, line, _ in reversed(list(frames)):
        path = normalize_path(file)
        found = []
        for index, declared in enumerate(sites):
            if index not in resolved:
                resolved[index] = site_lines(declared.site)
            where = resolved[index]
            if where is not None and where[0] == path and line in where[1]:
                found.append(declared)
        if found:
            return found
    return []


def find_site(frames: Iterable[Tuple[str, int, str]], sites: Sequence[DeclaredSite]) -> Optional[DeclaredSite]:
    """The (first) declared site a graph break hit: the innermost traced frame that is on a site's line."""
    found = find_sites(frames, sites)
    return found[0] if found else None


def enclosing_function(path: str, line: int) -> Optional[str]:
    """The qualname of the innermost def around ``line`` of ``path`` ("FluxAttention.forward"), if any."""
    try:
        tree = _parse(path, os.path.getmtime(path))
    except OSError:
        return None
    if tree is None:
        return None
    best: Optional[str] = None

    def visit(nodes: Iterable[ast.AST], prefix: str) -> None:
        nonlocal best
        for node in nodes:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                last = getattr(node, "end_lineno", None) or node.lineno
                if first <= line <= last:
                    name = f"{prefix}{node.name}"
                    if not isinstance(node, ast.ClassDef):
                        best = name
                    inner = f"{name}.<locals>." if not isinstance(node, ast.ClassDef) else f"{name}."
                    visit(node.body, inner)

    visit(tree.body, "")
    return best
