"""TORCHPATCHES_DISABLE: which patches the user switched off before they apply."""
from __future__ import annotations

import logging
import os
import re
import warnings
from typing import FrozenSet, Iterable, Optional

ENV_VAR = "TORCHPATCHES_DISABLE"
ALL = "all"

__all__ = ["ENV_VAR", "disabled_names"]

logger = logging.getLogger("torchpatches")


def disabled_names(known: Iterable[str], value: Optional[str] = None) -> FrozenSet[str]:
    """Names of patches the environment disables; ``all`` means every known patch.

    Names are split on commas and whitespace and compared case-insensitively. Names that are
    not patches get one warning that lists the known ones; no value makes this raise, not even
    under warnings-as-errors (``-W error``, pytest's ``filterwarnings = error``): there the warning
    would be an exception out of ``import torchpatches``, so the message goes to the
    ``torchpatches`` logger instead.
    """
    known = tuple(known)
    raw = os.environ.get(ENV_VAR, "") if value is None else value
    words = {word.lower() for word in re.split(r"[,\s]+", raw) if word}
    if ALL in words:
        return frozenset(known)
    unknown = sorted(words - set(known))
    if unknown:
        message = (f"{ENV_VAR} names unknown patch(es) {', '.join(map(repr, unknown))}; "
                   f"known patches: {', '.join(known)} (or '{ALL}')")
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        except Exception:  # noqa: BLE001 - a warnings filter set to "error" raised it
            logger.warning("%s", message)
    return frozenset(words & set(known))
