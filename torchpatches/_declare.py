"""What a patch file declares. The registry reads these; patch files hold no state of their own."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, FrozenSet, Mapping, Optional, Tuple

__all__ = ["Patch", "Target"]


@dataclasses.dataclass(frozen=True)
class Target:
    """One object a patch swaps.

    ``path`` is ``"module:qualname"``; the qualname may walk into a class
    (``"torch._inductor.ir:StorageBox.should_realize_on_reuse"``).
    ``make_replacement(original)`` builds the replacement; it runs only when the target is
    about to be patched, so replacement code can import heavy modules lazily.
    ``fingerprints`` are :func:`torchpatches._gates.fingerprint` values of the originals this
    patch was verified against (comment each with the version it came from); any other
    original is skipped. ``aliases`` are other ``"module:attr"`` sites that bound the
    original by name (``from x import y``); they are rebound on apply and on revert, also
    when their module is imported later.
    """

    path: str
    make_replacement: Callable[[Any], Any]
    fingerprints: FrozenSet[str]
    aliases: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if ":" not in self.path:
            raise ValueError(f"target path {self.path!r} must be 'module:qualname'")
        for alias in self.aliases:
            if ":" not in alias or "." in alias.split(":", 1)[1]:
                raise ValueError(f"alias {alias!r} must be 'module:attribute'")
        if not self.fingerprints:
            raise ValueError(f"target {self.path!r} needs at least one verified fingerprint")

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.path.split(":", 1)[1]


@dataclasses.dataclass(frozen=True)
class Patch:
    """A named, gated, reversible set of targets.

    ``requires`` maps distribution names to ``packaging`` specifiers (``{"torch": ">=2.11,<2.12"}``);
    builds are gated by their release number (see :func:`torchpatches._gates.release_version`).
    ``precondition()``, if given, returns None or a sentence saying why the patch must be skipped
    (it runs after the version gate, when the first target's module is loaded).
    ``inductor_cache_key`` is set by patches that change what Inductor generates without changing
    the FX graph: while they are applied, their name and fingerprint enter Inductor's cache key.
    """

    name: str
    summary: str
    targets: Tuple[Target, ...]
    requires: Mapping[str, str] = dataclasses.field(default_factory=dict)
    precondition: Optional[Callable[[], Optional[str]]] = None
    inductor_cache_key: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name.lower() != self.name:
            raise ValueError(f"patch name {self.name!r} must be a lower-case identifier")
        if self.name == "all":
            raise ValueError("'all' is reserved for TORCHPATCHES_DISABLE")
        if not self.targets:
            raise ValueError(f"patch {self.name!r} has no targets")
