"""Inventory of the warning sites reachable from the forward of every diffusers transformer model.

A static (AST) scan of the installed diffusers: it never imports diffusers' model code. For each
module in ``diffusers.models.transformers`` it takes the models (classes deriving from ``ModelMixin``),
collects every class their ``__init__`` (and the ``__init__`` of what those build) refers to -- blocks,
attention modules, processors, norms, embeddings -- and then follows calls from the ``forward``/``__call__``
of all of them: ``self.method()`` through the class hierarchy, ``super().method()``, functions and
classes named in the code (resolved through ``import``/``from ... import`` and package re-exports), and
``obj.method()`` on other objects by method name among the component classes (an over-approximation:
a site may be listed that a given model never reaches, never the other way round for the call forms
above). In every reachable function it reports the calls Dynamo cannot trace without a graph break:
``logger.warning``/``warn``/``info``/``debug``/``error``, ``warnings.warn``, ``deprecate(...)``, ``print``.

Known blind spots (documented, not hidden): calls through values Dynamo would see but the AST cannot
(``getattr(self, name)()``, callables stored in dicts, hooks registered at runtime), and code outside
diffusers (PEFT layers, user processors).

    python tools/warning_sites.py            # one line per site, grouped by file
    python tools/warning_sites.py --json     # the same as JSON

``tests/patches/test_compile_warnings_sites.py`` imports this file and checks every site is patched by
``compile_warnings`` or listed there as deliberately uncovered.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import os
import sys
from typing import Dict, Iterator, List, Optional, Set, Tuple

#: Methods of a ``logging.Logger`` (Dynamo breaks the graph on every one of them).
LOGGER_METHODS = frozenset({"warning", "warn", "info", "debug", "error", "critical", "exception", "log"})
ENTRY_METHODS = ("forward", "__call__")
DEPRECATE = "diffusers.utils.deprecation_utils:deprecate"


@dataclasses.dataclass(frozen=True, order=True)
class Site:
    """One call that breaks a graph: where it is and what it calls."""

    file: str  # path relative to the diffusers package, e.g. "models/transformers/transformer_flux.py"
    line: int
    function: str  # "module:qualname" of the enclosing def (nested defs spelled outer.<locals>.inner)
    call: str  # "logger.warning", "warnings.warn", "deprecate", "print", ...
    via: str = dataclasses.field(default="", compare=False)  # a root that reaches it (for reading)


@dataclasses.dataclass
class _Function:
    module: str
    qualname: str
    node: ast.AST
    cls: Optional[str]  # "module:ClassName" of the defining class


@dataclasses.dataclass
class _Class:
    module: str
    name: str
    node: ast.ClassDef
    bases: List[str]  # resolved "module:Name" where found, else the dotted text
    methods: Dict[str, str]  # method name -> function key


class _Index:
    """Every module of the diffusers package, parsed once; names resolved through imports."""

    def __init__(self, root: str, package: str = "diffusers") -> None:
        self.root, self.package = root, package
        self.paths: Dict[str, str] = {}  # every module of the package -> its file (parsed on demand)
        self.files: Dict[str, str] = {}
        self.trees: Dict[str, ast.Module] = {}
        self.imports: Dict[str, Dict[str, str]] = {}
        self.globals: Dict[str, Dict[str, ast.AST]] = {}
        self.functions: Dict[str, _Function] = {}
        self.classes: Dict[str, _Class] = {}
        for directory, _, names in os.walk(root):
            for name in sorted(names):
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    self.paths[self._module_name(path)] = path

    def load(self, module: str) -> bool:
        """Parse ``module`` if it is part of the package and not parsed yet; False if it is not."""
        if module in self.trees:
            return True
        path = self.paths.get(module)
        if path is None:
            return False
        self._add(path)
        for cls in [c for c in self.classes.values() if c.module == module]:
            cls.bases = [self._resolve_expr(module, base) or ast.unparse(base) for base in cls.node.bases]
        return module in self.trees

    def _module_name(self, path: str) -> str:
        rel = os.path.relpath(path, self.root)[: -len(".py")].split(os.sep)
        if rel[-1] == "__init__":
            rel = rel[:-1]
        return ".".join([self.package, *rel])

    def _add(self, path: str) -> None:
        module = self._module_name(path)
        with open(path, encoding="utf-8") as handle:
            try:
                tree = ast.parse(handle.read(), path)
            except SyntaxError:
                return
        self.files[module], self.trees[module] = path, tree
        imports: Dict[str, str] = {}
        defined: Dict[str, ast.AST] = {}
        is_package = path.endswith("__init__.py")
        for node in ast.walk(tree):  # imports anywhere (diffusers imports inside functions and TYPE_CHECKING)
            if isinstance(node, ast.ImportFrom):
                base = self._absolute(module, node.module, node.level, is_package)
                for alias in node.names:
                    imports.setdefault(alias.asname or alias.name, f"{base}:{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    imports.setdefault(alias.asname or alias.name.split(".")[0], alias.name if alias.asname else alias.name.split(".")[0])
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined[node.name] = node
                self._add_function(module, node.name, node, None)
            elif isinstance(node, ast.ClassDef):
                defined[node.name] = node
                self._add_class(module, node)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        defined[target.id] = node.value
        self.imports[module], self.globals[module] = imports, defined

    def _add_function(self, module: str, qualname: str, node: ast.AST, cls: Optional[str]) -> str:
        key = f"{module}:{qualname}"
        self.functions[key] = _Function(module, qualname, node, cls)
        return key

    def _add_class(self, module: str, node: ast.ClassDef) -> None:
        key = f"{module}:{node.name}"
        methods: Dict[str, str] = {}
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                methods[item.name] = self._add_function(module, f"{node.name}.{item.name}", item, key)
            elif isinstance(item, ast.Assign):  # forward = other_method / processor class attributes
                for target in item.targets:
                    if isinstance(target, ast.Name) and isinstance(item.value, ast.Name):
                        if item.value.id in methods:
                            methods[target.id] = methods[item.value.id]
        self.classes[key] = _Class(module, node.name, node, [], methods)

    def _absolute(self, module: str, name: Optional[str], level: int, is_package: bool) -> str:
        if level == 0:
            return name or ""
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
        return ".".join(parts + ([name] if name else []))

    # ---- name resolution -------------------------------------------------------------------------

    def resolve(self, module: str, name: str, depth: int = 0) -> Optional[str]:
        """``name`` as seen from ``module`` -> "module:qualname" of a function or class in the index."""
        if depth > 8 or not self.load(module):
            return None
        key = f"{module}:{name}"
        if key in self.functions or key in self.classes:
            return key
        value = self.globals[module].get(name)
        if isinstance(value, ast.Name) and value.id != name:  # Alias = Other
            return self.resolve(module, value.id, depth + 1)
        target = self.imports[module].get(name)
        if target is None:
            return None
        if ":" not in target:
            return None  # a module
        source, attribute = target.split(":", 1)
        if f"{source}.{attribute}" in self.paths:
            return None  # `from pkg import submodule`
        return self.resolve(source, attribute, depth + 1)

    def module_of(self, module: str, name: str) -> Optional[str]:
        """``name`` bound to a module in ``module`` (``import x.y as z``, ``from pkg import submodule``)."""
        if not self.load(module):
            return None
        target = self.imports[module].get(name)
        if target is None:
            return None
        if ":" in target:
            source, attribute = target.split(":", 1)
            full = f"{source}.{attribute}"
            return full if full in self.paths else None
        return target if target in self.paths else None

    def _resolve_expr(self, module: str, expr: ast.AST) -> Optional[str]:
        if isinstance(expr, ast.Name):
            return self.resolve(module, expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            inner = self.module_of(module, expr.value.id)
            if inner is not None:
                return self.resolve(inner, expr.attr)
        return None

    def mro(self, cls_key: str) -> List[str]:
        order, todo, seen = [], [cls_key], set()
        while todo:
            key = todo.pop(0)
            if key in seen or key not in self.classes:
                continue
            seen.add(key)
            order.append(key)
            todo.extend(self.classes[key].bases)
        return order

    def method(self, cls_key: str, name: str, skip_first: bool = False) -> Optional[str]:
        for key in self.mro(cls_key)[1 if skip_first else 0:]:
            found = self.classes[key].methods.get(name)
            if found:
                return found
        return None

    def derives_from(self, cls_key: str, base_name: str) -> bool:
        return any(key.endswith(f":{base_name}") for key in self.mro(cls_key))


def _mentions_is_compiling(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
        and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) in ("is_compiling", "is_dynamo_compiling")
        for n in ast.walk(node)
    )


def _dead_under_compile(test: ast.AST) -> Optional[str]:
    """Which branch of ``if test:`` Dynamo never traces: "body" for ``not is_compiling()`` (alone or
    and-ed with other conditions), "orelse" for a bare ``is_compiling()``; None if neither."""
    negated = lambda n: isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not) and _mentions_is_compiling(n.operand)  # noqa: E731
    if negated(test) or (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and any(map(negated, test.values))):
        return "body"
    if isinstance(test, ast.Call) and _mentions_is_compiling(test):
        return "orelse"
    return None


def _walk_live(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` without the branches Dynamo never traces (``if not torch.compiler.is_compiling():``)."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        if isinstance(current, ast.If):
            dead = _dead_under_compile(current.test)
            todo.append(current.test)
            if dead != "body":
                todo.extend(current.body)
            if dead != "orelse":
                todo.extend(current.orelse)
            continue
        todo.extend(ast.iter_child_nodes(current))


_LIVE_ONLY = True  # scan() switches it off to list every site of a module (dead branches included)


def _calls(node: ast.AST) -> Iterator[ast.Call]:
    for child in (_walk_live(node) if _LIVE_ONLY else ast.walk(node)):
        if isinstance(child, ast.Call):
            yield child


def _annotations(node: ast.AST) -> Set[int]:
    """ids of every node inside a type annotation (a class named there is not used at runtime)."""
    inside: Set[int] = set()
    for child in ast.walk(node):
        roots: List[Optional[ast.AST]] = []
        if isinstance(child, ast.arg):
            roots.append(child.annotation)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            roots.append(child.returns)
        elif isinstance(child, ast.AnnAssign):
            roots.append(child.annotation)
        for root in roots:
            if root is not None:
                inside.update(id(n) for n in ast.walk(root))
    return inside


def _names(node: ast.AST) -> Iterator[ast.AST]:
    """Names and attribute chains read at runtime (annotations left out)."""
    skip = _annotations(node)
    for child in (_walk_live(node) if _LIVE_ONLY else ast.walk(node)):
        if id(child) in skip:
            continue
        if isinstance(child, (ast.Name, ast.Attribute)) and isinstance(getattr(child, "ctx", None), ast.Load):
            yield child


def site_call(index: _Index, module: str, call: ast.Call) -> Optional[str]:
    """What a call is, if it is one of the graph-breaking kinds (else None)."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner, attr = func.value.id, func.attr
        if owner in ("logger", "_logger", "log") and attr in LOGGER_METHODS:
            return f"logger.{attr}"
        if owner == "logging" and attr in LOGGER_METHODS:
            return f"logging.{attr}"
        if owner == "warnings" and attr == "warn":
            return "warnings.warn"
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute):
        if func.value.attr in ("logger", "_logger") and func.attr in LOGGER_METHODS:
            return f"logger.{func.attr}"
    if isinstance(func, ast.Name):
        if func.id == "print":
            return "print"
        if func.id == "warn" and index.imports.get(module, {}).get("warn") == "warnings:warn":
            return "warnings.warn"
        if index.resolve(module, func.id) == DEPRECATE:
            return "deprecate"
    return None


