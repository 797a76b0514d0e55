"""TORCHPATCHES_DISABLE: which patches the user switched off before they apply."""
from __future__ import annotations

import os
import re
import warnings
from typing import FrozenSet, Iterable, Optional

ENV_VAR = "TORCHPATCHES_DISABLE"
ALL = "all"

__all__ = ["ENV_VAR", "disabled_names"]


def disabled_names(known: Iterable[str], value: Optional[str] = None) -> FrozenSet[str]:
    """Names of patches the environment disables; ``all`` means every known patch.

    Names are split on commas and whitespace and compared case-insensitively. Names that are
    not patches get one warning that lists the known ones; no value makes this raise.
    """
    known = tuple(known)
    raw = os.environ.get(ENV_VAR, "") if value is None else value
    words = {word.lower() for word in re.split(r"[,\s]+", raw) if word}
    if ALL in words:
        return frozenset(known)
    unknown = sorted(words - set(known))
    if unknown:
        warnings.warn(
            f"{ENV_VAR} names unknown patch(es) {', '.join(map(repr, unknown))}; "
            f"known patches: {', '.join(known)} (or '{ALL}')",
            RuntimeWarning,
            stacklevel=3,
        )
    return frozenset(words & set(known))
