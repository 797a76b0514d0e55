"""FLUX's rotary tables in one launch: what ``FluxPosEmbed`` / ``Flux2PosEmbed`` compute from the position ids.

Usable without any patching::

    cos, sin = rope_tables(ids, axes_dim=(16, 56, 56), theta=10000)   # ids [S, 3] -> cos, sin [S, 128] fp32

``ids`` may be of any real float or integer dtype (FLUX.2's pipeline passes int64): read as ``ids.float()``.

For each axis ``i`` (``len(axes_dim)`` of them, one column of ``ids`` each) diffusers' ``get_1d_rotary_pos_embed``
computes ``freqs = 1.0 / (theta ** (arange(0, dim, 2, float64) / dim))`` (``/ 1.0``), then
``outer(ids[:, i].float(), freqs)`` in float64, its ``cos`` and ``sin``, each repeated twice along the columns
(``repeat_interleave(2)``) and rounded to float32; the axes' tables are concatenated. About fourteen kernel
launches per axis, with the casts and concatenations 44 per call for FLUX.1's three axes and 58 for FLUX.2's four
(the launches the op removed from a step, measured: docs/fused.md), all before the first transformer block.

Tiers (``_tiers``): Triton on CUDA (one kernel; the frequency vectors are computed once per device, theta and
axes with diffusers' own ops, and cached), PyTorch elsewhere and for calls autograd records (diffusers' code).
Under ``torch.compile`` the call is one ``torchpatches::rope_tables`` custom op with a fake.

Numerics: the same fp64 frequencies (the same ops computed them), the same fp64 product, cos and sin from the
CUDA math library (libdevice on the GPU, as torch's fp64 kernels), one rounding to fp32: the kernel is meant to
give diffusers' bits on CUDA (tests/ops/test_rope_tables.py checks it there). The CPU interpreter takes numpy's
cos / sin against torch's CPU ones: within one fp32 ulp.
"""
from __future__ import annotations

import threading
from typing import Dict, Sequence, Tuple

import torch

from ._runtime import args as _args, dispatch as _dispatch
from ._runtime.tiers import POSITION_DTYPES, choose_tier, force_tier, needs_grad

__all__ = ["rope_tables", "force_tier"]

_FREQS: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
_FREQS_LOCK = threading.Lock()


def _axis_freqs(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # diffusers 0.42.1 get_1d_rotary_pos_embed (ntk_factor=1.0, linear_factor=1.0, freqs_dtype=float64), its ops
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)) / 1.0


