"""Plain-PyTorch RoPE tier: runs anywhere, and Inductor can fuse it with its neighbours.

Math is diffusers' ``apply_rotary_emb`` (``use_real=True``): ``out = x * cos + rotate(x) * sin`` in
fp32, cast back to x's dtype, on the first ``rotary_dim`` elements of every head; the tail passes
through. All functions take 4-D ``[B, S, H, D]`` views (``ops/_rope.py`` makes them from the public
layouts without copying), so in-place writes land in the caller's tensor.
"""
from __future__ import annotations

from typing import Optional

import torch


def full_cos_sin(
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor],
    *,
    interleaved: bool,
    cos_half: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as fp32 ``[B or 1, S, 1, rotary_dim]``, one value per element (diffusers' form).

    ``positions`` (``[B or 1, S]``) gathers rows; ``cos_half`` rows hold one value per pair and are
    widened: repeated per pair when interleaved, concatenated twice for NeoX halves.
    """
    if positions is not None:
        # Rows outside the cache give NaN, never a read outside it: under torch.compile (and on a GPU)
        # nothing checks positions before this runs (see ops/_rope.py), and an index Inductor does
        # not bound-check, or Python's wrap-around for -1, would give a plausible wrong answer.
        rows = cos.shape[0]
        index = positions.long()
        valid = ((index >= 0) & (index < rows)).unsqueeze(-1)
        index = index.clamp(0, max(rows - 1, 0))
        nan = torch.full((), float("nan"), dtype=torch.float32, device=cos.device)
        cos = torch.where(valid, cos[index].float(), nan)  # [B or 1, S, width]
        sin = torch.where(valid, sin[index].float(), nan)
    else:
        cos = cos[None]
        sin = sin[None]
    cos = cos.float()
    sin = sin.float()
    if cos_half:
        if interleaved:
            cos = cos.repeat_interleave(2, dim=-1)
            sin = sin.repeat_interleave(2, dim=-1)
        else:
            cos = torch.cat([cos, cos], dim=-1)
            sin = torch.cat([sin, sin], dim=-1)
    return cos.unsqueeze(2), sin.unsqueeze(2)


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of each element with the sign of the rotation: (-x2, x1) per pair."""
    if interleaved:
        a, b = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        return torch.stack([-b, a], dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope_rotary_part(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool
) -> torch.Tensor:
    """Rotated first ``rotary_dim`` elements of ``x`` (``[B, S, H, D]``), in x's dtype."""
    xr = x[..., :rotary_dim]
    return (xr.float() * cos + rotate(xr, interleaved).float() * sin).to(x.dtype)


def rope_inplace(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool
) -> None:
    x[..., :rotary_dim].copy_(rope_rotary_part(x, cos, sin, rotary_dim, interleaved))


def rope_out(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool
) -> torch.Tensor:
    rot = rope_rotary_part(x, cos, sin, rotary_dim, interleaved)
    if rotary_dim == x.shape[-1]:
        return rot
    return torch.cat([rot, x[..., rotary_dim:]], dim=-1)
