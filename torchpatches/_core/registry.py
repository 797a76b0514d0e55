"""The registry: which patches exist, which are wanted, their gates, and when their targets are patched.

Patch files only declare (:mod:`torchpatches._core.declare`); each target's moves (locate, verify, swap,
rebind aliases, revert) live in :mod:`torchpatches._core.slot`; what ``status()`` says is worked out by
:func:`torchpatches._core.status.summarise`. All mutation happens under one re-entrant lock.
"""
from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from .declare import Patch
from .import_hooks import is_imported, missing_submodule, not_installed_reason, on_every_load
from .slot import SkipTarget, Slot, verify_dependency
from .status import PatchState, PatchStatus, Status, TargetStatus, summarise

logger = logging.getLogger("torchpatches")

__all__ = ["Registry"]

class _Entry:
    def __init__(self, patch: Patch) -> None:
        self.patch = patch
        lazy = patch.lazy_targets
        #: The module whose import builds the patch's lazy target table; None once built (or not lazy).
        self.table_waits_for: Optional[str] = None if lazy is None or patch.targets_built else lazy.module
        self.table_error: Optional[str] = None  # why the lazy table did not build
        self.slots = [] if self.table_waits_for else [Slot(patch, target) for target in patch.targets]
        self.wanted = False
        self.off_reason = "not applied yet"
        self.gate_reason: Optional[str] = None
        self.early_gated = False  # gate_reason says a required package is not installed (re-checked)


