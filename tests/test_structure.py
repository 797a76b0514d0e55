"""The package's shape, read from its source with ``ast`` (nothing is imported): no import cycle among
torchpatches' modules, no module importing the package ``__init__`` from below, no file over 450 lines.

Which imports count (``if TYPE_CHECKING:`` blocks never do: they do not run):
- cycles, two rules. At load time (the imports a module runs while it loads: its body, including
  ``if``/``try``/``with`` blocks and class bodies, not function bodies): none at all, since such a cycle
  hands one module a half-initialized other. Among all imports, function-local ones too: none either,
  since a function-local import still makes a dependency, and the modules should form layers. A
  function-local import is the way to *defer* a dependency (``_core.registry`` loads ``_core.gates`` once a target's
  module has loaded, to keep ``import torchpatches`` cheap), not a way around the layering.
- imports of the package ``__init__`` (``import torchpatches``, ``from torchpatches import name``,
  ``from . import name`` / ``from .. import name`` where ``name`` is not a module): every import,
  function-local ones too -- a lower module that reaches for the public API depends on everything the
  API imports. The CLI (``__main__`` and the demo it runs) sits above the API and may use it.

Known violations being removed are expected failures (``strict``: once one is fixed, its entry must go, else the
test fails as "passed unexpectedly").
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

PACKAGE = "torchpatches"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
MAX_LINES = 450

#: Modules above the public API: the CLI and the demo it runs. Nothing else in the package imports them.
ENTRY_POINTS = {f"{PACKAGE}.__main__", f"{PACKAGE}._demo"}

#: Known cycles through function-local imports (their modules) -> the change that breaks it.
KNOWN_CYCLES: Dict[Tuple[str, ...], str] = {}
#: Modules known to import the package __init__ from below -> the change that removes the import.
KNOWN_UPWARD: Dict[str, str] = {}
#: Files known to be over MAX_LINES -> the change that splits them.
KNOWN_LONG: Dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> Dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


MODULES = _sources()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (its ``level`` counted from ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, body: List[ast.stmt], at_load: bool) -> Iterator[Tuple[ast.stmt, bool]]:
    """(import statement, runs while the module loads) for every import in ``body``, nested ones too."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, at_load
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(module, node.body, False)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _imports(module, node.body, False)
            yield from _imports(module, node.orelse, at_load)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _imports(module, getattr(node, field, []) or [], at_load)


