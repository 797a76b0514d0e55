"""cp_all_to_all: the all-to-all of diffusers' Ulysses attention through c10d directly (eager host time).

What goes wrong upstream
    Under diffusers' context parallelism with Ulysses (``ContextParallelConfig(ulysses_degree=N)``) every attention
    call exchanges q, k, v and the output between the ranks: four calls of ``attention_dispatch._all_to_all_single``
    per attention call. Each goes through ``torch.distributed._functional_collectives``: the op's Python autograd
    layer, an ``AsyncCollectiveTensor`` wrapper subclass, a ``reshape`` dispatched through that subclass'
    ``__torch_dispatch__`` (a pytree walk per op), then a ``wait_tensor`` op through the autograd layer again. The
    functional form is what Dynamo traces; in eager it is host work on a step that context parallelism already makes
    host-bound (docs/notes/context_parallel.md, "diffusers' exchanges on the host"; docs/context_parallel.md, Figures). No upstream
    issue as of diffusers 0.42.1.

What the patch changes
    In eager, ``_all_to_all_single(x, group)`` is ``torch.distributed.all_to_all_single(out, x.reshape(-1),
    group=group)`` into a new tensor of ``x``'s shape: equal splits of the flattened tensor over the group's ranks,
    the same values bit for bit (data movement only), ordered on the current stream before anything that later reads
    the result (c10d's synchronous collective; the original waits on it with ``wait_tensor``), without the
    functional layer. The original runs under torch.compile (Dynamo traces the functional collective), when autograd
    would record the call or a transform (forward AD, functorch, ``torch.jit.trace``) is active, under a Python
    torch-function or dispatch mode (``FakeTensorMode``, ``make_fx``, flop counters, ``torch.set_default_device``'s:
    they see the functional ops, as without the patch), for tensor subclasses (``DTensor``,
    ``AsyncCollectiveTensor``), for a ``group`` that is not a ``ProcessGroup`` (a mesh, a name, a rank outside the
    group), for complex tensors (the original refuses them; c10d would send them as real pairs), when the flattened
    tensor is empty, a strided view (a 1-D slice: c10d refuses it; the functional collective sends it or refuses it
    with its own message, by torch release) or does not split evenly over the group (the original raises its own
    error), inside a ``_coalescing_manager`` block (c10d would defer the exchange), and while a CUDA graph is being
    captured (``torchpatches.cuda_graphs.graphed``): a graph that captured c10d's collective held the host at every
    replay for the whole step (docs/notes/context_parallel.md, "Through graphed").

Versions
    diffusers 0.36 - 0.42: ``_all_to_all_single`` fingerprinted with tools/fingerprint_diffusers.py in 0.36.0,
    0.37.0, 0.38.0, 0.39.0, 0.40.0, 0.41.0, 0.42.0 and 0.42.1 (one source; 0.35.2 has no such function). Any torch
    with ``torch.distributed``.

When to delete
    When diffusers' eager context parallelism calls c10d's collectives directly (or batches q, k and v into one
    exchange), or when the functional collectives cost no more host time than c10d's in eager.
"""
from .._core.declare import Patch, Target
from ._direct_collectives import distributed_missing

_BODY = "torchpatches.patches._bodies.cp_all_to_all"
_MODULE = "diffusers.models.attention_dispatch"


PATCH = Patch("cp_all_to_all", targets=Target(f"{_MODULE}:_all_to_all_single", f"{_BODY}:_replacement",
                                             {"7fe3c3e9aff59e68"}),
              summary="diffusers' Ulysses all-to-all (context parallelism) through c10d directly in eager",
              requires={"diffusers": ">=0.36,<0.43"}, precondition=distributed_missing)
