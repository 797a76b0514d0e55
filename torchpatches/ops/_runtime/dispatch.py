"""How every op runs the tier it chose: one rule, written once.

- eager (not traced, a plain ``torch.Tensor``): the op body is called directly. The ``torch.library``
  ops exist for tracing; their dispatch costs tens of microseconds of host time per call, more than a
  small kernel.
- autograd records the call (``_tiers.needs_grad``: requires_grad, forward-mode AD, functorch
  transforms): the body runs inline, so its PyTorch ops are recorded (also when traced: the custom ops
  have no autograd formula, a gradient through them would fail at backward).
- traced (Dynamo, make_fx/export: fake or functional tensors): the custom op, with its fake.

``torch.jit.trace`` records the PyTorch tier (``_tiers.choose_tier``); the ops' shape checks are Python
constants of that trace, so :func:`public` keeps their TracerWarnings out of the user's log.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, TypeVar

import torch

from ..._core.compat import is_compiling
from .tiers import jit_tracing

__all__ = ["plain_eager", "run", "public"]

_F = TypeVar("_F", bound=Callable[..., Any])


def public(fn: _F) -> _F:
    """An op's entry (public, or the one function its public ones call): under ``torch.jit.trace`` without
    TracerWarnings from torchpatches' checks."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        if not jit_tracing():
            return fn(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r"torchpatches\.")
            return fn(*args, **kwargs)

    return op  # type: ignore[return-value]


def plain_eager(x: Any) -> bool:
    """True outside any tracing: not Dynamo, and not make_fx/export (fake or functional tensors)."""
    return type(x) is torch.Tensor and not is_compiling()


def run(x: Any, grad: bool, body: Callable[..., Any], op: Callable[..., Any], *args: Any) -> Any:
    """``body(*args)`` in eager or when autograd records (``grad``), else the custom ``op(*args)``.
    ``x`` is the tensor whose type says whether the call is traced."""
    if grad or plain_eager(x):
        return body(*args)
    return op(*args)