def _chain(parents: Dict[str, str], key: str) -> List[str]:
    chain = [key]
    while parents.get(chain[-1]) and len(chain) < 50:
        chain.append(parents[chain[-1]])
    return chain


@dataclasses.dataclass
class Inventory:
    sites: List[Site]  # reachable from forward (``function`` is the function a patch must replace)
    elsewhere: List[Site]  # in transformer modules but not reached from forward (construction time)
    reachable: Set[str]  # function keys
    roots: List[str]


def scan(diffusers_root: Optional[str] = None, subpackage: str = "models.transformers") -> Inventory:
    """Sites reachable from the forward of every model class in ``diffusers.<subpackage>.*``."""
    if diffusers_root is None:
        spec = importlib.util.find_spec("diffusers")
        if spec is None or spec.origin is None:
            raise RuntimeError("diffusers is not installed")
        diffusers_root = os.path.dirname(spec.origin)
    index = _Index(diffusers_root)
    prefix = f"diffusers.{subpackage}."
    for module in sorted(index.paths):
        if module.startswith(prefix):
            index.load(module)
    # Every class defined in a transformer module: the models, and the blocks / attention modules /
    # processors they are built from or that loaders and users set (``set_attn_processor``).
    models = [key for key, cls in index.classes.items() if cls.module.startswith(prefix)]

    # Phase 1: the classes a model is built from -- whatever its __init__ (transitively) refers to,
    # plus class attributes (``_default_processor_cls = FluxAttnProcessor``).
    components: Set[str] = set()
    todo = list(models)
    while todo:
        key = todo.pop()
        if key in components:
            continue
        components.add(key)
        cls = index.classes[key]
        scopes: List[Tuple[str, ast.AST]] = [(cls.module, n) for n in cls.node.body if isinstance(n, ast.Assign)]
        for base in index.mro(key):
            base_cls = index.classes[base]
            todo.append(base)
            init = base_cls.methods.get("__init__")
            if init:
                scopes.append((base_cls.module, index.functions[init].node))
            scopes += [(base_cls.module, n) for n in base_cls.node.body if isinstance(n, ast.Assign)]
        for module, scope in scopes:
            for name in _names(scope):
                found = index._resolve_expr(module, name)
                if found in index.classes:
                    todo.append(found)
                elif found in index.functions and found not in components:
                    # a helper that builds submodules (get_activation, a processor factory)
                    for inner in _names(index.functions[found].node):
                        inner_found = index._resolve_expr(index.functions[found].module, inner)
                        if inner_found in index.classes:
                            todo.append(inner_found)

    # obj.method() on an object the AST cannot type: any component method of that name. The generic
    # model/config/loader API (``ModelMixin.to``, ``save_pretrained``...) is not what forward calls on
    # its arguments (``x.to(dtype)`` is a tensor), so it is left out of this guess.
    generic = ("diffusers.models.modeling_utils", "diffusers.configuration_utils", "diffusers.loaders")
    methods_by_name: Dict[str, Set[str]] = {}
    for key in components:
        for base in index.mro(key):
            if index.classes[base].module.startswith(generic):
                continue
            for name, fkey in index.classes[base].methods.items():
                methods_by_name.setdefault(name, set()).add(fkey)

    # Phase 2: what runs in forward.
    roots: List[str] = []
    for key in sorted(components):
        for name in ENTRY_METHODS:
            found = index.method(key, name)
            if found and found not in roots:
                roots.append(found)
    reachable: Dict[str, str] = {}  # function -> the function that reaches it ("" for a root)
    sites: Set[Site] = set()
    todo2 = [(root, "") for root in roots]
    while todo2:
        fkey, parent = todo2.pop()
        if fkey in reachable or fkey not in index.functions:
            continue
        reachable[fkey] = parent
        via = fkey
        function = index.functions[fkey]
        module, node = function.module, function.node
        decorators = getattr(node, "decorator_list", [])
        for decorator in decorators:  # its wrapper runs at call time: its sites belong to this function
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            found = index._resolve_expr(module, target)
            if found in index.functions:
                sites.update(_sites_in(index, diffusers_root, found, fkey, nested_only=True, via=parent))
        body = [n for n in ast.iter_child_nodes(node) if n not in decorators]
        sites.update(_sites_in(index, diffusers_root, fkey, fkey, nested_only=False, via=parent))
        called = {id(call.func) for part in body for call in _calls(part)}
        for part in body:
            for expr in _names(part):
                found = index._resolve_expr(module, expr)
                if found == DEPRECATE:
                    continue  # a site itself (the call is reported where it is made), not code to follow
                if found in index.functions:  # called, or passed on (to checkpointing, a hook)
                    todo2.append((found, via))
                elif found in index.classes and id(expr) in called:  # built in forward: constructed, then run
                    for name in ("__new__", "__init__", *ENTRY_METHODS):
                        method = index.method(found, name)
                        if method:
                            todo2.append((method, via))
            for call in _calls(part):
                func = call.func
                if not isinstance(func, ast.Attribute):
                    continue
                owner = func.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls") and function.cls:
                    found = index.method(function.cls, func.attr)
                    if found:
                        todo2.append((found, via))
                        continue
                if (
                    isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
                    and function.cls
                ):
                    found = index.method(function.cls, func.attr, skip_first=True)
                    if found:
                        todo2.append((found, via))
                    continue
                if isinstance(owner, ast.Name) and index.module_of(module, owner.id):
                    continue  # module.function: resolved above through _names
                for found in methods_by_name.get(func.attr, ()):  # obj.method(): by name, among components
                    todo2.append((found, via))

    forward = {site for site in sites}
    # Sites in transformer modules that compiled forward code does not reach (construction time,
    # ``if not torch.compiler.is_compiling():`` branches): listed too, so a test can insist each is
    # accounted for.
    global _LIVE_ONLY
    elsewhere: Set[Site] = set()
    _LIVE_ONLY = False
    try:
        for fkey, function in index.functions.items():
            if function.module.startswith(prefix):
                elsewhere.update(_sites_in(index, diffusers_root, fkey, fkey, nested_only=False, via=""))
    finally:
        _LIVE_ONLY = True
    on_forward = {(f.file, f.line) for f in forward}
    elsewhere = {s for s in elsewhere if (s.file, s.line) not in on_forward}
    return Inventory(sorted(forward), sorted(elsewhere), set(reachable), roots)


