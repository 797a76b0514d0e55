"""When one of diffusers' context-parallel collectives may go through c10d directly instead of the functional
collectives: the conditions ``cp_all_to_all``, ``cp_ring_attention`` and ``cp_ulysses_anything`` share (their
banners say why each one); and the ranks' lengths exchanged with one read back to the host (``ints_of_every_rank``).

The functional collectives are what Dynamo traces and what autograd, transforms, Python modes and tensor subclasses
see; c10d's synchronous collective is the same data movement without their Python layer. So c10d may stand in only
for a plain, non-empty, real tensor that nothing records or intercepts, over a ``ProcessGroup`` that is not
coalescing, outside a CUDA-graph capture (a graph that captured c10d's collective held the host at every replay for
the whole step: docs/notes/context_parallel.md, "diffusers' exchanges on the host"). Compiling and transforms are checked by the
callers, next to ``is_compiling`` as the other patches do.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

__all__ = ["direct_fits", "distributed_missing", "gather_into_tensor", "ints_of_every_rank"]

#: Python modes on the stack (C queries; a torch without one reports none)
_function_modes: Callable[[], bool] = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: False)
_dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def _modes_active() -> bool:
    return bool(_function_modes() or _dispatch_modes())


def _coalescing(group: Any) -> bool:
    """Inside ``torch.distributed._coalescing_manager(group)`` c10d defers a collective to the block's end, so its
    output would be read before it is written; the functional collective is not deferred."""
    world = getattr(torch.distributed.distributed_c10d, "_world", None)
    state = getattr(world, "pg_coalesce_state", None)
    return bool(state) and group in state


def direct_fits(x: Any, group: Any, process_group: type) -> bool:
    """True where c10d's collective may move ``x`` over ``group`` in place of the functional one."""
    return (
        type(x) is torch.Tensor
        and isinstance(group, process_group)
        and not (x.requires_grad and torch.is_grad_enabled())
        and not _modes_active()
        and not x.is_complex()
        and x.numel() > 0
        and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
        and not _coalescing(group)
    )


def gather_into_tensor() -> Callable[..., Any]:
    """c10d's gather of every rank's tensor into one: ``all_gather_single`` from torch 2.13, which warns that
    ``all_gather_into_tensor`` (the same call before it) is deprecated."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def distributed_missing() -> Optional[str]:
    """The skip reason of a patch that needs ``torch.distributed``, or None."""
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this torch build"
    return None


def ints_of_every_rank(local: Sequence[int], group: Any) -> List[List[int]]:
    """Every rank's ``local`` ints in rank order, gathered where diffusers' ``gather_size_by_comm`` gathers one int
    (the CPU where the group has a CPU backend, else the accelerator): one collective and one read back to the
    host, where ``gather_size_by_comm`` makes a pageable host-to-device copy and one ``.item()`` per rank (on an
    accelerator each of those waits for the GPU)."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group=group)
    backends = str(dist.get_backend(group=group))
    device = "cpu" if "cpu" in backends else torch.accelerator.current_accelerator()
    mine = torch.empty(len(local), dtype=torch.int64, device=device)
    for i, value in enumerate(local):
        # fill_ takes the int as a kernel argument; ``mine[i] = value`` would copy a CPU scalar tensor to the
        # device, and torch's blocking copy waits for the GPU
        mine[i].fill_(value)
    every = torch.empty(world_size * len(local), dtype=torch.int64, device=device)
    gather_into_tensor()(every, mine, group=group)
    flat = every.tolist()
    return [flat[rank * len(local):(rank + 1) * len(local)] for rank in range(world_size)]
