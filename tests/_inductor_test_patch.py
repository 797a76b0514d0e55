"""A test-only Inductor patch: every Pointwise read by more than one consumer is materialized.

It changes what Inductor generates without changing the FX graph (as ``inductor_realize`` does),
on every torch version, so cache-key tests do not depend on the torch 2.11-only shipped patch.
The fingerprint is taken from the running torch: these tests check the cache key, not the gate.
"""
from __future__ import annotations

from typing import Any, Callable

from torchpatches._core.declare import Patch, Target
from torchpatches._core.gates import fingerprint

NAME = "test_realize"


def _always_realize(original: Callable[..., bool]) -> Callable[..., bool]:
    def should_realize_on_reuse(self: Any, users: int, *args: Any, **kwargs: Any) -> bool:
        from torch._inductor import ir

        if users > 1 and isinstance(self.data, ir.Pointwise):
            return True
        return original(self, users, *args, **kwargs)

    return should_realize_on_reuse


def make_test_patch() -> Patch:
    import torch._inductor.ir as ir  # only to read this torch's fingerprint of the original

    bound = ir.StorageBox.__dict__["should_realize_on_reuse"]
    # The original, also where inductor_realize is applied (torch 2.11): its replacement is marked.
    original = getattr(bound, "__torchpatches_original__", bound)
    return Patch(
        name=NAME,
        summary="test only: realize every reused Pointwise",
        targets=(Target("torch._inductor.ir:StorageBox.should_realize_on_reuse", _always_realize,
                        frozenset({fingerprint(original)})),),
        inductor_cache_key=True,
    )
