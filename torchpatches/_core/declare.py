"""What a patch file declares. The registry reads these; patch files hold no state of their own."""
from __future__ import annotations

import threading
from typing import Any, Callable, FrozenSet, Mapping, Optional, Tuple, Union

from .lazy import body

__all__ = ["Patch", "Target", "Site", "LazyTargets"]


class _Frozen:
    """Immutable after __init__ (plain classes: dataclasses cost ~10 ms of import time each here)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _set(self, **fields: Any) -> None:
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"


class Site(_Frozen):
    """A graph break a target's replacement removes: the calls of ``call`` inside ``function``.

    ``call`` is what Dynamo cannot trace, as written in the source: ``"logger.warning"`` (any
    ``<name>.warning(`` whose name is or ends in ``logger``), ``"warnings.warn"``, ``"deprecate"``.
    ``function`` is ``"module:qualname"``; it defaults to the target's own path. Nested defs inside it
    count (the ``@apply_lora_scale`` wrapper lives in ``peft_utils:apply_lora_scale``). ``breaks`` says
    in a few words when it breaks. The doctor finds the lines from the source (:mod:`torchpatches._doctor.sites`),
    so a declaration names no line numbers that could drift.
    """

    __slots__ = ("call", "breaks", "function")

    def __init__(self, call: str, breaks: str, function: str = "") -> None:
        if not isinstance(call, str) or not isinstance(breaks, str) or not isinstance(function, str):
            raise ValueError(f"a site's call, breaks and function must be str, got {call!r}, {breaks!r}, {function!r}")
        if not call or not breaks:
            raise ValueError("a site needs the call that breaks and a few words on when it breaks")
        if function and ":" not in function:
            raise ValueError(f"site function {function!r} must be 'module:qualname'")
        self._set(call=call, breaks=breaks, function=function)

    def bound_to(self, path: str) -> "Site":
        """This site with ``function`` defaulted to ``path`` (a target's)."""
        return self if self.function else Site(self.call, self.breaks, path)


class Target(_Frozen):
    """One object a patch swaps.

    ``path`` is ``"module:qualname"``; the qualname may walk into a class
    (``"torch._inductor.ir:StorageBox.should_realize_on_reuse"``).
    ``make_replacement(original)`` builds the replacement; it runs only when the target is
    about to be patched, so replacement code can import heavy modules lazily. Given as
    ``"module:attribute"``, it is imported then too (:func:`torchpatches._core.lazy.body`): patch files
    declare their targets so, and ``import torchpatches`` compiles none of their replacement code.
    ``fingerprints`` are :func:`torchpatches._core.gates.fingerprint` values of the originals this
    patch was verified against (comment each with the version it came from); any other
    original is skipped. ``aliases`` are other ``"module:attr"`` sites that bound the
    original by name (``from x import y``); they are rebound on apply and on revert, also
    when their module is imported later. ``sites`` are the graph breaks the replacement removes
    (:class:`Site`); the doctor maps a user's graph breaks to patches through them.
    """

    __slots__ = ("path", "make_replacement", "fingerprints", "aliases", "sites")

    def __init__(
        self,
        path: str,
        make_replacement: Union[str, Callable[[Any], Any]],
        fingerprints: FrozenSet[str],
        aliases: Tuple[str, ...] = (),
        sites: Tuple[Site, ...] = (),
    ) -> None:
        if not isinstance(path, str) or ":" not in path:
            raise ValueError(f"target path {path!r} must be a str 'module:qualname'")
        if isinstance(make_replacement, str):  # "module:attribute": imported when the target is patched
            make_replacement = body(make_replacement)
        if not callable(make_replacement):
            raise ValueError(f"make_replacement of {path!r} must be callable, got {type(make_replacement).__name__}")
        # A bare str would silently become a set of characters / a tuple of letters.
        fingerprints = _str_collection(fingerprints, f"fingerprints of {path!r}")
        aliases = _str_collection(aliases, f"aliases of {path!r}")
        for alias in aliases:
            if ":" not in alias or "." in alias.split(":", 1)[1]:
                raise ValueError(f"alias {alias!r} must be 'module:attribute'")
        if not fingerprints:
            raise ValueError(f"target {path!r} needs at least one verified fingerprint")
        if isinstance(sites, Site):
            sites = (sites,)
        if isinstance(sites, (str, bytes, bytearray)) or not all(isinstance(site, Site) for site in sites):
            raise ValueError(f"sites of {path!r} must be a tuple of Site objects, got {sites!r}")
        self._set(path=path, make_replacement=make_replacement, fingerprints=frozenset(fingerprints),
                  aliases=tuple(aliases), sites=tuple(site.bound_to(path) for site in sites))

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.path.split(":", 1)[1]


def _str_collection(value: Any, what: str) -> Tuple[str, ...]:
    """``value`` as a tuple of str; ValueError for a bare str, bytes, non-iterables or non-str items."""
    if isinstance(value, (str, bytes, bytearray)):
        raise ValueError(f"{what} must be a collection of str (a set or tuple), not a single {type(value).__name__}")
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(f"{what} must be a collection of str, got {type(value).__name__}") from None
    wrong = [item for item in items if not isinstance(item, str)]
    if wrong:
        raise ValueError(f"{what} must all be str, got {', '.join(type(item).__name__ for item in wrong)}")
    return items


class LazyTargets(_Frozen):
    """A patch's targets, declared by ``build()`` when they are first needed instead of at import.

    For long tables whose declaration would make ``import torchpatches`` slower (compile_warnings: 71
    targets in diffusers). Every target must be in ``module`` or below it. The registry builds the
    table right after ``module`` is first imported (or at once when it already is); until then the
    patch is pending on ``module`` and its status lists no targets. Reading :attr:`Patch.targets`
    builds it too (the doctor and the tools do).
    """

    __slots__ = ("module", "build")

    def __init__(self, module: str, build: Callable[[], Tuple[Target, ...]]) -> None:
        if not isinstance(module, str) or not module or ":" in module:
            raise ValueError(f"the module of lazy targets must be a module name, got {module!r}")
        if not callable(build):
            raise ValueError(f"build of the targets in {module!r} must be callable")
        self._set(module=module, build=build)


_build_lock = threading.Lock()  # a lazy table is built once, also when two threads read it together


class Patch(_Frozen):
    """A named, gated, reversible set of targets.

    ``requires`` maps top-level module names to ``packaging`` specifiers (``{"torch": ">=2.11,<2.12"}``);
    builds are gated by their release number (see :func:`torchpatches._core.gates.release_version`).
    ``verifies`` maps ``"module:qualname"`` paths of code the replacements rely on but do not replace
    (a decorator they rebuild, a helper they call) to the fingerprints it was verified with; any other
    fingerprint skips the whole patch, with the same wording as a target's. It is checked after the
    version gate, each time a target's module has loaded.
    ``precondition()``, if given, returns None or a sentence saying why the patch must be skipped
    (a check that is not a version or a fingerprint; it runs last).
    ``inductor_cache_key`` is set by patches that change what Inductor generates without changing
    the FX graph: while they are applied, their name and fingerprint enter Inductor's cache key.
    ``targets`` may be :class:`LazyTargets`: built on first use (``lazy_targets`` keeps the declaration).
    """

    __slots__ = ("name", "summary", "_targets", "lazy_targets", "requires", "verifies", "precondition",
                 "inductor_cache_key")

    def __init__(
        self,
        name: str,
        summary: str,
        targets: Union[Tuple[Target, ...], Target, LazyTargets],
        requires: Optional[Mapping[str, str]] = None,
        precondition: Optional[Callable[[], Optional[str]]] = None,
        inductor_cache_key: bool = False,
        verifies: Optional[Mapping[str, FrozenSet[str]]] = None,
    ) -> None:
        if not isinstance(name, str) or not name.isidentifier() or name.lower() != name:
            raise ValueError(f"patch name {name!r} must be a lower-case identifier")
        if name == "all":
            raise ValueError("'all' is reserved for TORCHPATCHES_DISABLE")
        lazy = targets if isinstance(targets, LazyTargets) else None
        if lazy is None:
            targets = _target_tuple(name, targets)
        if requires is not None and not (isinstance(requires, Mapping) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in requires.items())):
            raise ValueError(f"requires of patch {name!r} must map module names to specifier str, got {requires!r}")
        if precondition is not None and not callable(precondition):
            raise ValueError(f"precondition of patch {name!r} must be callable")
        verifies = {path: frozenset(_str_collection(fingerprints, f"fingerprints of {path!r}"))
                    for path, fingerprints in (verifies or {}).items()}
        for path, fingerprints in verifies.items():
            if not isinstance(path, str) or ":" not in path:
                raise ValueError(f"verified path {path!r} must be 'module:qualname'")
            if not fingerprints:
                raise ValueError(f"verified path {path!r} needs at least one fingerprint")
        self._set(name=name, summary=summary, _targets=None if lazy else targets, lazy_targets=lazy,
                  requires=dict(requires or {}), verifies=verifies, precondition=precondition,
                  inductor_cache_key=inductor_cache_key)

    @property
    def targets(self) -> Tuple[Target, ...]:
        """The targets; lazy ones are built by this first read (ValueError when the table is not valid)."""
        built = self._targets
        if built is None:
            with _build_lock:
                built = self._targets
                if built is None:
                    lazy = self.lazy_targets
                    built = _target_tuple(self.name, lazy.build(), under=lazy.module)
                    self._set(_targets=built)
        return built

    @property
    def targets_built(self) -> bool:
        """False while lazy targets wait to be built."""
        return self._targets is not None


def _target_tuple(name: str, targets: Any, under: str = "") -> Tuple[Target, ...]:
    """``targets`` as a non-empty tuple of :class:`Target` (in ``under`` or below it, if given); else ValueError."""
    if isinstance(targets, Target):
        targets = (targets,)
    if not targets or not all(isinstance(target, Target) for target in targets):
        raise ValueError(f"patch {name!r} needs a tuple of Target objects, got {targets!r}")
    outside = [t.path for t in targets if under and t.module != under and not t.module.startswith(under + ".")]
    if outside:
        raise ValueError(f"lazy targets of patch {name!r} must be in {under} or below it, not {', '.join(outside)}")
    return tuple(targets)
