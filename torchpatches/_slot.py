"""One target of one patch: find it, prove it is the verified code, swap it, rebind its aliases, put it back.

A :class:`Slot` is the per-target state machine the registry drives (under its lock):

    disabled/pending --locate()--> (found and verified) --swap_in()--> applied --swap_out()--> disabled
                         \\--> skipped (SkipTarget: missing, or not the verified code)

It remembers the original it found, builds the replacement once per original (so re-applying binds
the same object and code compiled meanwhile stays valid), and rebinds the ``from x import y`` aliases
of the target, also in alias modules imported later (:meth:`Slot.watch_alias_modules`).
"""
from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, Callable, Optional, Set, Tuple

from . import _gates
from ._declare import Patch, Target
from ._import_hooks import is_imported, when_imported
from ._status import PatchState, TargetStatus

logger = logging.getLogger("torchpatches")

__all__ = ["Slot", "SkipTarget", "find", "verify", "verify_dependency"]

_MISSING = object()


class SkipTarget(Exception):
    """The target is not what the patch expects: skip it, with this message as the reason."""


def find(module: Any, path: str) -> Tuple[Any, str, Any, bool]:
    """(owner, attribute, object, owned) for ``path``'s qualname in ``module``.

    ``owned`` is False when the object is inherited from a base class (so revert deletes ours
    instead of writing the original back). Raises :class:`SkipTarget` when something is missing.
    """
    parts = path.split(":", 1)[1].split(".")
    owner = module
    for part in parts[:-1]:
        owner = getattr(owner, part, _MISSING)
        if owner is _MISSING:
            raise SkipTarget(f"{path} not found: no attribute {part!r}")
    attribute = parts[-1]
    own = vars(owner).get(attribute, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    found = own if own is not _MISSING else getattr(owner, attribute, _MISSING)
    if found is _MISSING:
        raise SkipTarget(f"{path} not found: no attribute {attribute!r}")
    return owner, attribute, found, own is not _MISSING


def verify(path: str, obj: Any, fingerprints: frozenset) -> str:
    """The fingerprint of ``obj`` if it is one of ``fingerprints``; else :class:`SkipTarget` saying why not."""
    try:
        found = _gates.fingerprint(obj)
    except (OSError, TypeError) as error:
        raise SkipTarget(f"cannot fingerprint {path} ({error}); not patching blindly") from None
    if found not in fingerprints:
        raise SkipTarget(
            f"{path} differs from the verified version(s) "
            f"(fingerprint {found}, expected {' or '.join(sorted(fingerprints))})"
        )
    return found


def verify_dependency(path: str, fingerprints: frozenset) -> Optional[str]:
    """None if ``path`` (code a patch relies on but does not replace) is verified, else the skip reason.

    The module is imported if needed: a patch's dependencies are its targets' own imports, so they are
    loaded by the time a target's module is.
    """
    module_name = path.split(":", 1)[0]
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a broken dependency skips the patch; it never breaks the import
        return f"{path} not found: importing {module_name} raised {type(error).__name__}: {error}"
    try:
        verify(path, find(module, path)[2], fingerprints)
    except SkipTarget as skip:
        return str(skip)
    return None


class Slot:
    """Bookkeeping and moves for one target (a plain class: dataclasses are slow to create)."""

    def __init__(self, patch: Patch, target: Target) -> None:
        self.patch = patch
        self.target = target
        self.state = PatchState.DISABLED
        self.reason = ""
        self.owner: Any = None
        self.attribute = ""
        self.original: Any = None
        self.fingerprint = ""  # of the original, as verified when it was located
        self.owned_attribute = True  # False when the original was inherited, so revert deletes ours
        self.replacement: Any = None
        self.built: Tuple[Any, Any] = (_MISSING, None)  # (original, replacement made for it)
        self.token: Optional[str] = None  # our Inductor cache-key token while applied
        self.watching = False  # a post-import hook waits for the target's module
        self.watched_alias_modules: Set[str] = set()

    def status(self) -> TargetStatus:
        return TargetStatus(self.target.path, self.state, self.reason)

    def set(self, state: PatchState, reason: str) -> None:
        self.state, self.reason = state, reason

    # ---- applying ---------------------------------------------------------------------------

    def locate(self, module: Any) -> None:
        """Find the original in ``module`` and verify its fingerprint; :class:`SkipTarget` if not."""
        owner, attribute, original, owned = find(module, self.target.path)
        self.fingerprint = verify(self.target.path, original, self.target.fingerprints)
        self.owner, self.attribute, self.original, self.owned_attribute = owner, attribute, original, owned

    def swap_in(self) -> None:
        """Bind the replacement at the target and its imported aliases; on any error, undo and raise."""
        replacement = self._replacement()
        setattr(self.owner, self.attribute, replacement)
        self.replacement = replacement
        try:
            self.rebind_aliases(self.original, replacement)
            if self.patch.inductor_cache_key:
                from . import _cache_key

                self.token = _cache_key.add_patch_token(self.patch, self.target, self.fingerprint)
        except Exception:
            self.swap_out()
            raise

    def _replacement(self) -> Any:
        """Build the replacement once per original: re-applying then yields the same object, so code
        compiled while the patch was on stays valid (Dynamo guards on function identity)."""
        built_for, replacement = self.built
        if built_for is not self.original:
            replacement = self.target.make_replacement(self.original)
            self.built = (self.original, replacement)
        return replacement

    def rebind_aliases(self, old: Any, new: Any) -> None:
        """Point every imported alias site that holds ``old`` at ``new``; leave others' changes alone."""
        for alias in self.target.aliases:
            module_name, attribute = alias.split(":", 1)
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, attribute, _MISSING) is old:
                setattr(module, attribute, new)

    def watch_alias_modules(self, on_import: Callable[[str], None]) -> None:
        """Call ``on_import(module_name)`` when an alias module not imported yet is imported (once each)."""
        for alias in self.target.aliases:
            module_name = alias.split(":", 1)[0]
            if not is_imported(module_name) and module_name not in self.watched_alias_modules:
                self.watched_alias_modules.add(module_name)
                when_imported(module_name, lambda module, name=module_name: on_import(name))

    # ---- reverting --------------------------------------------------------------------------

    def swap_out(self) -> None:
        """Put the original back (by identity) at the target and its aliases; drop our cache-key token."""
        current = vars(self.owner).get(self.attribute, _MISSING)
        if current is self.replacement:
            if self.owned_attribute:
                setattr(self.owner, self.attribute, self.original)
            else:
                delattr(self.owner, self.attribute)
        else:
            logger.warning(
                "torchpatches: %s was replaced again by someone else after it was patched; leaving that in place",
                self.target.path,
            )
        self.rebind_aliases(self.replacement, self.original)
        if self.token is not None:
            from . import _cache_key

            _cache_key.remove_token(self.token)
            self.token = None
        self.replacement = None
