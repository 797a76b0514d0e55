"""Argument checks every op shares: a wrong *kind* of argument (a list for a tensor, a string for a number)
raises ``ValueError`` naming the argument, as wrong shapes and dtypes do, never an ``AttributeError`` from
deep inside."""
from __future__ import annotations

import numbers
from typing import Any, Optional

import torch

__all__ = ["tensor", "number", "flag", "dim"]


def tensor(t: Any, name: str, *, optional: bool = False) -> Optional[torch.Tensor]:
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")
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