def _build_frequencies(axes_dim: Tuple[int, ...], theta: float, device: torch.device
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.cat([_axis_freqs(dim, theta, device) for dim in axes_dim])
    # Filled on the device: no host copy, so a first call inside a CUDA-graph capture stays capturable.
    axis_of = torch.cat([torch.full((dim // 2,), i, dtype=torch.int32, device=device)
                         for i, dim in enumerate(axes_dim)])
    return freqs, axis_of


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _frequencies(axes_dim: Tuple[int, ...], theta: float, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(fp64 frequency of each half-column, int32 axis of each half-column) on ``device``, built once per key with
    diffusers' ops (so the same bits as its per-call ones) and kept: a few hundred bytes per model.

    Kept only once written: built inside a CUDA-graph capture the kernels are only recorded (the graph computes
    them at each replay, nothing is kept); built on CUDA, the stream is synchronized once before the entry is
    shared, so a caller on another stream never reads it half-written."""
    key = (axes_dim, float(theta), device)
    entry = _FREQS.get(key)
    if entry is not None:
        return entry
    if _capturing(device):
        return _build_frequencies(axes_dim, theta, device)
    with _FREQS_LOCK:
        entry = _FREQS.get(key)
        if entry is None:
            entry = _build_frequencies(axes_dim, theta, device)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            _FREQS[key] = entry
    return entry


def _torch_tier(ids: torch.Tensor, axes_dim: Sequence[int], theta: float) -> list[torch.Tensor]:
    # diffusers 0.42.1 FluxPosEmbed.forward / get_1d_rotary_pos_embed(use_real=True, repeat_interleave_real=True)
    pos = ids.float()
    cos_out, sin_out = [], []
    for i, dim in enumerate(axes_dim):
        freqs = torch.outer(pos[:, i], _axis_freqs(dim, theta, ids.device))
        cos_out.append(freqs.cos().repeat_interleave(2, dim=1, output_size=freqs.shape[1] * 2).float())
        sin_out.append(freqs.sin().repeat_interleave(2, dim=1, output_size=freqs.shape[1] * 2).float())
    return [torch.cat(cos_out, dim=-1), torch.cat(sin_out, dim=-1)]


def _impl(ids: torch.Tensor, axes_dim: Sequence[int], theta: float, tier: str) -> list[torch.Tensor]:
    if tier == "torch":
        return _torch_tier(ids, axes_dim, theta)
    from . import _rope_tables_triton

    freqs, axis_of = _frequencies(tuple(axes_dim), theta, ids.device)
    width = sum(axes_dim)
    cos = torch.empty((ids.shape[0], width), dtype=torch.float32, device=ids.device)
    sin = torch.empty_like(cos)
    _rope_tables_triton.launch(ids, freqs, axis_of, cos, sin)
    return [cos, sin]


@torch.library.custom_op("torchpatches::rope_tables", mutates_args=())
def _rope_tables_op(ids: torch.Tensor, axes_dim: list[int], theta: float, tier: str) -> list[torch.Tensor]:
    return _impl(ids, axes_dim, theta, tier)


@_rope_tables_op.register_fake
def _(ids, axes_dim, theta, tier):
    shape = (ids.shape[0], sum(axes_dim))
    return [ids.new_empty(shape, dtype=torch.float32), ids.new_empty(shape, dtype=torch.float32)]


def _check(ids: torch.Tensor, axes_dim: Sequence[int], theta: float) -> Tuple[int, ...]:
    _args.tensor(ids, "ids")
    if ids.dtype not in POSITION_DTYPES:
        raise ValueError(f"ids dtype {ids.dtype} is not supported; expected a real float or integer dtype "
                         f"({', '.join(str(d).replace('torch.', '') for d in POSITION_DTYPES)})")
    if ids.dim() != 2:
        raise ValueError(f"ids must be 2-D [S, axes], got shape {tuple(ids.shape)}")
    try:
        dims = tuple(axes_dim)
    except TypeError:
        raise ValueError(f"axes_dim must be a sequence of ints, got {axes_dim!r}") from None
    if not dims or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 or d % 2 for d in dims):
        raise ValueError(f"axes_dim must be positive even ints, got {axes_dim!r}")
    dims = tuple(int(d) for d in dims)
    if len(dims) > ids.shape[1]:
        raise ValueError(f"ids has {ids.shape[1]} columns, fewer than the {len(dims)} axes of axes_dim")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"theta must be a positive number, got {theta!r}")
    return dims


@_dispatch.public
def rope_tables(ids: torch.Tensor, axes_dim: Sequence[int], theta: float, *,
                tier: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, fp32 ``[S, sum(axes_dim)]``, of the position ids ``[S, A]`` (column ``i`` for axis ``i``;
    columns past ``len(axes_dim)`` are not read), as diffusers' FLUX position embedders compute them.

    Raises:
        ValueError: on ids that are not a 2-D tensor of a real float or integer dtype, axes that are not positive
        even ints or more than ids' columns, or a theta that is not a positive number.
    """
    dims = _check(ids, axes_dim, theta)
    grad = needs_grad(ids)
    chosen = choose_tier(ids.device.type, tier, grad)
    outs = _dispatch.run(ids, grad, _impl, _rope_tables_op, ids, list(dims), float(theta), chosen)
    return outs[0], outs[1]
