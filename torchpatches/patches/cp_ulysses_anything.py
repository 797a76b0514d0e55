"""cp_ulysses_anything: diffusers' uneven-shard Ulysses attention in eager with one size exchange per attention call
and its all-to-alls through c10d.

What goes wrong upstream
    With ``ContextParallelConfig(ulysses_degree=N, ulysses_anything=True)`` (sequences of any length, diffusers'
    answer to a token count the ranks cannot split evenly, e.g. Qwen-Image's 1328x1328) every attention call runs
    ``TemplatedUlyssesAnythingAttention.forward``, and it asks every rank for its local sequence length four times
    per call: once per exchange of q, k, v and the output (five with the log-sum-exp, six with a mask), each through
    ``gather_size_by_comm``. On an NCCL group each of those is a host synchronisation: the length goes to the GPU
    through a pageable copy, is all-gathered, and comes back as one ``.item()`` per rank -- about twelve waits for
    the GPU per attention call on two ranks, so the host cannot run ahead of the GPU. On two H200s FLUX.1-dev's step
    took 361-373 ms with ``ulysses_anything`` against 167-236 ms under plain Ulysses with the same (even) shards,
    torchpatches' fused glue made it slower still (1.05x / 1.11x: the GPU time it saves no longer overlaps anything),
    and ``cpu:gloo,cuda:nccl`` (diffusers' own remedy: the lengths over gloo) measured 346-391 ms (docs/notes/context_parallel.md,
    "The uneven modes"). The exchanges themselves go through the functional collectives
    (``cp_all_to_all``'s banner says what that costs in eager). No upstream issue as of diffusers 0.42.1.

What the patch changes
    ``TemplatedUlyssesAnythingAttention.forward`` is diffusers 0.42.1's code with, in eager:

    - one exchange of every rank's (query, key, value) lengths per attention call (``ints_of_every_rank``), on the
      device ``gather_size_by_comm`` picks (the CPU where the group has a CPU backend, else the accelerator), written
      there by fills instead of a pageable copy and read back with one ``tolist()``: one wait for the GPU per call
      instead of about twelve. The output's and the log-sum-exp's input splits are the query lengths, the mask's the key
      lengths (the mask branch runs only where a mask is as long as the local keys), as diffusers gathers them;
    - the all-to-alls of q, k, v, the output and the log-sum-exp through ``torch.distributed.all_to_all_single``
      with diffusers' split sizes into a new tensor (data movement only: the same values bit for bit), where c10d
      may stand in for the functional collective (``_direct_collectives``); the functional one (and its wait)
      otherwise.

    The layouts, head padding and the mask's gather are diffusers' own code, called as the original calls them.
    The original forward runs under torch.compile (Dynamo traces it), under a transform (functorch, forward AD,
    ``torch.jit.trace``) and for inputs that are not plain tensors.

    Every rank must run the same forward: the patch makes one collective where the original made four, so a rank
    with it and a rank without it (``TORCHPATCHES_DISABLE`` set on one rank only) wait for each other forever.
    Whether it runs depends only on what is equal on every rank (compiling, transforms, tensor types), never on a
    rank's own sequence length; per exchange a rank may take c10d or the functional collective (a rank without
    tokens takes the functional one), which is the same all-to-all on the same group either way.

Versions
    diffusers 0.40 - 0.42: ``TemplatedUlyssesAnythingAttention.forward`` fingerprinted in 0.40.0 (its source differs
    from 0.41's by the return annotation only), 0.41.0, 0.42.0 and 0.42.1 (tools/fingerprint_diffusers.py); the
    helpers it calls (``ulysses_anything_metadata``, the head padding, ``all_to_all_single_any_qkv_async`` /
    ``_o_async`` whose bodies the patch runs with the lengths given) read in 0.40.0 and 0.42.1, the same code. Any
    torch with ``torch.distributed`` and ``torch.accelerator``.

When to delete
    When diffusers exchanges the lengths once per attention call (or per forward) without a host round trip per
    rank, and its eager exchanges call c10d directly.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, List

import torch

from .._core.compat import is_compiling
from .._core.declare import Patch, Target
from ..ops._runtime.tiers import eager_transforms
from ._direct_collectives import direct_fits, distributed_missing, ints_of_every_rank

__all__ = ["PATCH"]

_MODULE = "diffusers.models.attention_dispatch"


def _exchange_with(process_group: type, dispatch: Any) -> Callable[..., torch.Tensor]:
    """diffusers' ``funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group)`` followed by its
    wait: through c10d into a new tensor where it may stand in, else the functional collective."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def exchange(x: torch.Tensor, output_split_sizes: List[int], input_split_sizes: List[int],
                 group: Any) -> torch.Tensor:
        if not direct_fits(x, group, process_group):  # x is contiguous: the caller made it so
            return dispatch._wait_tensor(funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, group))
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)
        return out

    return exchange