def _targets(module: str, node: ast.stmt) -> Iterator[Tuple[str, bool]]:
    """(torchpatches module imported, whether the package ``__init__``'s namespace is what is imported)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE:
                yield PACKAGE, True
            elif alias.name.startswith(PACKAGE + "."):
                yield alias.name, False
        return
    assert isinstance(node, ast.ImportFrom)
    source = _resolve(module, node)
    if source != PACKAGE and not source.startswith(PACKAGE + "."):
        return
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in MODULES:
            yield submodule, False
        else:
            yield source, source == PACKAGE


def _graph() -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]], Dict[str, List[str]]]:
    """Import edges that run at load time, all import edges, and per module the places it imports the
    package __init__."""
    at_load_edges: Dict[str, Set[str]] = {module: set() for module in MODULES}
    edges: Dict[str, Set[str]] = {module: set() for module in MODULES}
    upward: Dict[str, List[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, at_load in _imports(module, tree.body, True):
            for target, names_from_init in _targets(module, node):
                if names_from_init and module != PACKAGE and module not in ENTRY_POINTS:
                    upward.setdefault(module, []).append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
                if target != module and target in MODULES:
                    edges[module].add(target)
                    if at_load:
                        at_load_edges[module].add(target)
    return at_load_edges, edges, upward


def _cycles(edges: Dict[str, Set[str]]) -> List[Tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[Tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


AT_LOAD_EDGES, EDGES, UPWARD = _graph()
CYCLES = _cycles(EDGES)


def test_no_import_cycle_at_load_time() -> None:
    assert _cycles(AT_LOAD_EDGES) == []


def test_no_import_cycle_other_than_the_known_ones() -> None:
    assert [cycle for cycle in CYCLES if cycle not in KNOWN_CYCLES] == []


@pytest.mark.parametrize("cycle", [
    pytest.param(cycle, id="~".join(cycle),
                 marks=pytest.mark.xfail(strict=True, reason=f"known cycle, removed by {owner}"))
    for cycle, owner in KNOWN_CYCLES.items()
])
def test_known_cycle_is_gone(cycle: Tuple[str, ...]) -> None:
    assert cycle not in CYCLES


def test_no_module_imports_the_package_init_from_below_other_than_the_known_ones() -> None:
    assert {module: places for module, places in UPWARD.items() if module not in KNOWN_UPWARD} == {}


@pytest.mark.parametrize("module", [
    pytest.param(module, marks=pytest.mark.xfail(strict=True, reason=f"known upward import, removed by {owner}"))
    for module, owner in KNOWN_UPWARD.items()
])
def test_known_upward_import_is_gone(module: str) -> None:
    assert module not in UPWARD, UPWARD.get(module)


def test_the_cli_is_imported_by_the_cli_only() -> None:
    """What lets ENTRY_POINTS use the public API: nothing below the API imports them."""
    importers = {module: sorted(target for target in targets if target in ENTRY_POINTS)
                 for module, targets in EDGES.items() if module not in ENTRY_POINTS}
    assert {module: found for module, found in importers.items() if found} == {}


def _line_counts() -> Dict[str, int]:
    return {path.relative_to(ROOT.parent).as_posix(): len(path.read_text().splitlines()) for path in MODULES.values()}


def test_no_file_over_the_line_limit_other_than_the_known_ones() -> None:
    long = {path: lines for path, lines in _line_counts().items() if lines > MAX_LINES and path not in KNOWN_LONG}
    assert long == {}


@pytest.mark.parametrize("path", [
    pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=f"over {MAX_LINES} lines, split by {owner}"))
    for path, owner in KNOWN_LONG.items()
])
def test_known_long_file_is_split(path: str) -> None:
    assert _line_counts().get(path, 0) <= MAX_LINES


# ---- the checker itself, on made-up modules: each rule can fail --------------------------------------


def test_the_checker_finds_a_cycle_and_ignores_function_local_imports() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    source = "import torchpatches._core.gates\ndef f():\n    from . import _slot\nif TYPE_CHECKING:\n    from . import _status\n"
    found = [(node.lineno, at_load) for node, at_load in _imports(f"{PACKAGE}._core.registry", ast.parse(source).body, True)]
    assert found == [(1, True), (3, False), (5, False)]


def test_the_checker_tells_a_submodule_from_a_name_of_the_package_init() -> None:
    def targets(module: str, source: str) -> List[Tuple[str, bool]]:
        return [target for node in ast.parse(source).body for target in _targets(module, node)]

    assert targets(f"{PACKAGE}._doctor.diagnose", "from .. import __version__, _harness") == [
        (PACKAGE, True), (f"{PACKAGE}._harness", False)]
    assert targets(f"{PACKAGE}._doctor.diagnose", "from . import sites") == [(f"{PACKAGE}._doctor.sites", False)]
    assert targets(f"{PACKAGE}.patches.rope", "from .. import status") == [(PACKAGE, True)]
    assert targets(f"{PACKAGE}.patches.rope", "from .._core.declare import Patch") == [(f"{PACKAGE}._core.declare", False)]
    assert targets(f"{PACKAGE}.patches.compile_warnings", "from ._table import targets") == [
        (f"{PACKAGE}.patches.compile_warnings._table", False)]
    assert targets(f"{PACKAGE}.ops._rope", "import torchpatches") == [(PACKAGE, True)]
    assert targets(f"{PACKAGE}.ops._rope", "from torchpatches import apply") == [(PACKAGE, True)]
    assert targets(f"{PACKAGE}.ops._rope", "import torch, os.path") == []
