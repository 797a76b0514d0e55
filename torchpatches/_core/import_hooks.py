"""Run callbacks right after a module is imported, without importing anything eagerly.

``when_imported(name, cb)`` fires once, at the first import; ``on_every_load(name, cb)`` fires after
every load of the module's body: the first import, ``importlib.reload(module)`` and an import after
``del sys.modules[name]`` (all go through ``sys.meta_path``), so a patch can follow a reload.

A finder at the front of ``sys.meta_path`` notices imports of watched module names, asks the
other finders for the real spec and wraps that spec's loader instance so that, once the module
body has run, the callbacks fire. The module object, its ``__loader__`` and ``__spec__`` stay
the genuine ones (only an instance attribute on the loader is added for the duration of the
import), so ``inspect.getsource`` and ``importlib.resources`` behave as before.

Callbacks run in the importing thread, inside the module's import lock, and the registry's
callbacks take the registry lock. A thread that holds the registry lock and imports that same
module (only ``make_replacement`` code could) while another thread is importing it could deadlock;
replacement builders therefore import only their own helper modules, never patch targets.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence

logger = logging.getLogger("torchpatches")

Callback = Callable[[object], None]

__all__ = ["when_imported", "on_every_load", "is_imported", "missing_submodule", "not_installed_reason"]

_lock = threading.RLock()
_callbacks: Dict[str, List[Callback]] = {}
_every_load: Dict[str, List[Callback]] = {}
_resolving = threading.local()


def not_installed_reason(module: str) -> Optional[str]:
    """None if top-level ``module`` is importable (or imported), else a sentence saying why not.

    Never imports it (a few stat calls). Never raises: an import-policy finder on ``sys.meta_path`` may
    raise anything from ``find_spec`` (PermissionError, RuntimeError...), and that must not break
    ``import torchpatches``.
    """
    if module in sys.modules:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except Exception as error:  # noqa: BLE001 - see the docstring
        return f"cannot tell whether {module} is installed: finding it raised {type(error).__name__}: {error}"
    return None if found else f"{module} is not installed"


def missing_submodule(name: str) -> Optional[str]:
    """Why ``name`` cannot be imported, when its parent package is imported and has no such module.

    None when that cannot be told without importing anything (the parent is not imported, or is not
    a plain package: a stub, a namespace without a path list) or when the module is there. Looks only
    in the parent's ``__path__`` (``PathFinder``, the file system and zip files; no ``sys.meta_path``
    finder is asked, so no import hook or policy finder runs). A module that a custom finder provides
    is still patched when it is imported: its load is followed either way.
    """
    parent_name, _, _ = name.rpartition(".")
    if not parent_name or not is_imported(parent_name):
        return None
    try:
        parent = sys.modules[parent_name]
        path = parent.__dict__.get("__path__")
        if not isinstance(path, list) or not all(isinstance(entry, str) for entry in path):
            return None
        if importlib.machinery.PathFinder.find_spec(name, path) is not None:
            return None
        top = sys.modules.get(name.split(".", 1)[0])
        version = getattr(top, "__version__", None)
    except Exception:  # noqa: BLE001 - a stub or an odd path entry: we cannot tell, so keep waiting
        return None
    where = f"{name.split('.', 1)[0]} {version}" if isinstance(version, str) else "the installed package"
    return f"{name} does not exist in {where}"


def is_imported(name: str) -> bool:
    """True when ``name`` is in ``sys.modules`` and its body has finished running.

    Stubs count as imported (a ``MagicMock`` or a module made by hand and put in ``sys.modules``):
    only the import system's own flag, ``__spec__._initializing is True``, means "still running".
    """
    module = sys.modules.get(name)
    if module is None:
        return False
    try:
        spec = getattr(module, "__spec__", None)
        return getattr(spec, "_initializing", False) is not True
    except Exception:  # noqa: BLE001 - a stub whose attribute access raises: its body is not ours to wait for
        return True


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` now if ``name`` is imported, else right after it is."""
    with _lock:
        if not is_imported(name):
            _callbacks.setdefault(name, []).append(callback)
            _install_finder()
            return
    _run_callbacks(name, sys.modules[name], [callback])


def on_every_load(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` after every load of ``name`` from now on (not for a load already done).

    Registering the same callback twice keeps one.
    """
    with _lock:
        callbacks = _every_load.setdefault(name, [])
        if callback not in callbacks:
            callbacks.append(callback)
        _install_finder()


def _install_finder() -> None:
    if not any(isinstance(finder, _PostImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def _run_callbacks(name: str, module: object, callbacks: Sequence[Callback]) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception:  # a patch must never break the user's import
            logger.exception("torchpatches: post-import callback for %s failed", name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        with _lock:
            if fullname not in _callbacks and fullname not in _every_load:
                return None
        resolving = _resolving.__dict__.setdefault("names", set())
        if fullname in resolving:  # our own query to the other finders, for this name
            return None
        spec = self._spec_from_other_finders(fullname, path, target, resolving)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        if isinstance(spec.loader, type):
            # BuiltinImporter / FrozenImporter are classes used as loaders: an attribute set on them
            # would hook every builtin module. Leave the import alone; the registry notices the
            # module in sys.modules the next time it is asked (status, apply).
            return spec
        _wrap_exec_module(spec.loader, fullname)
        return spec

    @staticmethod
    def _spec_from_other_finders(fullname, path, target, resolving) -> Optional[importlib.machinery.ModuleSpec]:
        # Only this name is skipped while we ask: a finder that imports other watched modules
        # from its find_spec still gets them hooked. Exceptions from other finders propagate: the
        # import would raise them without us too.
        resolving.add(fullname)
        try:
            for finder in sys.meta_path:
                if isinstance(finder, _PostImportFinder) or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
            return None
        finally:
            resolving.discard(fullname)


def _wrap_exec_module(loader, fullname: str) -> None:
    original_exec = loader.exec_module
    had_instance_attr = "exec_module" in getattr(loader, "__dict__", {})

    def exec_module(module):
        try:
            original_exec(module)
        finally:
            _unwrap(loader, original_exec, had_instance_attr)
        with _lock:
            callbacks = _callbacks.pop(fullname, []) + list(_every_load.get(fullname, ()))
        _run_callbacks(fullname, module, callbacks)

    try:
        loader.exec_module = exec_module
    except (AttributeError, TypeError):  # loaders with __slots__: leave the import alone
        logger.debug("torchpatches: cannot hook the loader of %s", fullname)


def _unwrap(loader, original_exec, had_instance_attr: bool) -> None:
    if had_instance_attr:
        loader.exec_module = original_exec
    else:
        try:
            del loader.exec_module
        except AttributeError:
            pass
