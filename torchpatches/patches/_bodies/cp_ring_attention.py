"""The ``cp_ring_attention`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/cp_ring_attention.py``."""
from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

from ..._core.compat import is_compiling
from ...ops._runtime.tiers import FLOAT_DTYPES, eager_transforms
from .._direct_collectives import direct_fits, gather_into_tensor, ints_of_every_rank


def _merge_fits(out: Any, lse: Any, query: torch.Tensor) -> bool:
    """What ``lse_merge`` takes: plain float tensors on one device, ``lse`` of ``out``'s rows (a trailing 1 or not),
    and a query dtype it can write (the last merge's output dtype)."""
    return (type(out) is torch.Tensor and type(lse) is torch.Tensor and out.dtype in FLOAT_DTYPES
            and lse.dtype in FLOAT_DTYPES and query.dtype in FLOAT_DTYPES and out.device == lse.device
            and out.dim() >= 1 and (lse.shape == out.shape[:-1] or lse.shape == (*out.shape[:-1], 1)))


def _gathered_with(process_group: type) -> Any:
    """A gather of the ring's key/value buffer: c10d where it may stand in (``_direct_collectives``), else
    diffusers' functional gather."""
    import torch.distributed._functional_collectives as funcol

    gather_into = gather_into_tensor()

    def gathered(kv_buffer: torch.Tensor, group: Any) -> torch.Tensor:
        if not direct_fits(kv_buffer, group, process_group):  # the buffer is contiguous: the forward made it so
            # looked up per call, as the original's is (a wrapper put on it is honoured)
            return funcol.all_gather_tensor(kv_buffer, gather_dim=0, group=group)
        out = kv_buffer.new_empty((group.size() * kv_buffer.numel(),))
        gather_into(out, kv_buffer, group=group)
        return out

    return gathered


def _lse_merge() -> Callable[..., Tuple[torch.Tensor, torch.Tensor]]:
    # registers its torch.library op: loaded with the targets (each replacement calls this once), not the package
    from ...ops._lse_merge import lse_merge

    return lse_merge


def _ring_loop(ctx: Any, query: torch.Tensor, step_kv: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
               attn_mask: Any, dropout_p: float, is_causal: bool, scale: Any, enable_gqa: bool, forward_op: Any,
               _parallel_config: Any, lse_merge: Callable[..., Tuple[torch.Tensor, torch.Tensor]]
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """diffusers 0.42.1's ring loop, shared by both templates: attention over each step's keys and values
    (``step_kv(i)``), the partial results merged by their log-sum-exps -- by ``lse_merge`` where it fits."""
    world_size = _parallel_config.context_parallel_config.ring_degree
    convert_to_fp32 = _parallel_config.context_parallel_config.convert_to_fp32
    prev_out = prev_lse = None
    fused_merge = None
    for i in range(world_size):
        key, value = step_kv(i)
        out, lse = forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, True,
                              _save_ctx=i == 0, _parallel_config=_parallel_config)

        if fused_merge is None:  # every step's result has the first one's shapes and dtypes
            fused_merge = world_size > 1 and convert_to_fp32 and _merge_fits(out, lse, query)
        if fused_merge:
            lse = lse.reshape(out.shape[:-1])
            if prev_out is not None:
                out, lse = lse_merge(prev_out, prev_lse, out, lse,
                                     out_dtype=query.dtype if i == world_size - 1 else torch.float32)
            prev_out = out
            prev_lse = lse
            continue

        if convert_to_fp32:
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

    if not fused_merge:  # lse_merge wrote the query's dtype and [B, S, H]
        out = out.to(query.dtype)
        lse = lse.squeeze(-1)
    return out, lse


