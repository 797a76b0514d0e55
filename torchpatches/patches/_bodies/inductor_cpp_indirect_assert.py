"""The ``inductor_cpp_indirect_assert`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/inductor_cpp_indirect_assert.py``."""
from __future__ import annotations

from typing import Any, Callable


class _BroadcastMask:
    """A scalar mask written as the vector mask it broadcasts to (what the original emits for a vector mask)."""

    is_vec = True

    def __init__(self, expression: str) -> None:
        self.expression = expression

    def __str__(self) -> str:
        return self.expression


def make_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    def indirect_assert(self: Any, var: Any, lower: Any, upper: Any, mask: Any = None) -> Any:
        """torchpatches: a scalar mask under a vector index is broadcast with ``VecMask::from`` (pytorch#178148)."""
        if mask is not None and getattr(var, "is_vec", False) and getattr(mask, "is_vec", True) is False:
            mask = _BroadcastMask(f"{self._get_mask_type(var.dtype)}::from({mask})")
        return original(self, var, lower, upper, mask)

    return indirect_assert
