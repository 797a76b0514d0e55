"""The ``cp_ulysses_anything`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/cp_ulysses_anything.py``."""
from __future__ import annotations

import importlib
from typing import Any, Callable, List

import torch

from ..._core.compat import is_compiling
from ...ops._runtime.tiers import eager_transforms
from .._direct_collectives import direct_fits, ints_of_every_rank

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

    # The template's forward signature (diffusers 0.42.1), its annotations there.
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op,
                backward_op, _parallel_config=None, **kwargs):
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
