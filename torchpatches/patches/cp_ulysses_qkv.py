"""cp_ulysses_qkv: q, k and v of diffusers' Ulysses attention in one all-to-all instead of three (eager host time).

What goes wrong upstream
    Under diffusers' context parallelism with Ulysses (``ContextParallelConfig(ulysses_degree=N)``)
    ``TemplatedUlyssesAttention.forward`` exchanges q, k and v in three all-to-alls, each preceded by a
    ``reshape`` / ``permute`` / ``contiguous`` copy and followed by a ``flatten`` / ``permute`` / ``contiguous`` copy:
    per attention call three collectives and twelve tensor calls where one collective would move the same bytes. On
    a FLUX.1-dev step (57 attention calls) that is 114 collectives more than needed, each about 100 µs of host time
    through c10d on an H200 host, on a step that context parallelism already makes host-bound (docs/fused.md,
    "Context parallelism on two GPUs"). No upstream issue as of diffusers 0.42.1.

What the patch changes
    ``TemplatedUlyssesAttention.forward`` is diffusers' own code (0.42.1) but for the exchange of q, k and v: the
    three are copied into one buffer laid out ``[rank, q/k/v, token, batch, head, dim]`` (``torch.stack`` of the
    views diffusers makes contiguous), exchanged with one call of the module's ``_all_to_all_single`` (through c10d
    where ``cp_all_to_all`` applies, the functional collective otherwise), and copied once into q, k and v laid out
    as diffusers' copies are (``[batch, token, head, dim]``, contiguous; three views of one buffer). Data movement
    only: the attention sees the same values in the same layout, bit for bit, and leaves on ``ctx`` what diffusers'
    unchanged backward reads. The output's exchange, the mask gather and the log-sum-exp are the original's. The
    original forward runs under torch.compile (Dynamo traces diffusers' code), under a transform (functorch, forward
    AD, ``torch.jit.trace``) or a Python torch-function / dispatch mode (they see diffusers' ops, as without the
    patch), and when q, k and v are not three plain tensors of one shape, dtype and device (cross-attention with
    another key length, tensor subclasses), or their heads do not split evenly over the ranks (the original raises
    its own error).

Versions
    diffusers 0.39 - 0.42: ``TemplatedUlyssesAttention.forward`` fingerprinted in 0.39.0 and 0.40.0 (one source,
    differing from 0.41's by the return annotation only), 0.41.0, 0.42.0 and 0.42.1 (tools/fingerprint_diffusers.py).
    0.38 and older have no mask gather. Any torch with ``torch.distributed``.

When to delete
    When diffusers exchanges q, k and v of Ulysses attention in one collective.
"""
from __future__ import annotations

from typing import Any

import torch

from .._compat import is_compiling
from .._declare import Patch, Target
from ..ops._tiers import eager_transforms
from ._direct_collectives import distributed_missing, modes_active

__all__ = ["PATCH"]


def _batchable(query: Any, key: Any, value: Any, world_size: int) -> bool:
    """q, k, v are three plain tensors of one shape, dtype and device whose heads split over the ranks."""
    return (
        type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor
        and query.dim() == 4
        and query.shape == key.shape == value.shape
        and query.dtype == key.dtype == value.dtype
        and query.device == key.device == value.device
        and isinstance(world_size, int) and world_size > 0 and query.shape[2] % world_size == 0
        and not modes_active()
    )


def _exchanged_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, world_size: int, group: Any,
                   all_to_all: Any) -> Any:
    """q, k, v after one all-to-all: each [B, S_LOCAL * world_size, H / world_size, D], contiguous, as diffusers'."""
    B, S_LOCAL, H, D = query.shape
    H_LOCAL = H // world_size
    packed = torch.stack([x.reshape(B, S_LOCAL, world_size, H_LOCAL, D).permute(2, 1, 0, 3, 4)
                          for x in (query, key, value)], dim=1)  # [rank, q/k/v, S_LOCAL, B, H_LOCAL, D]
    packed = all_to_all(packed, group)  # rank r now holds every rank's tokens of its H_LOCAL heads
    gathered = packed.permute(1, 3, 0, 2, 4, 5).reshape(3, B, world_size * S_LOCAL, H_LOCAL, D)
    return gathered.unbind(0)


def _replacement(original: Any) -> staticmethod:
    import torch.distributed as dist

    original_forward = original.__func__
    module_globals = original_forward.__globals__  # diffusers' module: its _all_to_all_single, looked up per call

    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        return_lse: bool,
        forward_op: Any,
        backward_op: Any,
        _parallel_config: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        world_size = _parallel_config.context_parallel_config.ulysses_degree
        if is_compiling() or eager_transforms() or not _batchable(query, key, value, world_size):
            return original_forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                    return_lse, forward_op, backward_op, _parallel_config)
        # From here on diffusers 0.42.1's code, but for the exchange of q, k and v.
        ulysses_mesh = _parallel_config.context_parallel_config._ulysses_mesh
        group = ulysses_mesh.get_group()
        all_to_all = module_globals["_all_to_all_single"]

        ctx.forward_op = forward_op
        ctx.backward_op = backward_op
        ctx._parallel_config = _parallel_config

        B, S_Q_LOCAL, H, D = query.shape
        _, S_KV_LOCAL, _, _ = key.shape
        H_LOCAL = H // world_size
        query, key, value = _exchanged_qkv(query, key, value, world_size, group, all_to_all)

        if attn_mask is not None and attn_mask.shape[-1] == S_KV_LOCAL:
            # All-gather a local mask so its layout matches the QKV layout after all-to-all.
            mask_list = [torch.empty_like(attn_mask) for _ in range(world_size)]
            dist.all_gather(mask_list, attn_mask, group=group)
            attn_mask = torch.cat(mask_list, dim=-1)

        out = forward_op(
            ctx,
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            return_lse,
            _save_ctx=True,
            _parallel_config=_parallel_config,
        )
        if return_lse:
            out, lse, *_ = out

        out = out.reshape(B, world_size, S_Q_LOCAL, H_LOCAL, D).permute(1, 3, 0, 2, 4).contiguous()
        out = all_to_all(out, group)
        out = out.flatten(0, 1).permute(1, 2, 0, 3).contiguous()

        if return_lse:
            lse = lse.reshape(B, world_size, S_Q_LOCAL, H_LOCAL).permute(1, 3, 0, 2).contiguous()
            lse = all_to_all(lse, group)
            lse = lse.flatten(0, 1).permute(1, 2, 0).contiguous()
        else:
            lse = None

        return (out, lse) if return_lse else out

    forward.__doc__ = original_forward.__doc__
    return staticmethod(forward)


PATCH = Patch(
    name="cp_ulysses_qkv",
    summary="diffusers' Ulysses attention (context parallelism) exchanges q, k and v in one all-to-all in eager",
    targets=(
        Target("diffusers.models.attention_dispatch:TemplatedUlyssesAttention.forward",
               make_replacement=_replacement, fingerprints=frozenset({
                   "bde09d809fc40a14",  # 0.39.0, 0.40.0
                   "2c5f01f95921ec84",  # 0.41.0, 0.42.0, 0.42.1
               })),
    ),
    requires={"diffusers": ">=0.39,<0.43"},
    precondition=distributed_missing,
)