def _ring_forward(original: Any, key_values: Callable[..., Callable[[int], Tuple[torch.Tensor, torch.Tensor]]],
                  takes_mask: bool, keeps_result: bool) -> staticmethod:
    """A replacement of one template's forward: diffusers' step-aside cases, what it leaves on ``ctx``, the ring loop
    over ``key_values(...)``'s per-step keys and values, and (``keeps_result``) the reduced result its backward reads.
    Without ``takes_mask`` a mask hands the call to the original (its own error)."""
    import torch.distributed as dist

    lse_merge = _lse_merge()
    original_forward = original.__func__
    gathered = _gathered_with(dist.ProcessGroup)

    # The templates' forward signature (diffusers 0.42.1), its annotations there.
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op,
                backward_op, _parallel_config=None):
        if is_compiling() or eager_transforms() or (attn_mask is not None and not takes_mask):
            return original_forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                    return_lse, forward_op, backward_op, _parallel_config)
        # From here on diffusers 0.42.1's code, but for the gather and the merge.
        config = _parallel_config.context_parallel_config

        ctx.forward_op = forward_op
        ctx.backward_op = backward_op
        ctx.q_shape = query.shape
        ctx.kv_shape = key.shape
        ctx._parallel_config = _parallel_config

        step_kv = key_values(key, value, gathered, config._ring_mesh.get_group(), config._ring_local_rank,
                             config.ring_degree)
        out, lse = _ring_loop(ctx, query, step_kv, attn_mask, dropout_p, is_causal, scale, enable_gqa, forward_op,
                              _parallel_config, lse_merge)
        if keeps_result:
            # diffusers' backward reconstructs each ring iteration from the reduced out / lse.
            ctx.ring_out = out.detach()
            ctx.ring_lse = lse.detach()

        return (out, lse) if return_lse else out

    forward.__doc__ = original_forward.__doc__
    return staticmethod(forward)


def _equal_shards(key: torch.Tensor, value: torch.Tensor, gathered: Callable[..., torch.Tensor], group: Any,
                  rank: int, world_size: int) -> Callable[[int], Tuple[torch.Tensor, torch.Tensor]]:
    """``TemplatedRingAttention``'s keys and values per ring step: the local ones, then each rank's chunk of the
    gathered buffer."""
    kv_buffer = torch.cat([key.flatten(), value.flatten()]).contiguous()
    kv_buffer = gathered(kv_buffer, group).chunk(world_size)
    key_numel = key.numel()

    def step_kv(i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if i == 0:
            return key, value
        kv = kv_buffer[(rank + i) % world_size]
        return kv[:key_numel].reshape_as(key), kv[key_numel:].reshape_as(value)

    return step_kv


def _any_shards(key: torch.Tensor, value: torch.Tensor, gathered: Callable[..., torch.Tensor], group: Any,
                rank: int, world_size: int) -> Callable[[int], Tuple[torch.Tensor, torch.Tensor]]:
    """``TemplatedRingAnythingAttention``'s: every rank's buffer padded to the longest, each cut back to its rank's
    length."""
    kv_seq_len = key.shape[1]  # local S_KV (may differ across ranks)
    all_kv_seq_lens = [rank_len for (rank_len,) in ints_of_every_rank((kv_seq_len,), group)]
    s_max = max(all_kv_seq_lens)

    def pad_to_s_max(t: torch.Tensor) -> torch.Tensor:
        pad_len = s_max - t.shape[1]
        if pad_len == 0:
            return t
        pad_shape = (t.shape[0], pad_len, *t.shape[2:])
        return torch.cat([t, t.new_zeros(pad_shape)], dim=1)

    key_padded = pad_to_s_max(key)
    value_padded = pad_to_s_max(value)

    kv_buffer = torch.cat([key_padded.flatten(), value_padded.flatten()]).contiguous()
    kv_buffer = gathered(kv_buffer, group).chunk(world_size)
    kv_padded_numel = key_padded.numel()

    def step_kv(i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if i == 0:  # the local (unpadded) key and value
            return key_padded[:, :kv_seq_len], value_padded[:, :kv_seq_len]
        other = (rank + i) % world_size
        true_seq_len = all_kv_seq_lens[other]
        kv = kv_buffer[other]
        return (kv[:kv_padded_numel].reshape_as(key_padded)[:, :true_seq_len],
                kv[kv_padded_numel:].reshape_as(value_padded)[:, :true_seq_len])

    return step_kv


def _replacement(original: Any) -> staticmethod:
    """``TemplatedRingAttention.forward`` (equal shards)."""
    return _ring_forward(original, _equal_shards, takes_mask=True, keeps_result=True)


def _anything_replacement(original: Any) -> staticmethod:
    """``TemplatedRingAnythingAttention.forward`` (shards of any length; forward only, as diffusers')."""
    return _ring_forward(original, _any_shards, takes_mask=False, keeps_result=False)
