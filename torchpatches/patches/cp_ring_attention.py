"""cp_ring_attention: diffusers' ring attention forward in eager: its key/value all-gather through c10d directly,
and the log-sum-exp merge of the ring's partial results in one kernel.

What goes wrong upstream
    Under diffusers' context parallelism with ring attention (``ContextParallelConfig(ring_degree=N)``) every
    attention call runs ``TemplatedRingAttention.forward`` (``TemplatedRingAnythingAttention.forward`` with
    ``ring_anything=True``). Two parts of it cost more than their work:

    - The key/value gather is ``funcol.all_gather_tensor``. Its result is an ``AsyncCollectiveTensor``: the
      ``chunk``, the slices and the ``reshape_as`` that follow, and the attention call that finally reads a chunk,
      each go through that subclass' ``__torch_dispatch__`` (a pytree walk per op) before the ``wait_tensor``. On
      a FLUX.1-dev step (57 attention calls) diffusers' ring step made 116,021 Python calls where its Ulysses step
      made 43,346 (rank 0 under cProfile), on a step that context parallelism already makes host-bound
      (docs/context_parallel.md, Figures). The call also warns (``FutureWarning``:
      ``all_gather_tensor`` is deprecated) on torch 2.13 (not on 2.11), an error under ``-W error``; diffusers'
      output gather hook makes the same call once per step, which this patch does not change.
    - The merge of each ring step's partial output into the running one (``convert_to_fp32``, the default) is
      about ten torch ops over fp32 copies of ``[B, S, H, D]``: two casts, five ops for the output, three for
      the log-sum-exp, the final cast. On two ranks of FLUX.1-dev that is some 350 MB of memory traffic per
      attention call where one pass reads 2 x 14 MB and writes 14 MB, and about 570 launches per step
      (docs/context_parallel.md, Figures).

    No upstream issue as of diffusers 0.42.1.

What the patch changes
    ``TemplatedRingAttention.forward`` (equal shards) and ``TemplatedRingAnythingAttention.forward`` (shards of any
    length, ``ring_anything``; forward only, as diffusers') are diffusers' own code (0.42.1) with two changes, both in
    eager only:

    - the gather is ``torch.distributed.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13) into
      a new 1-D tensor: the ranks' buffers in rank order, the same values bit for bit as the functional
      collective's (data movement only), ordered on the current stream before anything that reads them, and a
      plain tensor, so the views and the attention call that follow are plain torch calls;
    - with ``convert_to_fp32`` each merge is one ``ops.lse_merge`` call (its Triton tier on CUDA computes
      diffusers' fp32 steps with the functions torch's kernels call: bit-identical but where an fp32
      intermediate is subnormal, see ``ops/_lse_merge.py``; its PyTorch tier elsewhere is diffusers' code).
      The first partial output is read in the backend's dtype (its fp32 copy is exact), the last merge writes
      the query's dtype (the final cast's rounding).

    The uneven form also exchanges the ranks' key lengths as ``cp_ulysses_anything`` does (``ints_of_every_rank``:
    one wait for the GPU per call, the read back, where diffusers' ``gather_size_by_comm`` waits for a pageable
    copy and once per rank). Everything else (the ring loop, the uneven form's padding and slices, what the equal
    form leaves on ``ctx`` for diffusers' unchanged backward) is the original's. The original forward runs under
    torch.compile (Dynamo traces the functional collective), under a transform (functorch, forward AD,
    ``torch.jit.trace``), and for the uneven form given a mask (its own ``ValueError``); the functional gather runs,
    as in the original, for what c10d may not replace (``_direct_collectives``: a tensor subclass, a group that is not a
    ``ProcessGroup``, a Python torch-function or dispatch mode, complex or empty buffers, a
    ``_coalescing_manager`` block, CUDA-graph capture); diffusers' merge runs without ``convert_to_fp32``, for
    one rank, and for results whose log-sum-exp is not ``[B, S, H]`` (or ``[B, S, H, 1]``) plain float tensors
    of the output's device, or a query of another dtype. Under a Python dispatch mode the merge is still a kernel
    launch, as the other fused ops' are. The backward and the output gather of diffusers' hooks are not touched.

Versions
    diffusers 0.40 - 0.42: both forwards fingerprinted in 0.40.0 (each source differs from 0.41's by the return
    annotation only), 0.41.0, 0.42.0 and 0.42.1 (tools/fingerprint_diffusers.py). 0.39 and older leave nothing on
    ``ctx`` for their backward's reconstruction and merge by another rule and are not verified. Any torch with
    ``torch.distributed``. Named ``cp_ring_gather`` while it replaced the gather only, before it took the merge.

When to delete
    When diffusers' ring attention gathers with c10d in eager (or waits on the functional result before viewing it)
    and merges in one kernel, or when the functional collectives cost no more host time than c10d's in eager and
    the merge is fused by someone else.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

from .._core.compat import is_compiling
from .._core.declare import Patch, Target
from ..ops._runtime.tiers import FLOAT_DTYPES, eager_transforms
from ._direct_collectives import direct_fits, distributed_missing, gather_into_tensor, ints_of_every_rank

__all__ = ["PATCH"]

_MODULE = "diffusers.models.attention_dispatch"


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
    from ..ops._lse_merge import lse_merge

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


PATCH = Patch(
    name="cp_ring_attention",
    summary="diffusers' ring attention (context parallelism) in eager: key/value all-gather through c10d, "
            "log-sum-exp merge in one kernel",
    targets=(
        Target(f"{_MODULE}:TemplatedRingAttention.forward", make_replacement=_replacement,
               fingerprints=frozenset({
                   "692d5647b854066c",  # 0.40.0
                   "5c2a1afd0944687b",  # 0.41.0, 0.42.0, 0.42.1
               })),
        Target(f"{_MODULE}:TemplatedRingAnythingAttention.forward", make_replacement=_anything_replacement,
               fingerprints=frozenset({
                   "0f971549632a755e",  # 0.40.0
                   "7078b95a5d50a1f2",  # 0.41.0, 0.42.0, 0.42.1
               })),
    ),
    requires={"diffusers": ">=0.40,<0.43"},
    precondition=distributed_missing,
)
