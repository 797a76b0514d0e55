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
from .._core.declare import Patch, Target
from ._direct_collectives import distributed_missing

_BODY = "torchpatches.patches._bodies.cp_ring_attention"
_MODULE = "diffusers.models.attention_dispatch"


PATCH = Patch(
    "cp_ring_attention",
    "diffusers' ring attention (context parallelism) in eager: key/value all-gather through c10d, log-sum-exp merge "
    "in one kernel",
    targets=(  # fingerprints: diffusers 0.40.0; 0.41.0, 0.42.0, 0.42.1
        Target(f"{_MODULE}:TemplatedRingAttention.forward", f"{_BODY}:_replacement",
               {"692d5647b854066c", "5c2a1afd0944687b"}),
        Target(f"{_MODULE}:TemplatedRingAnythingAttention.forward", f"{_BODY}:_anything_replacement",
               {"0f971549632a755e", "7078b95a5d50a1f2"}),
    ),
    requires={"diffusers": ">=0.40,<0.43"},
    precondition=distributed_missing,
)
