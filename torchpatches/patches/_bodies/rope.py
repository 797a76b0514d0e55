"""The ``rope`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/rope.py``."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from ..._core.compat import is_compiling
from ...ops._runtime.tiers import FLOAT_DTYPES, eager_transforms

logger = logging.getLogger("torchpatches")


def is_flux_call(x: Any, freqs_cis: Any, use_real: Any, use_real_unbind_dim: Any, sequence_dim: Any) -> bool:
    """True when the call is one the op computes exactly as the original would.

    Everything checked here is static under Dynamo (types, ranks, shapes, dtypes, devices), so the
    choice costs nothing at run time and never breaks a graph.
    """
    if use_real is not True or use_real_unbind_dim != -1 or sequence_dim not in (1, 2):
        return False
    if type(x) is not torch.Tensor or x.dim() != 4 or x.dtype not in FLOAT_DTYPES or x.shape[-1] % 2:
        return False  # subclasses (DTensor under tensor parallelism) keep the original
    if any(stride == 0 and size > 1 for size, stride in zip(x.shape, x.stride())):
        return False  # expanded views: the op refuses to write several outputs from one element
    if not isinstance(freqs_cis, (tuple, list)) or len(freqs_cis) != 2:
        return False
    expected = (x.shape[sequence_dim], x.shape[-1])
    for freq in freqs_cis:
        if type(freq) is not torch.Tensor or freq.dtype != torch.float32 or freq.device != x.device:
            return False
        if tuple(freq.shape) != expected:
            return False  # the original would broadcast e.g. [1, D]; the op wants one row per token
    if torch.is_grad_enabled() and (x.requires_grad or any(f.requires_grad for f in freqs_cis)):
        return False  # training / LoRA: the original is differentiable, the op's backward is not ours to rely on
    return True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """One out-of-place op call in the FLUX layout (interleaved pairs, per-token cos/sin, k=None)."""
    from ...ops._rope import apply_rope_qk

    out, _ = apply_rope_qk(x, None, cos, sin, interleaved=True, sequence_dim=sequence_dim)
    return out


def build_replacement(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The function bound in place of ``original``."""

    # Name and docstring of the original (help() reads the same). The registry sets __module__ and
    # __qualname__ to the target's when it binds it (pickling by reference) and marks it with
    # __torchpatches_original__ / __torchpatches_target__: that mark says the patch is in place.
    @functools.wraps(original, assigned=("__name__", "__qualname__", "__doc__"), updated=())
    def apply_rotary_emb(
        x: torch.Tensor,
        freqs_cis: Any,
        use_real: bool = True,
        use_real_unbind_dim: int = -1,
        sequence_dim: int = 2,
    ) -> torch.Tensor:
        # Compiling: Inductor fuses diffusers' own RoPE with the q/k RMSNorm and the concat (keep it
        # visible). Forward AD / functorch transforms / jit tracing: diffusers' differentiable, traceable ops.
        if is_compiling() or eager_transforms() or not is_flux_call(
                x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim):
            return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        cos, sin = freqs_cis
        try:
            return _rotate(x, cos, sin, sequence_dim)
        except ValueError as refusal:  # the op checks before it writes anything: the original is safe
            logger.debug("torchpatches rope: op refused a FLUX-form call (%s); using diffusers' own", refusal)
            return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)

    # functools.wraps sets __wrapped__; drop it so inspect.unwrap / fingerprint see this function.
    del apply_rotary_emb.__wrapped__
    return apply_rotary_emb
