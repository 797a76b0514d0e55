"""Validation of RoPE calls, and the ``[B, S, H, D]`` view every tier works on.

Everything is checked before anything is written: a bad call raises ``ValueError`` naming the
problem and leaves q and k untouched. Shapes, dtypes and devices are static under Dynamo, so these
checks cost no graph break.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._core.compat import is_compiling
from ._runtime import args as _args
from ._runtime.memory import check_no_overlap



def sequence_dim_of(x: torch.Tensor, sequence_dim: Optional[int]) -> int:
    """The dim of ``x`` that holds the tokens (``sequence_dim`` checked, or the default for its rank)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(x).__name__}")
    _args.dim(sequence_dim, "sequence_dim")
    rank = x.dim()
    if rank not in (3, 4):
        raise ValueError(f"q must be 3-D [T, H, D] or 4-D [B, S, H, D] / [B, H, S, D], got shape "
                         f"{tuple(x.shape)} (rank {rank})")
    if sequence_dim is None:
        return 0 if rank == 3 else 1
    allowed = (0,) if rank == 3 else (1, 2)
    sd = sequence_dim + rank if sequence_dim < 0 else sequence_dim
    if sd not in allowed:
        raise ValueError(f"sequence_dim={sequence_dim} is invalid for a {rank}-D q; expected one "
                         f"of {allowed}")
    return sd


def bshd(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """A [B, S, H, D] view of x (no copy)."""
    if x.dim() == 3:
        return x.unsqueeze(0)
    return x if seq_dim == 1 else x.transpose(1, 2)


def check_qk(q: torch.Tensor, k: Optional[torch.Tensor], seq_dim: int) -> tuple[int, int, int]:
    """Returns (B, S, D) of the [B, S, H, D] view; raises ValueError on any mismatch."""
    _args.float_tensor(q, "q")
    B, S, H, D = bshd(q, seq_dim).shape
    if H < 1 or D < 2:
        raise ValueError(f"q needs at least one head and head_dim >= 2, got shape {tuple(q.shape)}")
    check_no_overlap(q, "q")
    if k is None:
        return B, S, D
    if not isinstance(k, torch.Tensor):
        raise ValueError(f"k must be a torch.Tensor or None, got {type(k).__name__}")
    if k is q:
        raise ValueError("q and k are the same tensor: it would be rotated twice")
    if k.dtype != q.dtype:
        raise ValueError(f"q and k dtypes differ: {q.dtype} vs {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"q and k are on different devices: {q.device} vs {k.device}")
    if k.dim() != q.dim():
        raise ValueError(f"q and k ranks differ: {tuple(q.shape)} vs {tuple(k.shape)}")
    kb, ks, kh, kd = bshd(k, seq_dim).shape
    if (kb, ks, kd) != (B, S, D):
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch, "
                         "sequence length or head dim (only the head count may differ)")
    if kh < 1:
        raise ValueError(f"k needs at least one head, got shape {tuple(k.shape)}")
    check_no_overlap(k, "k")
    return B, S, D


def check_rotary_dim(rotary_dim: int, head_dim: int, given: Optional[int]) -> int:
    if _args.dim(given, "rotary_dim") is not None and given != rotary_dim:
        raise ValueError(f"rotary_dim={given} does not match the cos/sin width {rotary_dim}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be positive and even, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} is larger than the head dim {head_dim}")
    return rotary_dim


def check_table(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_per_token(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, S: int, D: int,
                    rotary_dim: Optional[int]) -> int:
    check_table(cos, "cos", q)
    check_table(sin, "sin", q)
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin shapes differ: {tuple(cos.shape)} vs {tuple(sin.shape)}")
    if cos.shape[0] != S:
        raise ValueError(f"cos/sin have {cos.shape[0]} rows but the sequence length is {S}; "
                         "expected cos, sin of shape [S, rotary_dim]")
    return check_rotary_dim(cos.shape[1], D, rotary_dim)


def check_cache(q: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, B: int, S: int,
                D: int, rotary_dim: Optional[int]) -> int:
    check_table(cache, "cos_sin_cache", q)
    r = check_rotary_dim(cache.shape[1], D, rotary_dim)
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    if positions.device != q.device:
        raise ValueError(f"positions is on {positions.device} but q is on {q.device}")
    ok_shapes = [(S,)] if q.dim() == 3 else [(S,), (B, S)]
    if tuple(positions.shape) not in ok_shapes:
        raise ValueError(f"positions shape {tuple(positions.shape)} does not match q: expected one "
                         f"of {ok_shapes}")
    check_positions_range(positions, cache.shape[0])
    return r


def check_positions_range(positions: torch.Tensor, rows: int) -> None:
    # Only where it is cheap: CPU tensors in eager mode (a GPU check would synchronize, and a
    # data-dependent check would break a graph).
    if positions.device.type != "cpu" or positions.numel() == 0 or is_compiling():
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= rows:
        raise ValueError(f"positions range [{lo}, {hi}] is outside cos_sin_cache rows [0, {rows})")


def positions_2d(positions: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[S] -> [1, S] (broadcast over batch), [B, S] unchanged."""
    if positions is None:
        return None
    return positions.unsqueeze(0) if positions.dim() == 1 else positions
