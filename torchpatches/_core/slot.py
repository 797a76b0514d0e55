"""One target of one patch: find it, prove it is the verified code, swap it, rebind its aliases, put it back.

A :class:`Slot` is the per-target state machine the registry drives (under its lock):

    disabled/pending --locate()--> (found and verified) --swap_in()--> applied --swap_out()--> disabled
                         \\--> skipped (SkipTarget: missing, or not the verified code)

It remembers the original it found, builds the replacement once per original (so re-applying binds
the same object and code compiled meanwhile stays valid), and rebinds the ``from x import y`` aliases
of the target, also in alias modules imported later (:meth:`Slot.watch_alias_modules`).

Every replacement is *marked* with the original it replaces and the target path
(``__torchpatches_original__``, ``__torchpatches_target__``), so a replacement is never mistaken for
an original: a slot that finds a marked replacement bound (another registry, as
``importlib.reload(torchpatches)`` makes; a third party that put ours back) adopts it or takes it
out, instead of patching on top of it. What is bound is read again (:meth:`Slot.live`) whenever the
truth matters: a reload of the target module makes a fresh owner and original.
"""
from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Any, Callable, List, Mapping, Optional, Set, Tuple

from .declare import Patch, Target
from .import_hooks import is_imported, when_imported
from .status import PatchState, TargetStatus

logger = logging.getLogger("torchpatches")

__all__ = ["Slot", "SkipTarget", "find", "verify", "verify_dependency", "marked_original", "MARK_ORIGINAL",
           "MARK_TARGET", "MARK_PATCH"]

_MISSING = object()
#: Set on every replacement: the original it replaces, and the target path it was made for.
MARK_ORIGINAL = "__torchpatches_original__"
MARK_TARGET = "__torchpatches_target__"
MARK_PATCH = "__torchpatches_patch__"


def _mark_of(obj: Any) -> Tuple[Any, Any]:
    """(target path, patch name) a torchpatches replacement is marked with; (None, None) for others."""
    try:
        return getattr(obj, MARK_TARGET, None), getattr(obj, MARK_PATCH, None)
    except Exception:  # noqa: BLE001 - stubs whose attribute access raises are not ours
        return None, None


def marked_original(obj: Any, path: str, patch: str) -> Any:
    """The original that ``obj`` replaces if ``obj`` is patch ``patch``'s replacement made for ``path``,
    else a sentinel (``is_marked`` tells)."""
    if _mark_of(obj) == (path, patch):
        try:
            return getattr(obj, MARK_ORIGINAL)
        except Exception:  # noqa: BLE001
            pass
    return _MISSING


def is_marked(obj: Any, path: str, patch: str) -> bool:
    return marked_original(obj, path, patch) is not _MISSING


def _inherited(owner: Any, attribute: str, original: Any) -> bool:
    """Whether ``original`` is what ``owner`` (a class) inherits for ``attribute`` from a base class."""
    for base in getattr(owner, "__mro__", ())[1:]:
        if vars(base).get(attribute, _MISSING) is original:
            return True
    return False


def _mark(replacement: Any, original: Any, path: str, patch: str) -> None:
    """Mark ``replacement`` as ours, and name it by the target it is bound at.

    ``__module__``/``__qualname__`` become the target's, so pickle (which stores a function by name
    and checks the name resolves to the same object) sends it by reference, e.g. to a ``spawn``
    worker, where the name resolves to whatever that process binds there.
    """
    module_name, qualname = path.split(":", 1)
    try:
        setattr(replacement, MARK_ORIGINAL, original)
        setattr(replacement, MARK_TARGET, path)
        setattr(replacement, MARK_PATCH, patch)
        if callable(replacement) and hasattr(replacement, "__qualname__"):
            replacement.__module__, replacement.__qualname__ = module_name, qualname
        function = replacement.__func__ if isinstance(replacement, (staticmethod, classmethod)) else None
        if isinstance(function, types.FunctionType):  # what the class attribute gives code and pickle
            function.__module__, function.__qualname__ = module_name, qualname
    except (AttributeError, TypeError) as error:
        raise TypeError(f"the replacement for {path} cannot carry torchpatches' mark ({error}): "
                        "it could later be mistaken for an original") from None


class SkipTarget(Exception):
    """The target is not what the patch expects: skip it, with this message as the reason."""


def find(module: Any, path: str) -> Tuple[Any, str, Any, bool]:
    """(owner, attribute, object, owned) for ``path``'s qualname in ``module``.

    ``owned`` is False when the object is inherited from a base class (so revert deletes ours
    instead of writing the original back). Raises :class:`SkipTarget` when something is missing.
    """
    parts = path.split(":", 1)[1].split(".")
    owner = module
    try:
        for part in parts[:-1]:
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                raise SkipTarget(f"{path} not found: no attribute {part!r}")
        attribute = parts[-1]
        namespace = getattr(owner, "__dict__", None)
        own = namespace.get(attribute, _MISSING) if isinstance(namespace, Mapping) else _MISSING
        found = own if own is not _MISSING else getattr(owner, attribute, _MISSING)
    except SkipTarget:
        raise
    except Exception as error:  # noqa: BLE001 - stubs and lazy modules raise anything from getattr
        raise SkipTarget(f"{path} not found: looking it up raised {type(error).__name__}: {error}") from None
    if found is _MISSING:
        raise SkipTarget(f"{path} not found: no attribute {attribute!r}")
    return owner, attribute, found, own is not _MISSING


