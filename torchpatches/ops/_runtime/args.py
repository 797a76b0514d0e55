"""Argument checks every op shares: a wrong *kind* of argument (a list for a tensor, a string for a number)
raises ``ValueError`` naming the argument, as wrong shapes and dtypes do, never an ``AttributeError`` from
deep inside."""
from __future__ import annotations

import numbers
from typing import Any, Optional

import torch

from .tiers import FLOAT_DTYPES

__all__ = ["tensor", "float_tensor", "number", "flag", "dim"]


def tensor(t: Any, name: str, *, optional: bool = False) -> Optional[torch.Tensor]:
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")
    return t


def float_tensor(t: Any, name: str, rank: Optional[int] = None, layout: str = "") -> torch.Tensor:
    """A tensor of a dtype the ops serve (and of ``rank`` dims, named by ``layout`` in the message)."""
    tensor(t, name)
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} is not supported; expected float32, bfloat16 or float16")
    return t


def number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {type(value).__name__}")
    return value


def dim(value: Any, name: str) -> Optional[int]:
    """An int (a dim or a width) or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be an int or None, got {type(value).__name__}")
    return value
