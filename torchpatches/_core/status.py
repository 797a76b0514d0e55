"""What ``status()`` reports: one state enum, the report types, and the summary of a patch's targets.

A patch and each of its targets are in one of the five :class:`PatchState` states; a target is
``disabled`` while its patch is not wanted and ``pending`` while its module is not imported yet.
:func:`summarise` turns the targets' states (and whether the patch is wanted and passed its gate)
into the patch's one state and reason; it is a pure function, tested from a table of cases.
"""
from __future__ import annotations

import enum
from typing import Callable, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

__all__ = ["PatchState", "TargetStatus", "PatchStatus", "Status", "summarise"]


class PatchState(str, enum.Enum):
    APPLIED = "applied"
    SKIPPED = "skipped"  # not what the patch was verified against (version, fingerprint, missing attribute)
    DISABLED = "disabled"  # not wanted: TORCHPATCHES_DISABLE, revert(), disabled()
    FAILED = "failed"  # raised while applying; the original stays in place
    PENDING = "pending"  # waits for the target's module to be imported

    def __str__(self) -> str:
        return self.value


class TargetStatus(NamedTuple):
    path: str
    state: PatchState
    reason: str

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]


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


def _no_gate() -> Optional[str]:
    return None


def summarise(
    targets: Sequence[TargetStatus],
    *,
    wanted: bool,
    off_reason: str,
    gate_reason: Optional[str],
    preview_gate: Callable[[], Optional[str]] = _no_gate,
    table_waits_for: Optional[str] = None,
) -> Tuple[PatchState, str]:
    """The state and reason of a patch from the states of its targets.

    ``wanted``/``off_reason``: whether the patch should be on, and why not. ``gate_reason``: why
    its version gate or a verified dependency refused it, once a target's module loaded.
    ``preview_gate()`` judges the version gate from the packages imported so far; it is asked only
    while every target still waits for its module (it may import ``packaging``, so not eagerly).
    ``table_waits_for``: the module whose import builds the patch's lazy target table (then there are
    no targets yet, and the patch waits for that module).
    """
    if not wanted:
        return PatchState.DISABLED, off_reason
    if gate_reason is not None:
        return PatchState.SKIPPED, gate_reason
    failed = [t for t in targets if t.state is PatchState.FAILED]
    applied = [t for t in targets if t.state is PatchState.APPLIED]
    waiting = [t for t in targets if t.state is PatchState.PENDING]
    skipped = [t for t in targets if t.state is PatchState.SKIPPED]
    if failed:
        return PatchState.FAILED, "; ".join(t.reason for t in failed)
    if applied:
        parts = [f"{len(applied)}/{len(targets)} target(s) patched"]
        if waiting:
            parts.append(f"waiting for {_modules_phrase([t.module for t in waiting])}")
        parts += _skipped_phrase(skipped)
        return PatchState.APPLIED, "; ".join(parts)
    if waiting or table_waits_for:
        previewed = preview_gate()
        if previewed is not None:
            return PatchState.SKIPPED, previewed
        modules = [table_waits_for] if table_waits_for else [t.module for t in waiting]
        notes = [f"waits for {_modules_phrase(modules)} to be imported"] + _skipped_phrase(skipped)
        return PatchState.PENDING, "; ".join(notes)
    if skipped:
        return PatchState.SKIPPED, "; ".join(_skipped_phrase(skipped))
    return PatchState.PENDING, "not attempted yet"


def _skipped_phrase(targets: Sequence[TargetStatus], shown: int = 3) -> List[str]:
    """The skipped targets' reasons; past ``shown`` of them, a count (a patch with dozens of targets,
    most of which an older release lacks, would otherwise print a paragraph; ``targets`` has each)."""
    reasons = list(dict.fromkeys(target.reason for target in targets))
    if len(reasons) <= shown:
        return reasons
    return reasons[:shown] + [f"and {len(reasons) - shown} more skipped target(s) (PatchStatus.targets lists each)"]


def _modules_phrase(names: Iterable[str], shown: int = 2) -> str:
    modules = sorted(set(names))
    if len(modules) <= shown:
        return " and ".join(modules)
    return f"{', '.join(modules[:shown])} and {len(modules) - shown} more"