def verify(path: str, obj: Any, fingerprints: frozenset) -> str:
    """The fingerprint of ``obj`` if it is one of ``fingerprints``; else :class:`SkipTarget` saying why not."""
    from . import gates as _gates

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
        self.adopted: Any = None  # a marked replacement found bound at locate(), taken over as ours
        self.stale: List[Any] = []  # originals and replacements of earlier loads of the target module

    def status(self) -> TargetStatus:
        return TargetStatus(self.target.path, self.state, self.reason)

    def set(self, state: PatchState, reason: str) -> None:
        self.state, self.reason = state, reason

    # ---- applying ---------------------------------------------------------------------------

    def locate(self, module: Any) -> None:
        """Find the original in ``module`` and verify its fingerprint; :class:`SkipTarget` if not.

        A torchpatches replacement found bound there is not an original: its mark names the original,
        which is verified instead, and :meth:`swap_in` adopts the replacement rather than wrapping it.
        """
        owner, attribute, found, owned = find(module, self.target.path)
        marked_path, marked_patch = _mark_of(found)
        if marked_path == self.target.path and marked_patch != self.patch.name:
            raise SkipTarget(f"{self.target.path} holds the replacement of torchpatches' patch {marked_patch!r}; "
                             "two patches cannot both replace it")
        original = marked_original(found, self.target.path, self.patch.name)
        adopted = found if original is not _MISSING else None
        if adopted is None:
            original = found
        self.fingerprint = verify(self.target.path, original, self.target.fingerprints)
        if self.original is not None and self.original is not original:
            self.stale += [obj for obj in (self.original, self.replacement) if obj is not None]
        if adopted is not None:
            owned = not _inherited(owner, attribute, original)
        self.owner, self.attribute, self.original, self.owned_attribute = owner, attribute, original, owned
        self.adopted = adopted

    def live(self) -> Any:
        """What the target's module binds at the target now (``_MISSING`` if the module is not imported
        or the target cannot be found): after a reload that is not what :meth:`locate` saw."""
        module = sys.modules.get(self.target.module)
        if module is None or not is_imported(self.target.module):
            return _MISSING
        try:
            return find(module, self.target.path)[2]
        except SkipTarget:
            return _MISSING

    def is_in_effect(self) -> bool:
        """Whether the replacement this slot bound is what the target holds now."""
        current = self.live()
        return current is not _MISSING and self.replacement is not None and current is self.replacement

    def ours_bound(self) -> bool:
        """Whether a torchpatches replacement for this target is bound now (whoever put it there)."""
        return is_marked(self.live(), self.target.path, self.patch.name)

    def swap_in(self) -> None:
        """Bind the replacement at the target and its imported aliases; on any error, undo and raise."""
        if self.adopted is not None:  # already bound (another registry made it): take it over
            replacement = self.adopted
            self.built = (self.original, replacement)
        else:
            replacement = self._replacement()
            _mark(replacement, self.original, self.target.path, self.patch.name)
            setattr(self.owner, self.attribute, replacement)
        self.adopted = None
        self.replacement = replacement
        try:
            for old in (*self.stale, self.original):
                self.rebind_aliases(old, replacement)
            self.stale.clear()
            if self.patch.inductor_cache_key:
                from . import cache_key as _cache_key

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

    def drop_token(self) -> None:
        """Take this slot's Inductor cache-key token out (its replacement is no longer what runs)."""
        if self.token is not None:
            from . import cache_key as _cache_key

            _cache_key.remove_token(self.token)
            self.token = None

    # ---- reverting --------------------------------------------------------------------------

    def swap_out(self) -> None:
        """Put the original back (by identity) at the target and its aliases; drop our cache-key token.

        What is bound is read again first: after a reload the module holds a fresh owner, and a
        replacement someone else put back after an earlier revert is still ours to take out. Anything
        else bound there (someone else's patch) is left alone.
        """
        module = sys.modules.get(self.target.module)
        live_owner: Any = None
        foreign = False  # someone else's object at the target: not what an alias of ours should get
        if module is not None:
            try:
                live_owner, attribute, current, owned = find(module, self.target.path)
            except SkipTarget:
                live_owner = None
        if live_owner is not None:
            original = marked_original(current, self.target.path, self.patch.name)
            if original is not _MISSING:
                if _inherited(live_owner, attribute, original):
                    delattr(live_owner, attribute)  # ours shadowed an inherited original
                else:
                    setattr(live_owner, attribute, original)
            elif current is not self.original and self.replacement is not None:
                foreign = True
                logger.warning(
                    "torchpatches: %s was replaced again by someone else after it was patched; leaving that in place",
                    self.target.path,
                )
        if self.owner is not None and self.owner is not live_owner and self.replacement is not None:
            # The module was reloaded or removed from sys.modules: the object we patched may still be used.
            if vars(self.owner).get(self.attribute, _MISSING) is self.replacement:
                if self.owned_attribute:
                    setattr(self.owner, self.attribute, self.original)
                else:
                    delattr(self.owner, self.attribute)
        restored = self.live()
        for alias in self.target.aliases:
            module_name, alias_attribute = alias.split(":", 1)
            alias_module = sys.modules.get(module_name)
            if alias_module is None:
                continue
            held = getattr(alias_module, alias_attribute, _MISSING)
            if held is self.replacement or is_marked(held, self.target.path, self.patch.name):
                # Without torchpatches an alias keeps the original it imported: a user's function set at the target
                # later (a mock, a monkeypatch undone after this revert) never reached it.
                setattr(alias_module, alias_attribute,
                        restored if restored is not _MISSING and not foreign
                        and not is_marked(restored, self.target.path, self.patch.name)
                        else self.original)
        if self.token is not None:
            from . import cache_key as _cache_key

            _cache_key.remove_token(self.token)
            self.token = None
        self.replacement = None