class Registry:
    """Every known patch and its state."""

    def __init__(self, patches: Iterable[Patch], load_errors: Optional[Mapping[str, str]] = None,
                 load_skipped: Optional[Mapping[str, str]] = None) -> None:
        self._lock = threading.RLock()
        self._entries: Dict[str, _Entry] = {}
        self._load_errors: Dict[str, str] = dict(load_errors or {})
        self._load_skipped: Dict[str, str] = dict(load_skipped or {})  # patch files needing a missing package
        self._watched: Set[str] = set()  # target modules whose every load we follow
        for patch in patches:
            if patch.name in self._entries or patch.name in self._load_errors:
                raise ValueError(f"two patches are named {patch.name!r}")
            self._entries[patch.name] = _Entry(patch)

    # ---- public operations ------------------------------------------------------------------

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self._entries)

    def resolve_names(self, names: Optional[Iterable[str]]) -> Tuple[str, ...]:
        """Validate patch names (None means all): a str or an iterable of str. Unknown names, and
        anything that is not a patch name at all (bytes, numbers, None, nested lists, ""), raise
        ValueError naming them, before anything changes."""
        if names is None:
            return self.names
        if isinstance(names, str):
            names = (names,)
        elif isinstance(names, (bytes, bytearray)) or not _is_iterable(names):
            raise ValueError(f"patch names must be a str or an iterable of str, got {type(names).__name__} {names!r}")
        names = tuple(names)
        wrong = [name for name in names if not isinstance(name, str) or not name.strip()]
        if wrong:
            raise ValueError(
                "each patch name must be a non-empty str, got "
                + ", ".join(f"{type(name).__name__} {name!r}" for name in wrong)
            )
        chosen = tuple(dict.fromkeys(name.strip().lower() for name in names))
        unknown = [name for name in chosen if name not in self._entries]
        if unknown:
            raise ValueError(
                f"unknown patch name(s) {', '.join(map(repr, unknown))}; known patches: {', '.join(self.names)}"
            )
        return chosen

    def apply(self, names: Optional[Iterable[str]] = None) -> None:
        with self._lock:
            for name in self.resolve_names(names):
                self._apply_entry(self._entries[name])

    def revert(self, names: Optional[Iterable[str]] = None, reason: str = "reverted by torchpatches.revert()") -> None:
        """Turn the patches off (also before they ever applied: TORCHPATCHES_DISABLE); ``reason`` is reported."""
        with self._lock:
            for name in self.resolve_names(names):
                self._revert_entry(self._entries[name], reason)

    def is_wanted(self, name: str) -> bool:
        return self._entries[name].wanted

    def wanted(self) -> Dict[str, Optional[str]]:
        """Patch name → None if it is wanted on, else the reason it is off (for :meth:`restore`)."""
        with self._lock:
            return {name: None if entry.wanted else entry.off_reason for name, entry in self._entries.items()}

    def restore(self, wanted: Mapping[str, Optional[str]]) -> None:
        """Turn patches on and off as :meth:`wanted` said, with the off-reasons it recorded."""
        with self._lock:
            for name, off_reason in wanted.items():
                entry = self._entries[name]
                if off_reason is None:
                    self._apply_entry(entry)
                elif entry.wanted or entry.off_reason != off_reason:
                    self._revert_entry(entry, off_reason)

    def applied_names(self) -> Tuple[str, ...]:
        """The patches with a target swapped in right now; cheap (no status report), for callers that key
        work on what is bound (``cuda_graphs``: a graph records the code that ran when it was captured)."""
        return tuple(name for name, entry in self._entries.items()
                     if any(slot.state is PatchState.APPLIED for slot in entry.slots))

    def status(self) -> Status:
        with self._lock:
            self._catch_up()
            broken = [
                PatchStatus(name, PatchState.FAILED, f"patch module did not load: {error}", "", ())
                for name, error in self._load_errors.items()
            ] + [PatchStatus(name, PatchState.SKIPPED, reason, "", ()) for name, reason in self._load_skipped.items()]
            return Status([self._status_of(entry) for entry in self._entries.values()] + broken)

    # ---- applying ---------------------------------------------------------------------------

    def _apply_entry(self, entry: _Entry) -> None:
        entry.wanted = True
        self._follow_loads(entry)
        entry.gate_reason = self._early_gate(entry.patch)
        entry.early_gated = entry.gate_reason is not None
        if entry.early_gated:
            return  # the target modules stay watched: a package installed later still gets patched
        self._build_table(entry)
        for slot in entry.slots:
            self._converge(entry, slot)

    def _build_table(self, entry: _Entry, loading: Optional[str] = None) -> bool:
        """Build a lazy target table once its module is imported (``loading``: its body just ran, so it
        does not count as imported yet). True when the slots were made by this call."""
        module_name = entry.table_waits_for
        if module_name is None or (module_name != loading and not is_imported(module_name)):
            return False
        entry.table_waits_for = None
        try:
            targets = entry.patch.targets
        except Exception as error:  # a broken table fails its patch, never the user's import
            entry.table_error = f"its target table did not build: {type(error).__name__}: {error}"
            logger.warning("torchpatches: patch %s: %s", entry.patch.name, entry.table_error, exc_info=True)
            return False
        entry.slots = [Slot(entry.patch, target) for target in targets]
        if entry.wanted:
            self._follow_loads(entry)
        else:
            for slot in entry.slots:
                slot.set(PatchState.DISABLED, entry.off_reason)
        return True

    def _converge(self, entry: _Entry, slot: Slot, module: Any = None) -> None:
        """For a wanted patch: make this slot's replacement what the target holds, if it can be.

        Applied and still bound: nothing to do. Applied but rebound since (a reload of the module ran
        its body again, or someone else bound something): look again, as on a first import.
        """
        if slot.state is PatchState.APPLIED:
            if slot.is_in_effect():
                return
            slot.drop_token()
        module_name = slot.target.module
        if module is None and is_imported(module_name):
            module = sys.modules[module_name]
        if module is not None:
            self._apply_slot(entry, slot, module)
            return
        missing = missing_submodule(module_name)  # e.g. a model module an older diffusers does not have
        if missing is not None:
            slot.set(PatchState.SKIPPED, missing)
            return
        slot.set(PatchState.PENDING, f"waits for {module_name} to be imported")

    def _follow_loads(self, entry: _Entry) -> None:
        """Watch every load of each target module (first import, reload, re-import) once per registry.

        The hook holds the registry weakly: a registry replaced by ``reload(torchpatches)`` stops acting.
        """
        me = weakref.ref(self)
        modules = [slot.target.module for slot in entry.slots] + [entry.table_waits_for or ""]
        modules += _verified_modules(entry.patch)  # a target may load while a module it verifies is half-run
        for name in filter(None, modules):
            if name not in self._watched:
                self._watched.add(name)
                on_every_load(name, lambda module, n=name: _call_if_alive(me, n, module))

    def _on_module_load(self, module_name: str, module: Any) -> None:
        """Right after the body of ``module_name`` ran (it is still marked as initializing then)."""
        with self._lock:
            for entry in self._entries.values():
                verified = module_name in _verified_modules(entry.patch)
                concerned = verified or entry.table_waits_for == module_name or any(
                    slot.target.module == module_name for slot in entry.slots)
                if not entry.wanted or not concerned or self._still_early_gated(entry):
                    continue
                built = self._build_table(entry, loading=module_name)
                for slot in entry.slots:
                    if slot.target.module == module_name:
                        self._converge(entry, slot, module)
                    elif built or (verified and slot.state is PatchState.PENDING
                                   and is_imported(slot.target.module)):
                        self._converge(entry, slot)

    def _still_early_gated(self, entry: _Entry) -> bool:
        """Judge the early gate again if it said no (a package may have been installed since)."""
        if entry.early_gated:
            entry.gate_reason = self._early_gate(entry.patch)
            entry.early_gated = entry.gate_reason is not None
        return entry.early_gated

    def _catch_up(self) -> None:
        """Before reporting: targets whose module arrived without the import hook (a stub put in
        ``sys.modules`` by hand, a class loader), packages installed since the early gate said no, and
        lazy tables whose module is imported (also of patches that are off: their targets are listed)."""
        for entry in self._entries.values():
            if not entry.wanted:
                self._build_table(entry)
                continue
            was_gated = entry.early_gated
            if self._still_early_gated(entry):
                continue
            if self._build_table(entry) or was_gated:
                for slot in entry.slots:
                    if slot.state is not PatchState.APPLIED:
                        self._converge(entry, slot)
                continue
            for slot in entry.slots:
                if slot.state is PatchState.PENDING and (
                    is_imported(slot.target.module) or missing_submodule(slot.target.module) is not None
                ):
                    self._converge(entry, slot)

    def _apply_slot(self, entry: _Entry, slot: Slot, module: Any) -> None:
        if not self._passes_full_gate(entry):
            return
        try:
            slot.locate(module)
        except Exception as skip:  # noqa: BLE001 - SkipTarget, or anything verifying raised: skip, never raise
            reason = str(skip) if isinstance(skip, SkipTarget) else (
                f"cannot verify {slot.target.path} ({type(skip).__name__}: {skip}); not patching blindly")
            slot.set(PatchState.SKIPPED, reason)
            logger.info("torchpatches: %s skipped %s: %s", entry.patch.name, slot.target.path, reason)
            return
        try:
            slot.swap_in()
        except Exception as error:  # the original stays in place; other patches carry on
            slot.set(PatchState.FAILED, f"{slot.target.path}: {type(error).__name__}: {error}")
            logger.warning("torchpatches: patch %s failed on %s", entry.patch.name, slot.target.path, exc_info=True)
            return
        slot.set(PatchState.APPLIED, f"{slot.target.path} replaced")
        slot.watch_alias_modules(lambda module_name, e=entry, s=slot: self._on_alias_module(e, s, module_name))

    def _on_alias_module(self, entry: _Entry, slot: Slot, module_name: str) -> None:
        with self._lock:
            slot.watched_alias_modules.discard(module_name)
            if entry.wanted and slot.state is PatchState.APPLIED:
                slot.rebind_aliases(slot.original, slot.replacement)

    @staticmethod
    def _early_gate(patch: Patch) -> Optional[str]:
        """What can be judged without importing anything: are the required packages installed?

        Versions are checked when a target's module loads (then the package is imported and its
        ``__version__`` is at hand); until then ``status()`` previews the version gate. This keeps
        ``packaging`` and distribution metadata off the import path of torchpatches.
        """
        for module, spec in patch.requires.items():
            missing = not_installed_reason(module)
            if missing is not None:
                return f"{missing} (needs {module}{spec})"
        return None

    @staticmethod
    def _full_gate(patch: Patch) -> Optional[str]:
        """Why the patch must be skipped now that a target's package is imported, or None: the
        version gate, then the fingerprints of the code it ``verifies``, then its ``precondition``."""
        from . import gates as _gates

        reason = _gates.check_requirements(patch.requires)
        if reason is not None:
            return reason
        if patch.inductor_cache_key:
            from . import cache_key as _cache_key

            reason = _cache_key.lowering_elsewhere()
            if reason is not None:
                return reason
        for path, fingerprints in patch.verifies.items():
            reason = verify_dependency(path, fingerprints)
            if reason is not None:
                return reason
        if patch.precondition is None:
            return None
        try:
            return patch.precondition()
        except Exception as error:
            return f"precondition raised {type(error).__name__}: {error}"

    def _passes_full_gate(self, entry: _Entry) -> bool:
        """Judge the full gate and record the verdict in ``entry.gate_reason`` (``status()`` reports it)."""
        entry.gate_reason = self._full_gate(entry.patch)
        return entry.gate_reason is None

    # ---- reverting --------------------------------------------------------------------------

    def _revert_entry(self, entry: _Entry, reason: str) -> None:
        entry.wanted = False
        entry.off_reason = reason
        for slot in entry.slots:
            # Also when this slot does not think it is applied: a replacement of ours may be bound
            # (someone put it back after an earlier revert, or another registry made it).
            if slot.state is PatchState.APPLIED or slot.replacement is not None or slot.ours_bound():
                slot.swap_out()
            slot.set(PatchState.DISABLED, reason)

    # ---- reporting --------------------------------------------------------------------------

    def _status_of(self, entry: _Entry) -> PatchStatus:
        if entry.wanted and entry.table_error is not None:
            return PatchStatus(entry.patch.name, PatchState.FAILED, entry.table_error, entry.patch.summary, ())
        targets = tuple(self._target_truth(entry, slot) for slot in entry.slots)
        if not entry.wanted and any(t.state is PatchState.APPLIED for t in targets):
            reason = "; ".join(t.reason for t in targets if t.state is PatchState.APPLIED)
            return PatchStatus(entry.patch.name, PatchState.APPLIED, reason, entry.patch.summary, targets)
        state, reason = summarise(
            targets,
            wanted=entry.wanted,
            off_reason=entry.off_reason,
            gate_reason=entry.gate_reason,
            preview_gate=lambda: _gate_of_imported(entry.patch),
            table_waits_for=entry.table_waits_for,
        )
        if state is PatchState.APPLIED and entry.patch.inductor_cache_key:
            from . import cache_key as _cache_key

            elsewhere = _cache_key.lowering_elsewhere()
            if elsewhere is not None:
                state, reason = PatchState.SKIPPED, elsewhere
        return PatchStatus(entry.patch.name, state, reason, entry.patch.summary, targets)

    @staticmethod
    def _target_truth(entry: _Entry, slot: Slot) -> TargetStatus:
        """The slot's state, checked against what the target holds now."""
        path = slot.target.path
        if slot.state is PatchState.APPLIED and not slot.is_in_effect():
            return TargetStatus(path, PatchState.SKIPPED,
                                f"not in effect: {path} was rebound after torchpatches patched it (someone "
                                "else's patch); torchpatches.apply() patches it again if it is the verified code")
        if not entry.wanted and slot.ours_bound():
            return TargetStatus(path, PatchState.APPLIED,
                                f"{path}: torchpatches' replacement is in place again (someone put it back "
                                "after revert()); torchpatches.revert() takes it out")
        return slot.status()


def _gate_of_imported(patch: Patch) -> Optional[str]:
    """The version gate judged on the required packages imported so far (``status()`` previews it)."""
    from . import gates as _gates

    return _gates.check_requirements({module: spec for module, spec in patch.requires.items() if module in sys.modules})


def _is_iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _call_if_alive(registry_ref: "weakref.ReferenceType[Registry]", module_name: str, module: Any) -> None:
    registry = registry_ref()
    if registry is not None:
        registry._on_module_load(module_name, module)



def _verified_modules(patch: Patch) -> List[str]:
    """The modules of the code a patch ``verifies`` (``module:qualname`` paths)."""
    return [path.partition(":")[0] for path in patch.verifies]
