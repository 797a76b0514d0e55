"""References written independently of ``torchpatches.ops``: :func:`rope_reference` (float64) and :func:`rel_err`."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["rope_reference", "rel_err"]


def rope_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    *,
    interleaved: bool,
    seq_dim: int,
    cos_half: bool = False,
) -> torch.Tensor:
    """RoPE in float64 with explicit pair indexing, written independently of ``torchpatches.ops``.

    ``x``: ``[T, H, D]`` or ``[B, S, H, D]`` / ``[B, H, S, D]`` (``seq_dim`` 0, 1 or 2). ``cos``/``sin``:
    one value per element (``[S, r]``, or ``[B or 1, S, r]`` already gathered), or with ``cos_half`` one
    per pair (``[rows, r / 2]``); ``positions`` (``[S]`` or ``[B, S]``) gathers rows first.
    """
    x = x.double()
    xv = x.unsqueeze(0) if x.dim() == 3 else (x if seq_dim == 1 else x.transpose(1, 2))
    B, S = xv.shape[:2]
    c, s = cos.double(), sin.double()
    if positions is not None:
        p = positions.long()
        p = p.reshape(1, S) if x.dim() == 3 else (p.expand(B, S) if p.dim() == 1 else p)
        c, s = c[p], s[p]  # [B, S, width]
    elif c.dim() == 2:
        c, s = c[None], s[None]
    r = c.shape[-1] * (2 if cos_half else 1)
    out = xv.clone()
    for i in range(r // 2):
        ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        if cos_half:
            ca = cb = c[..., i]
            sa = sb = s[..., i]
        else:
            ca, cb, sa, sb = c[..., ia], c[..., ib], s[..., ia], s[..., ib]
        a, b = xv[..., ia], xv[..., ib]
        out[..., ia] = a * ca[..., None] - b * sa[..., None]
        out[..., ib] = b * cb[..., None] + a * sb[..., None]
    if x.dim() == 3:
        return out.squeeze(0)
    return out if seq_dim == 1 else out.transpose(1, 2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (L2, in float64); NaN when ``out`` has a NaN."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
