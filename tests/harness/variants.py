"""Alternatives a patch decided against, measured or tested beside it: :func:`replacing` binds a
patch's targets to another replacement; :func:`rope_op_under_compile` is the one ``rope`` rejected."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from torchpatches._core.declare import Patch, Target
from torchpatches._core.registry import Registry
from torchpatches._core.status import PatchState

__all__ = ["replacing", "rope_op_under_compile"]


@contextlib.contextmanager
def replacing(patch: Patch, make_replacement: Callable[[Any], Any]) -> Iterator[None]:
    """``patch``'s targets and their aliases bound to another replacement inside the block.

    For an alternative a patch decided against, measured or tested beside it. The binding goes through
    a registry of its own, so the originals are verified by fingerprint as the patch's are, and are back
    by identity after the block. Turn the real patch off first (``torchpatches.disabled(name)``).
    """
    targets = tuple(Target(t.path, make_replacement, t.fingerprints, t.aliases) for t in patch.targets)
    registry = Registry([Patch(patch.name, patch.summary, targets, patch.requires, verifies=patch.verifies)])
    registry.apply()
    try:
        state = registry.status()[patch.name]
        if state.state is not PatchState.APPLIED:
            raise RuntimeError(f"the variant of {patch.name} did not apply: {state.state.value}, {state.reason}")
        yield
    finally:
        registry.revert()


def rope_op_under_compile(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The alternative the ``rope`` patch decided against: FLUX-form calls go through the RoPE op under
    ``torch.compile`` too, where the op is a call Inductor cannot fuse (docs/rope.md)."""
    from torchpatches.patches._bodies import rope as rope_patch

    def apply_rotary_emb(
        x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1, sequence_dim: int = 2
    ) -> torch.Tensor:
        if rope_patch.is_flux_call(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim):
            return rope_patch._rotate(x, freqs_cis[0], freqs_cis[1], sequence_dim)
        return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)

    return apply_rotary_emb
