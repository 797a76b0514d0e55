"""inductor_realize: a byte-based cost model for materializing reused Inductor buffers (torch 2.11).

What goes wrong upstream
    torch 2.11's ``torch._inductor.ir.StorageBox.should_realize_on_reuse`` decides whether a
    Pointwise/Reduction that several consumers read is computed once into a buffer
    (*realized*) or recomputed inline inside every consumer, by counting the buffers it
    reads: it realizes only above ``config.realize_reads_threshold`` (4) reads or when the
    inner function is large. A residual ``add`` reads 2 buffers, so in a transformer without
    graph breaks the residual stream is never materialized and every later norm/reduction
    inlines the whole chain again (loads grow 4, 6, 8, 10, ... per layer).
    Upstream: pytorch/pytorch#176994 (landed as #181441) replaces the threshold with a traffic
    comparison in read *counts*, ``(num_reads - 1) * (users - 1) >= 2``, yet torch 2.13.0 still
    ships the read-count threshold (plus a ``graph_reuse`` flag). vLLM's backport for 2.11,
    vllm-project/vllm#42686, compares *bytes* instead (the rule below); it was reverted in #42913
    (compiled-output mismatches in its async-TP / sequence-parallel CI) and retried in #42980.

What this patch changes
    For ``users > 1`` and a Pointwise/Reduction, after the original's CPU heavy-op rule
    (``exp``/``sigmoid`` realize on CPU) and the large-inner-function rule, it compares memory
    traffic: inlining re-reads every input once per extra user, ``total_read_bytes * (users - 1)``;
    materializing writes the output once and reads it once per user, ``output_bytes * (1 + users)``.
    It realizes iff the first is >= the second. When either size is unknown (0: unbacked
    symbols, NoneLayout; an unrealized Reduction, whose ``get_reads()`` raises NotImplementedError
    in 2.11) it falls back to the original read-count threshold. ``users == 1`` and
    any other IR node behave exactly as before.
    The rule is not always a win: one vLLM-based deployment (a hybrid GDN/MoE model) measured
    -25% tokens/s with it, and on CPU Inductor's own byte estimate rises where the consumers of
    the inlined value were already fused into one loop nest (docs/inductor_realize.md); it can
    be switched off alone with ``TORCHPATCHES_DISABLE=inductor_realize``. It changes what
    Inductor generates without changing the FX graph, so it enters Inductor's cache key
    (``inductor_cache_key=True``).

Versions
    torch 2.11.x whose original has fingerprint ``1d32e5f50cbc847e`` (verified on 2.11.0+cu130).
    torch 2.13.0's original has a different body and signature
    ``(self, users, *, graph_reuse=True)`` (fingerprint ``bba76444f58fea6e``); the version gate
    and the fingerprint both skip the patch there.

When to delete
    When the supported torch floor includes a byte/traffic-based realize heuristic
    (pytorch/pytorch#176994 / #181441 in a release), or torch 2.11 support is dropped.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from torchpatches._declare import Patch, Target

__all__ = ["PATCH", "make_replacement", "materialize_is_cheaper", "FINGERPRINT_TORCH_2_11_0"]

# fingerprint(torch._inductor.ir.StorageBox.should_realize_on_reuse) on torch 2.11.0+cu130.
FINGERPRINT_TORCH_2_11_0 = "1d32e5f50cbc847e"
# The same on torch 2.13.0+cpu: a different body (more heavy ops, graph_reuse kwarg).
# Recorded so tests can show the patch would refuse it even without the version gate.
FINGERPRINT_TORCH_2_13_0 = "bba76444f58fea6e"

# The original's CPU heavy-op list, kept verbatim (2.13 widened it; we keep 2.11's behaviour).
_CPU_HEAVY_OPS = ("exp", "sigmoid")


def materialize_is_cheaper(total_read_bytes: int, output_bytes: int, users: int) -> Optional[bool]:
    """The byte rule alone: True/False when both sizes are known, None when either is not.

    Inlining makes each of the ``users`` consumers read every input: ``reads * users``.
    Materializing reads the inputs once, writes the output once and each consumer reads it:
    ``reads + output * (1 + users)``. Materialize when it moves no more bytes than inlining,
    i.e. ``reads * (users - 1) >= output * (1 + users)``.
    """
    if total_read_bytes <= 0 or output_bytes <= 0:
        return None
    return total_read_bytes * (users - 1) >= output_bytes * (1 + users)


def make_replacement(original: Callable[..., bool]) -> Callable[..., bool]:
    """Build the replacement; runs when ``torch._inductor.ir`` is imported (it may import Inductor).

    ``original`` is not called: the replacement restates its whole body (the fingerprint
    guarantees which body) so the byte rule can sit between its conditions.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    pointwise_or_reduction = (ir.Pointwise, ir.Reduction)

    def reads_cpu_heavy_op(box: Any) -> bool:
        # Original 2.11 rule: on CPU, recomputing exp/sigmoid in every consumer is costly.
        if not ir.is_cpu(box.data):
            return False
        used_ops = box.data.inner_fn_opcount().used_ops
        return any(op in used_ops for op in _CPU_HEAVY_OPS)

    def read_and_output_bytes(box: Any) -> Tuple[int, int]:
        # get_dep_size_hint and optimization_hint(fallback=0) give 0 for unbacked sizes,
        # which sends the decision to the read-count fallback.
        try:
            reads = box.get_reads()
        except NotImplementedError:
            # 2.11's Loops.get_reads calls make_loader(), which an unrealized Reduction does not
            # implement, so the byte rule cannot see a Reduction's reads (upstream's and vLLM's
            # versions raise here). Reductions are nearly always realized at lowering; for the
            # rest, 0 bytes keeps the original read-count rule.
            return 0, 0
        total_read_bytes = sum(V.graph.get_dep_size_hint(dep) for dep in reads)
        numel_hint = V.graph.sizevars.optimization_hint(box.data.get_numel(), fallback=0)
        return total_read_bytes, numel_hint * box.data.dtype.itemsize

    def should_realize_on_reuse(self: Any, users: int) -> bool:
        """torchpatches: byte-based cost model (see torchpatches.patches.inductor_realize)."""
        if users > 1 and isinstance(self.data, pointwise_or_reduction):
            if reads_cpu_heavy_op(self):
                return True
            if self.has_large_inner_fn():
                return True
            decision = materialize_is_cheaper(*read_and_output_bytes(self), users)
            if decision is not None:
                return decision
            # Sizes unknown: the original's read-count rule (num_reads counts distinct
            # buffers, exactly as 2.11 does; len(get_reads()) would count index patterns).
            return self.num_reads() > inductor_config.realize_reads_threshold
        return False

    should_realize_on_reuse.__qualname__ = "StorageBox.should_realize_on_reuse"
    should_realize_on_reuse.__module__ = __name__
    return should_realize_on_reuse


PATCH = Patch(
    name="inductor_realize",
    summary=(
        "torch 2.11 Inductor: realize a reused Pointwise/Reduction when materializing moves fewer "
        "bytes than recomputing it in every consumer (backport of pytorch#176994 / vllm#42686)"
    ),
    targets=(
        Target(
            "torch._inductor.ir:StorageBox.should_realize_on_reuse",
            make_replacement=make_replacement,
            fingerprints=frozenset({FINGERPRINT_TORCH_2_11_0}),  # torch 2.11.0 (+cu130 verified)
        ),
    ),
    requires={"torch": ">=2.11,<2.12"},
    inductor_cache_key=True,
)
