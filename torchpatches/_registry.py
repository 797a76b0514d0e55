"""The registry: which patches exist, which are wanted, their gates, and when their targets are patched.

Patch files only declare (:mod:`torchpatches._declare`); each target's moves (locate, verify, swap,
rebind aliases, revert) live in :mod:`torchpatches._slot`; what ``status()`` says is worked out by
:func:`torchpatches._status.summarise`. All mutation happens under one re-entrant lock.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from . import _gates
from ._declare import Patch
from ._import_hooks import is_imported, when_imported
from ._slot import SkipTarget, Slot, verify_dependency
from ._status import PatchState, PatchStatus, Status, summarise

logger = logging.getLogger("torchpatches")

__all__ = ["Registry"]

class _Entry:
    def __init__(self, patch: Patch) -> None:
        self.patch = patch
        self.slots = [Slot(patch, target) for target in patch.targets]
        self.wanted = False
        self.off_reason = "not applied yet"
        self.gate_reason: Optional[str] = None


class Registry:
    """Every known patch and its state."""

    def __init__(self, patches: Iterable[Patch], load_errors: Optional[Mapping[str, str]] = None) -> None:
        self._lock = threading.RLock()
        self._entries: Dict[str, _Entry] = {}
        self._load_errors: Dict[str, str] = dict(load_errors or {})
        for patch in patches:
            if patch.name in self._entries or patch.name in self._load_errors:
                raise ValueError(f"two patches are named {patch.name!r}")
            self._entries[patch.name] = _Entry(patch)

    # ---- public operations ------------------------------------------------------------------

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self._entries)

    def resolve_names(self, names: Optional[Iterable[str]]) -> Tuple[str, ...]:
        """Validate patch names (None means all); unknown names raise ValueError naming them."""
        if names is None:
            return self.names
        if isinstance(names, str):
            names = (names,)
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

    def status(self) -> Status:
        with self._lock:
            broken = [
                PatchStatus(name, PatchState.FAILED, f"patch module did not load: {error}", "", ())
                for name, error in self._load_errors.items()
            ]
            return Status([self._status_of(entry) for entry in self._entries.values()] + broken)

    # ---- applying ---------------------------------------------------------------------------

    def _apply_entry(self, entry: _Entry) -> None:
        entry.wanted = True
        entry.gate_reason = self._early_gate(entry.patch)
        if entry.gate_reason is not None:
            return
        for slot in entry.slots:
            if slot.state is not PatchState.APPLIED:
                self._apply_when_imported(entry, slot)

    def _apply_when_imported(self, entry: _Entry, slot: Slot) -> None:
        module_name = slot.target.module
        if is_imported(module_name):
            self._apply_slot(entry, slot, sys.modules[module_name])
            return
        slot.set(PatchState.PENDING, f"waits for {module_name} to be imported")
        if not slot.watching:
            slot.watching = True
            when_imported(module_name, lambda module, e=entry, s=slot: self._on_target_module(e, s, module))

    def _on_target_module(self, entry: _Entry, slot: Slot, module: Any) -> None:
        with self._lock:
            slot.watching = False
            if entry.wanted and slot.state is PatchState.PENDING:
                self._apply_slot(entry, slot, module)

    def _apply_slot(self, entry: _Entry, slot: Slot, module: Any) -> None:
        if not self._passes_full_gate(entry):
            return
        try:
            slot.locate(module)
        except SkipTarget as skip:
            slot.set(PatchState.SKIPPED, str(skip))
            logger.info("torchpatches: %s skipped %s: %s", entry.patch.name, slot.target.path, skip)
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
            if not _gates.is_installed(module):
                return f"{module} is not installed (needs {module}{spec})"
        return None

    @staticmethod
    def _full_gate(patch: Patch) -> Optional[str]:
        """Why the patch must be skipped now that a target's package is imported, or None: the
        version gate, then the fingerprints of the code it ``verifies``, then its ``precondition``."""
        reason = _gates.check_requirements(patch.requires)
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
            if slot.state is PatchState.APPLIED:
                slot.swap_out()
            slot.set(PatchState.DISABLED, reason)

    # ---- reporting --------------------------------------------------------------------------

    def _status_of(self, entry: _Entry) -> PatchStatus:
        targets = tuple(slot.status() for slot in entry.slots)
        state, reason = summarise(
            targets,
            wanted=entry.wanted,
            off_reason=entry.off_reason,
            gate_reason=entry.gate_reason,
            preview_gate=lambda: _gates.check_requirements(
                {module: spec for module, spec in entry.patch.requires.items() if module in sys.modules}
            ),
        )
        return PatchStatus(entry.patch.name, state, reason, entry.patch.summary, targets)
