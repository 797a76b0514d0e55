"""cp_ring_gather: the key/value all-gather of diffusers' ring attention through c10d directly (eager host time).

What goes wrong upstream
    Under diffusers' context parallelism with ring attention (``ContextParallelConfig(ring_degree=N)``) every
    attention call gathers the ranks' keys and values in ``TemplatedRingAttention.forward`` with
    ``funcol.all_gather_tensor``. Its result is an ``AsyncCollectiveTensor``: the ``chunk``, the slices and the
    ``reshape_as`` that follow, and the attention call that finally reads a chunk, each go through that subclass'
    ``__torch_dispatch__`` (a pytree walk per op) before the ``wait_tensor``. On a FLUX.1-dev step (57 attention
    calls) diffusers' ring step made 116,021 Python calls where its Ulysses step made 43,346 (rank 0 under
    cProfile), on a step that context parallelism already makes host-bound (docs/fused.md, "Context parallelism,
    round 9"). The call also warns (``FutureWarning``: ``all_gather_tensor`` is deprecated) on torch 2.13 (not on
    2.11), an error under ``-W error``; diffusers' output gather hook makes the same call once per step, which this
    patch does not change. No upstream issue as of diffusers 0.42.1.

What the patch changes
    ``TemplatedRingAttention.forward`` is diffusers' own code (0.42.1) with one line changed: in eager, the gather
    is ``torch.distributed.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13) into a new 1-D tensor:
    the ranks' buffers in rank order, the same values bit for bit as the functional collective's (data movement
    only), ordered on the current stream before anything that reads them, and a plain tensor, so the views and the
    attention call that follow are plain torch calls. Everything else (the ring loop, the log-sum-exp merge, what
    the forward leaves on ``ctx`` for diffusers' unchanged backward) is the original's. The original forward runs
    under torch.compile (Dynamo traces the functional collective) and under a transform (functorch, forward AD,
    ``torch.jit.trace``); the functional gather runs, as in the original, for what c10d may not replace
    (``_direct_collectives``: a tensor subclass, a group that is not a ``ProcessGroup``, a Python torch-function or
    dispatch mode, complex or empty buffers, a ``_coalescing_manager`` block, CUDA-graph capture). The backward,
    ``TemplatedRingAnythingAttention`` (uneven shards) and the output gather of diffusers' hooks are not touched.

Versions
    diffusers 0.40 - 0.42: ``TemplatedRingAttention.forward`` fingerprinted in 0.40.0 (its source differs from
    0.41's by the return annotation only), 0.41.0, 0.42.0 and 0.42.1 (tools/fingerprint_diffusers.py). 0.39 and older
    leave nothing on ``ctx`` for their backward's reconstruction and are not verified. Any torch with
    ``torch.distributed``.

When to delete
    When diffusers' ring attention gathers with c10d in eager (or waits on the functional result before viewing it),
    or when the functional collectives cost no more host time than c10d's in eager.
"""
from __future__ import annotations

from typing import Any

import torch

from .._compat import is_compiling
from .._declare import Patch, Target
from ..ops._tiers import eager_transforms
from ._direct_collectives import direct_fits, distributed_missing

__all__ = ["PATCH"]


def _replacement(original: Any) -> staticmethod:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    original_forward = original.__func__
    process_group = dist.ProcessGroup
    # ``all_gather_into_tensor`` warns that it is deprecated from torch 2.13, which has ``all_gather_single``.
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gathered(kv_buffer: torch.Tensor, group: Any) -> torch.Tensor:
        if not direct_fits(kv_buffer, group, process_group):  # the buffer is contiguous: the forward made it so
            # looked up per call, as the original's is (a wrapper put on it is honoured)
            return funcol.all_gather_tensor(kv_buffer, gather_dim=0, group=group)
        out = kv_buffer.new_empty((group.size() * kv_buffer.numel(),))
        gather_into(out, kv_buffer, group=group)
        return out

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
        if is_compiling() or eager_transforms():
            return original_forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                    return_lse, forward_op, backward_op, _parallel_config)
        # From here on diffusers 0.42.1's code, but for the gather.
        ring_mesh = _parallel_config.context_parallel_config._ring_mesh
        rank = _parallel_config.context_parallel_config._ring_local_rank
        world_size = _parallel_config.context_parallel_config.ring_degree
        next_rank = (rank + 1) % world_size
        prev_out = prev_lse = None

        ctx.forward_op = forward_op
        ctx.backward_op = backward_op
        ctx.q_shape = query.shape
        ctx.kv_shape = key.shape
        ctx._parallel_config = _parallel_config

        kv_buffer = torch.cat([key.flatten(), value.flatten()]).contiguous()
        kv_buffer = gathered(kv_buffer, ring_mesh.get_group())
        kv_buffer = kv_buffer.chunk(world_size)

        for i in range(world_size):
            if i > 0:
                kv = kv_buffer[next_rank]
                key_numel = key.numel()
                key = kv[:key_numel].reshape_as(key)
                value = kv[key_numel:].reshape_as(value)
                next_rank = (next_rank + 1) % world_size

            out, lse = forward_op(
                ctx,
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                True,
                _save_ctx=i == 0,
                _parallel_config=_parallel_config,
            )

            if _parallel_config.context_parallel_config.convert_to_fp32:
                out = out.to(torch.float32)
                lse = lse.to(torch.float32)

            # Some backends return a 3-D log-sum-exp, others a trailing-1 dim (diffusers PR 12693).
            if lse.ndim == 3:
                lse = lse.unsqueeze(-1)
            if prev_out is not None:
                out = prev_out - torch.nn.functional.sigmoid(lse - prev_lse) * (prev_out - out)
                lse = prev_lse - torch.nn.functional.logsigmoid(prev_lse - lse)
            prev_out = out
            prev_lse = lse

        out = out.to(query.dtype)
        lse = lse.squeeze(-1)

        # diffusers' backward reconstructs each ring iteration from the reduced out / lse.
        ctx.ring_out = out.detach()
        ctx.ring_lse = lse.detach()

        return (out, lse) if return_lse else out

    forward.__doc__ = original_forward.__doc__
    return staticmethod(forward)


PATCH = Patch(
    name="cp_ring_gather",
    summary="diffusers' ring attention key/value all-gather (context parallelism) through c10d directly in eager",
    targets=(
        Target("diffusers.models.attention_dispatch:TemplatedRingAttention.forward", make_replacement=_replacement,
               fingerprints=frozenset({
                   "692d5647b854066c",  # 0.40.0
                   "5c2a1afd0944687b",  # 0.41.0, 0.42.0, 0.42.1
               })),
    ),
    requires={"diffusers": ">=0.40,<0.43"},
    precondition=distributed_missing,
)