def _sites_in(index: _Index, root: str, fkey: str, owner: str, nested_only: bool, via: str) -> Set[Site]:
    """The graph-breaking calls inside ``fkey``, attributed to ``owner`` (``nested_only``: inside its nested defs,
    the part of a decorator that runs at call time)."""
    function = index.functions[fkey]
    path = os.path.relpath(index.files[function.module], root).replace(os.sep, "/")
    found: Set[Site] = set()
    scopes: List[ast.AST] = [function.node]
    if nested_only:
        scopes = [n for n in ast.walk(function.node) if n is not function.node
                  and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    seen: Set[int] = set()
    for scope in scopes:
        for call in _calls(scope):
            if id(call) in seen:
                continue
            seen.add(id(call))
            kind = site_call(index, function.module, call)
            if kind:
                found.add(Site(path, call.lineno, owner, kind, via))
    return found


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--why", action="store_true", help="show a call chain that reaches each site")
    args = parser.parse_args(argv)
    inventory = scan()
    if args.json:
        print(json.dumps({"forward": [dataclasses.asdict(site) for site in inventory.sites],
                          "elsewhere": [dataclasses.asdict(site) for site in inventory.elsewhere]}, indent=1))
        return 0
    print(f"{len(inventory.roots)} forward/__call__ roots, {len(inventory.reachable)} reachable functions, "
          f"{len(inventory.sites)} sites reachable from forward, {len(inventory.elsewhere)} elsewhere")
    for title, sites in (("reachable from forward", inventory.sites), ("not reached from forward", inventory.elsewhere)):
        print(f"-- {title}")
        for site in sites:
            print(f"{site.file}:{site.line}  {site.call:<15} {site.function}")
            if args.why:
                print(f"      via {site.via or '(root)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
