"""inductor_realize: a byte-based cost model for materializing reused Inductor buffers (torch 2.11, 2.12).

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
    ships the read-count threshold (plus a ``graph_reuse`` flag), as do 2.14.1 and 2.15.0; 2.12.1
    ships 2.11's function unchanged. vLLM's backport for 2.11,
    vllm-project/vllm#42686, compares *bytes* instead (the rule below); it was reverted in #42913
    (compiled-output mismatches in its async-TP / sequence-parallel CI) and retried in #42980.

What this patch changes
    For ``users > 1`` and a Pointwise/Reduction, after the original's CPU heavy-op rule
    (``exp``/``sigmoid`` realize on CPU) and the large-inner-function rule, it compares memory
    traffic: inlining re-reads every input once per extra user, ``total_read_bytes * (users - 1)``;
    materializing writes the output once and reads it once per user, ``output_bytes * (1 + users)``.
    It realizes iff the first is >= the second. When either size is unknown (0: unbacked
    symbols, NoneLayout) it falls back to a read-count threshold written against the API the
    upstream card names, ``len(self.get_reads()) > config.realize_reads_threshold``: it counts
    dependencies, where the original's ``num_reads()`` counts loads. They differ where one table is
    read by several ``bucketize`` lookups (one dependency, one load per lookup): three lookups over
    unbacked sizes are 4 dependencies (inline) but 6 loads (2.11 realizes).
    An unrealized Reduction, whose ``get_reads()`` raises NotImplementedError in 2.11/2.12, keeps
    the original's own rule (``num_reads()``). ``users == 1`` and any other IR node behave
    exactly as before.
    The rule is not always a win: one vLLM-based deployment (a hybrid GDN/MoE model) measured
    -25% tokens/s with it, and on CPU Inductor's own byte estimate rises where the consumers of
    the inlined value were already fused into one loop nest (docs/inductor_realize.md); it can
    be switched off alone with ``TORCHPATCHES_DISABLE=inductor_realize``. It changes what
    Inductor generates without changing the FX graph, so it enters Inductor's cache key
    (``inductor_cache_key=True``).

Versions
    Every torch >= 2.11 whose original is 2.11's rule, fingerprint ``1d32e5f50cbc847e``: 2.11.0 and
    2.12.1 (the same source, measured; the upstream rewrite #181441 was reverted, #182184). The
    fingerprint, not the minor version, decides: 2.13.0 (``bba76444f58fea6e``), 2.14.1 and 2.15.0
    (``0f2d2720f9561e21``) have another body and signature ``(self, users, *, graph_reuse=True)``,
    and the patch is skipped there with that reason (``ORIGINALS`` below; tests check it).

When to delete
    When the supported torch floor includes a byte/traffic-based realize heuristic
    (pytorch/pytorch#176994 / #181441 in a release), or the last torch with 2.11's rule (2.12) is dropped.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .._core.declare import Patch, Target

__all__ = ["PATCH", "make_replacement", "materialize_is_cheaper", "FINGERPRINT_TORCH_2_11_0", "ORIGINALS"]

# fingerprint(torch._inductor.ir.StorageBox.should_realize_on_reuse) of 2.11's rule: the original
# this patch restates and was verified against (equivalence tests on 2.11.0+cu130 and 2.12.1+cu130).
FINGERPRINT_TORCH_2_11_0 = "1d32e5f50cbc847e"
# The same on torch 2.13.0+cpu: a different body (more heavy ops, graph_reuse kwarg).
FINGERPRINT_TORCH_2_13_0 = "bba76444f58fea6e"

#: The original's fingerprint per torch release, as measured (tests check the running torch's entry).
ORIGINALS = {
    "2.11.0": FINGERPRINT_TORCH_2_11_0,
    "2.12.1": FINGERPRINT_TORCH_2_11_0,  # 2.11's source, byte for byte
    "2.13.0": FINGERPRINT_TORCH_2_13_0,
    "2.14.1": "0f2d2720f9561e21",  # graph_reuse kwarg; 2.13's read-count rule
    "2.15.0": "0f2d2720f9561e21",
}

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

    def read_bytes(reads: Any) -> int:
        # get_dep_size_hint gives 0 for unbacked sizes, which sends the decision to the fallback.
        return sum(V.graph.get_dep_size_hint(dep) for dep in reads)

    def output_bytes(box: Any) -> int:
        numel_hint = V.graph.sizevars.optimization_hint(box.data.get_numel(), fallback=0)
        return numel_hint * box.data.dtype.itemsize

    def should_realize_on_reuse(self: Any, users: int) -> bool:
        """torchpatches: byte-based cost model (see torchpatches.patches.inductor_realize)."""
        if users > 1 and isinstance(self.data, pointwise_or_reduction):
            if reads_cpu_heavy_op(self):
                return True
            if self.data.has_large_inner_fn():
                return True
            threshold = inductor_config.realize_reads_threshold
            try:
                reads = self.get_reads()
            except NotImplementedError:
                # 2.11's Loops.get_reads calls make_loader(), which an unrealized Reduction does not
                # implement (upstream's and vLLM's versions raise here). Reductions are nearly always
                # realized at lowering; for the rest, the original's own rule (distinct buffers).
                return self.num_reads() > threshold
            decision = materialize_is_cheaper(read_bytes(reads), output_bytes(self), users)
            if decision is not None:
                return decision
            # Sizes unknown: the read-count rule as the upstream card writes it. len(get_reads())
            # counts dependencies (a bucketize table once); the original's num_reads() counts loads
            # (the table once per lookup).
            return len(reads) > threshold
        return False

    should_realize_on_reuse.__qualname__ = "StorageBox.should_realize_on_reuse"
    should_realize_on_reuse.__module__ = __name__
    return should_realize_on_reuse


PATCH = Patch(
    name="inductor_realize",
    summary=(
        "torch 2.11/2.12 Inductor: realize a reused Pointwise/Reduction when materializing moves fewer "
        "bytes than recomputing it in every consumer (backport of pytorch#176994 / vllm#42686)"
    ),
    targets=(
        Target(
            "torch._inductor.ir:StorageBox.should_realize_on_reuse",
            make_replacement=make_replacement,
            fingerprints=frozenset({FINGERPRINT_TORCH_2_11_0}),  # torch 2.11.0, 2.12.1 (2.11's rule)
        ),
    ),
    # No upper bound: the fingerprint decides which releases carry 2.11's rule (see Versions above).
    requires={"torch": ">=2.11"},
    inductor_cache_key=True,
)
