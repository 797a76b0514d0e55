"""The registry: applies, reverts and reports patches. Patch files only declare (see _declare)."""
from __future__ import annotations

import enum
import importlib
import inspect
import logging
import sys
import threading
from typing import Any, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Set, Tuple

from . import _gates
from ._declare import Patch, Target
from ._import_hooks import is_imported, when_imported

logger = logging.getLogger("torchpatches")

__all__ = ["PatchState", "PatchStatus", "TargetStatus", "Status", "Registry"]


class PatchState(str, enum.Enum):
    APPLIED = "applied"
    SKIPPED = "skipped"
    DISABLED = "disabled"
    FAILED = "failed"
    PENDING = "pending"

    def __str__(self) -> str:
        return self.value


class TargetStatus(NamedTuple):
    path: str
    state: PatchState
    reason: str


class PatchStatus(NamedTuple):
    """One patch as ``status()`` reports it: ``state`` and a human ``reason``."""

    name: str
    state: PatchState
    reason: str
    summary: str
    targets: Tuple[TargetStatus, ...]

    def __str__(self) -> str:
        return f"{self.name}: {self.state.value} — {self.reason}"


class Status(Mapping[str, PatchStatus]):
    """Patch name → :class:`PatchStatus`; ``str()`` is a readable table."""

    def __init__(self, entries: Iterable[PatchStatus]) -> None:
        self._entries = {entry.name: entry for entry in entries}

    def __getitem__(self, name: str) -> PatchStatus:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Status({list(self._entries.values())!r})"

    def __str__(self) -> str:
        rows = [("patch", "state", "reason")] + [
            (entry.name, entry.state.value, entry.reason) for entry in self._entries.values()
        ]
        name_width = max(len(row[0]) for row in rows)
        state_width = max(len(row[1]) for row in rows)
        return "\n".join(
            f"{name:<{name_width}}  {state:<{state_width}}  {reason}".rstrip() for name, state, reason in rows
        )


class _TargetState(enum.Enum):
    WAITING = "waiting"  # module not imported yet
    APPLIED = "applied"
    SKIPPED = "skipped"
    FAILED = "failed"
    IDLE = "idle"  # not applied because the patch is not wanted