def _replacement(original: Any) -> staticmethod:
    import torch.distributed as dist
    import torch.nn.functional as F

    original_forward = original.__func__
    dispatch = importlib.import_module(_MODULE)
    exchange = _exchange_with(dist.ProcessGroup, dispatch)

    def qkv_to_heads(x: torch.Tensor, output_split_sizes: List[int], group: Any) -> torch.Tensor:
        """``all_to_all_single_any_qkv_async`` and its wait, with the lengths already gathered."""
        world_size = dist.get_world_size(group=group)
        B, S_LOCAL, H, D = x.shape
        x, H_PAD = dispatch._maybe_pad_qkv_head(x, H, group)
        H_LOCAL = (H + H_PAD) // world_size
        x = x.reshape(B, S_LOCAL, world_size, H_LOCAL, D).permute(2, 1, 0, 3, 4).contiguous()
        input_split_sizes = [S_LOCAL] * world_size
        x = x.flatten(0, 1)
        x = exchange(x, output_split_sizes, input_split_sizes, group)
        x = x.permute(1, 0, 2, 3).contiguous()
        return dispatch._maybe_unpad_qkv_head(x, H_PAD, group)

    def o_to_sequence(x: torch.Tensor, input_split_sizes: List[int], group: Any, **kwargs: Any) -> torch.Tensor:
        """``all_to_all_single_any_o_async`` and its wait, with the lengths already gathered."""
        H = kwargs.get("NUM_QO_HEAD", None)
        world_size = dist.get_world_size(group=group)
        x, H_PAD = dispatch._maybe_pad_o_head(x, H, group)
        B, S_GLOBAL, H_LOCAL, D = x.shape
        S_LOCAL = kwargs.get("Q_S_LOCAL")
        x = x.permute(1, 0, 2, 3).contiguous()
        output_split_sizes = [S_LOCAL] * world_size
        x = exchange(x, output_split_sizes, input_split_sizes, group)
        x = x.reshape(world_size, S_LOCAL, B, H_LOCAL, D)
        x = x.permute(2, 1, 0, 3, 4).contiguous()
        x = x.reshape(B, S_LOCAL, world_size * H_LOCAL, D)
        return dispatch._maybe_unpad_o_head(x, H_PAD, group)

    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor,
        dropout_p: float,
        is_causal: bool,
        scale: float,
        enable_gqa: bool,
        return_lse: bool,
        forward_op: Any,
        backward_op: Any,
        _parallel_config: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # Only what is equal on every rank decides (the ranks must make the same collectives).
        if (is_compiling() or eager_transforms()
                or not type(query) is type(key) is type(value) is torch.Tensor):
            return original_forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                    return_lse, forward_op, backward_op, _parallel_config, **kwargs)
        # From here on diffusers 0.42.1's code, but for the lengths' exchange and the all-to-alls.
        ulysses_mesh = _parallel_config.context_parallel_config._ulysses_mesh
        group = ulysses_mesh.get_group()

        ctx.forward_op = forward_op
        ctx.backward_op = backward_op
        ctx._parallel_config = _parallel_config

        _, S_KV_LOCAL, _, _ = key.shape

        metadata = dispatch.ulysses_anything_metadata(query)
        lengths = ints_of_every_rank((query.shape[1], key.shape[1], value.shape[1]), group)
        q_lengths, kv_lengths, v_lengths = ([rank[i] for rank in lengths] for i in range(3))
        query = qkv_to_heads(query, q_lengths, group)
        key = qkv_to_heads(key, kv_lengths, group)
        value = qkv_to_heads(value, v_lengths, group)

        if attn_mask is not None and attn_mask.shape[-1] == S_KV_LOCAL:
            # All-gather a local mask to match the post-all-to-all global sequence (padded to the longest).
            mask_local_sizes = kv_lengths  # each rank's mask is as long as its keys on this branch
            max_local = max(mask_local_sizes)
            if attn_mask.shape[-1] < max_local:
                attn_mask = F.pad(attn_mask, (0, max_local - attn_mask.shape[-1]))
            mask_list = [torch.empty_like(attn_mask) for _ in range(dist.get_world_size(group=group))]
            dist.all_gather(mask_list, attn_mask, group=group)
            attn_mask = torch.cat(mask_list, dim=-1)
            attn_mask = attn_mask[..., : sum(mask_local_sizes)]

        out = forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                         _save_ctx=False, _parallel_config=_parallel_config)  # diffusers: forward only
        if return_lse:
            out, lse, *_ = out

        out = o_to_sequence(out, q_lengths, group, **metadata)
        if return_lse:
            lse = lse.unsqueeze(-1)  # (B, S_Q_GLOBAL, H_LOCAL, D=1)
            lse = o_to_sequence(lse, q_lengths, group, **metadata)
            lse = lse.squeeze(-1).contiguous()  # (B, S_Q_LOCAL, H_GLOBAL)
        else:
            lse = None

        return (out, lse) if return_lse else out

    forward.__doc__ = original_forward.__doc__
    return staticmethod(forward)


PATCH = Patch(
    name="cp_ulysses_anything",
    summary="diffusers' uneven-shard Ulysses attention (ulysses_anything) in eager: one length exchange per "
            "attention call, all-to-alls through c10d",
    targets=(
        Target(f"{_MODULE}:TemplatedUlyssesAnythingAttention.forward", make_replacement=_replacement,
               fingerprints=frozenset({
                   "df4b1c10820558e1",  # 0.40.0 (and 0.39.0, below the version gate)
                   "50562ad38aefb316",  # 0.41.0, 0.42.0, 0.42.1
               })),
    ),
    requires={"diffusers": ">=0.40,<0.43"},
    precondition=distributed_missing,
)
