"""The ``inductor_realize`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/inductor_realize.py``."""
from __future__ import annotations

from typing import Any, Callable, Optional

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
