"""The ``inductor_pattern_dtypes`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/inductor_pattern_dtypes.py``."""
from __future__ import annotations

from typing import Any, Callable


def make_replacement(original: Callable[..., bool]) -> Callable[..., bool]:
    import torch
    from torch._library.utils import is_builtin

    def fallback_node_due_to_unsupported_type(node: Any, allow_cpu_inputs: bool = True) -> bool:
        """torchpatches: only a built-in op's anchor is skipped for its input dtypes (pytorch#196013)."""
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and is_builtin(target)):
            return False
        return original(node, allow_cpu_inputs=allow_cpu_inputs)

    return fallback_node_due_to_unsupported_type