class _TargetRecord:
    """Mutable bookkeeping for one target (a plain class: dataclasses are slow to create)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.state = _TargetState.IDLE
        self.reason = ""
        self.owner: Any = None
        self.attribute = ""
        self.original: Any = None
        self.fingerprint = ""  # of the original, as verified when it was located
        self.owned_attribute = True  # False when the original was inherited, so revert deletes ours
        self.replacement: Any = None
        self.built: Tuple[Any, Any] = (_MISSING, None)  # (original, replacement made for it)
        self.token: Optional[str] = None
        self.watching = False
        self.watched_alias_modules: Set[str] = set()


class _SkipTarget(Exception):
    """The target is not what the patch expects: skip it, with this message as the reason."""


class _Entry:
    def __init__(self, patch: Patch) -> None:
        self.patch = patch
        self.records = [_TargetRecord(target) for target in patch.targets]
        self.wanted = False
        self.off_reason = "not applied yet"
        self.gate_reason: Optional[str] = None


_MISSING = object()


class Registry:
    """Every known patch and its state. All mutation happens under one re-entrant lock."""

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
        with self._lock:
            for name in self.resolve_names(names):
                self._revert_entry(self._entries[name], reason)

    def disable(self, names: Iterable[str], reason: str) -> None:
        """Mark patches off before they ever apply (TORCHPATCHES_DISABLE)."""
        self.revert(names, reason)

    def is_wanted(self, name: str) -> bool:
        return self._entries[name].wanted

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
        for record in entry.records:
            if record.state is _TargetState.APPLIED:
                continue
            self._apply_when_imported(entry, record)

    def _apply_when_imported(self, entry: _Entry, record: _TargetRecord) -> None:
        module_name = record.target.module
        if is_imported(module_name):
            self._apply_target(entry, record, sys.modules[module_name])
            return
        record.state = _TargetState.WAITING
        record.reason = f"waits for {module_name} to be imported"
        if not record.watching:
            record.watching = True
            when_imported(module_name, lambda module, e=entry, r=record: self._on_target_module(e, r, module))

    def _on_target_module(self, entry: _Entry, record: _TargetRecord, module: Any) -> None:
        with self._lock:
            record.watching = False
            if entry.wanted and record.state is _TargetState.WAITING:
                self._apply_target(entry, record, module)

    def _apply_target(self, entry: _Entry, record: _TargetRecord, module: Any) -> None:
        if not self._precondition_holds(entry):
            return
        try:
            self._locate_and_verify(record, module)
        except _SkipTarget as skip:
            record.state, record.reason = _TargetState.SKIPPED, str(skip)
            logger.info("torchpatches: %s skipped %s: %s", entry.patch.name, record.target.path, skip)
            return
        try:
            self._swap_in(entry, record)
        except Exception as error:  # the original stays in place; other patches carry on
            record.state = _TargetState.FAILED
            record.reason = f"{record.target.path}: {type(error).__name__}: {error}"
            logger.warning("torchpatches: patch %s failed on %s", entry.patch.name, record.target.path, exc_info=True)
            return
        record.state, record.reason = _TargetState.APPLIED, f"{record.target.path} replaced"
        self._watch_aliases(entry, record)

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

    def _precondition_holds(self, entry: _Entry) -> bool:
        """The full version gate (the target's package is imported now) and the patch's precondition."""
        reason = _gates.check_requirements(entry.patch.requires)
        if reason is None and entry.patch.precondition is not None:
            try:
                reason = entry.patch.precondition()
            except Exception as error:
                reason = f"precondition raised {type(error).__name__}: {error}"
        entry.gate_reason = reason
        return reason is None

    @staticmethod
    def _locate_and_verify(record: _TargetRecord, module: Any) -> None:
        parts = record.target.qualname.split(".")
        owner = module
        for part in parts[:-1]:
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                raise _SkipTarget(f"{record.target.path} not found: no attribute {part!r}")
        attribute = parts[-1]
        own = vars(owner).get(attribute, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        original = own if own is not _MISSING else getattr(owner, attribute, _MISSING)
        if original is _MISSING:
            raise _SkipTarget(f"{record.target.path} not found: no attribute {attribute!r}")
        try:
            found = _gates.fingerprint(original)
        except (OSError, TypeError) as error:
            raise _SkipTarget(f"cannot fingerprint {record.target.path} ({error}); not patching blindly") from None
        if found not in record.target.fingerprints:
            raise _SkipTarget(
                f"{record.target.path} differs from the verified version(s) "
                f"(fingerprint {found}, expected {' or '.join(sorted(record.target.fingerprints))})"
            )
        record.owner, record.attribute, record.original = owner, attribute, original
        record.fingerprint = found
        record.owned_attribute = own is not _MISSING

    def _swap_in(self, entry: _Entry, record: _TargetRecord) -> None:
        replacement = self._replacement_for(record)
        setattr(record.owner, record.attribute, replacement)
        record.replacement = replacement
        try:
            self._rebind_aliases(record, record.original, replacement)
            if entry.patch.inductor_cache_key:
                record.token = self._add_cache_token(entry, record)
        except Exception:
            self._swap_out(record)
            raise

    @staticmethod
    def _replacement_for(record: _TargetRecord) -> Any:
        """Build the replacement once per original: re-applying then yields the same object, so code
        compiled while the patch was on stays valid (Dynamo guards on function identity)."""
        built_for, replacement = record.built
        if built_for is not record.original:
            replacement = record.target.make_replacement(record.original)
            record.built = (record.original, replacement)
        return replacement

    @staticmethod
    def _add_cache_token(entry: _Entry, record: _TargetRecord) -> str:
        from . import _cache_key

        token = cache_token(entry.patch, record.target, record.fingerprint)
        _cache_key.add_token(token)
        return token

    def _watch_aliases(self, entry: _Entry, record: _TargetRecord) -> None:
        for alias in record.target.aliases:
            module_name = alias.split(":", 1)[0]
            if not is_imported(module_name) and module_name not in record.watched_alias_modules:
                record.watched_alias_modules.add(module_name)
                when_imported(
                    module_name, lambda module, e=entry, r=record, m=module_name: self._on_alias_module(e, r, m)
                )

    def _on_alias_module(self, entry: _Entry, record: _TargetRecord, module_name: str) -> None:
        with self._lock:
            record.watched_alias_modules.discard(module_name)
            if entry.wanted and record.state is _TargetState.APPLIED:
                self._rebind_aliases(record, record.original, record.replacement)

    @staticmethod
    def _rebind_aliases(record: _TargetRecord, old: Any, new: Any) -> None:
        """Point every imported alias site that holds ``old`` at ``new``; leave others' changes alone."""
        for alias in record.target.aliases:
            module_name, attribute = alias.split(":", 1)
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, attribute, _MISSING) is old:
                setattr(module, attribute, new)

    # ---- reverting --------------------------------------------------------------------------

    def _revert_entry(self, entry: _Entry, reason: str) -> None:
        entry.wanted = False
        entry.off_reason = reason
        for record in entry.records:
            if record.state is _TargetState.APPLIED:
                self._swap_out(record)
            record.state, record.reason = _TargetState.IDLE, reason

    def _swap_out(self, record: _TargetRecord) -> None:
        current = vars(record.owner).get(record.attribute, _MISSING)
        if current is record.replacement:
            if record.owned_attribute:
                setattr(record.owner, record.attribute, record.original)
            else:
                delattr(record.owner, record.attribute)
        else:
            logger.warning(
                "torchpatches: %s was replaced again by someone else after it was patched; leaving that in place",
                record.target.path,
            )
        self._rebind_aliases(record, record.replacement, record.original)
        if record.token is not None:
            from . import _cache_key

            _cache_key.remove_token(record.token)
            record.token = None
        record.replacement = None

    # ---- reporting --------------------------------------------------------------------------

    def _status_of(self, entry: _Entry) -> PatchStatus:
        targets = tuple(
            TargetStatus(record.target.path, _TARGET_TO_PATCH_STATE[record.state], record.reason)
            for record in entry.records
        )
        state, reason = self._summarise(entry)
        return PatchStatus(entry.patch.name, state, reason, entry.patch.summary, targets)

    @staticmethod
    def _summarise(entry: _Entry) -> Tuple[PatchState, str]:
        if not entry.wanted:
            return PatchState.DISABLED, entry.off_reason
        if entry.gate_reason is not None:
            return PatchState.SKIPPED, entry.gate_reason
        by_state: Dict[_TargetState, List[_TargetRecord]] = {}
        for record in entry.records:
            by_state.setdefault(record.state, []).append(record)
        failed = by_state.get(_TargetState.FAILED, [])
        applied = by_state.get(_TargetState.APPLIED, [])
        waiting = by_state.get(_TargetState.WAITING, [])
        skipped = by_state.get(_TargetState.SKIPPED, [])
        if failed:
            return PatchState.FAILED, "; ".join(r.reason for r in failed)
        if applied:
            parts = [f"{len(applied)}/{len(entry.records)} target(s) patched"]
            if waiting:
                parts.append(f"waiting for {_modules_phrase(waiting)}")
            parts += [r.reason for r in skipped]
            return PatchState.APPLIED, "; ".join(parts)
        if waiting:
            previewed = _gates.check_requirements(
                {module: spec for module, spec in entry.patch.requires.items() if module in sys.modules}
            )
            if previewed is not None:
                return PatchState.SKIPPED, previewed
            notes = [f"waits for {_modules_phrase(waiting)} to be imported"] + [r.reason for r in skipped]
            return PatchState.PENDING, "; ".join(notes)
        if skipped:
            return PatchState.SKIPPED, "; ".join(r.reason for r in skipped)
        return PatchState.PENDING, "not attempted yet"


def cache_token(patch: Patch, target: Target, original_fingerprint: str) -> str:
    """The text an Inductor patch adds to the compile cache key while it is applied.

    It names the original it replaced and the code of the patch itself (the module that builds
    the replacement), so neither a different torch nor a newer torchpatches is served artifacts
    compiled under the other.
    """
    patch_module = inspect.getmodule(target.make_replacement)
    patch_code = _gates.fingerprint(patch_module) if patch_module is not None else "unknown"
    return f"torchpatches:{patch.name}@{original_fingerprint}.{patch_code}"


def _modules_phrase(records: List[_TargetRecord], shown: int = 2) -> str:
    modules = sorted({record.target.module for record in records})
    if len(modules) <= shown:
        return " and ".join(modules)
    return f"{', '.join(modules[:shown])} and {len(modules) - shown} more"


_TARGET_TO_PATCH_STATE = {
    _TargetState.WAITING: PatchState.PENDING,
    _TargetState.APPLIED: PatchState.APPLIED,
    _TargetState.SKIPPED: PatchState.SKIPPED,
    _TargetState.FAILED: PatchState.FAILED,
    _TargetState.IDLE: PatchState.DISABLED,
}
