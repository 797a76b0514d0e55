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
from .._core.declare import Patch, Target
from ._direct_collectives import distributed_missing

_BODY = "torchpatches.patches._bodies.cp_ulysses_anything"
_MODULE = "diffusers.models.attention_dispatch"


PATCH = Patch("cp_ulysses_anything", targets=Target(
    f"{_MODULE}:TemplatedUlyssesAnythingAttention.forward", f"{_BODY}:_replacement",
    {"df4b1c10820558e1", "50562ad38aefb316"}),  # diffusers 0.40.0 (and 0.39.0, below the gate); 0.41.0 - 0.42.1
    summary="diffusers' uneven-shard Ulysses attention (ulysses_anything) in eager: one length exchange per "
            "attention call, all-to-alls through c10d",
    requires={"diffusers": ">=0.40,<0.43"}, precondition=distributed_missing)
