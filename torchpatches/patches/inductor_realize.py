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
from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.inductor_realize"
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


# No upper bound in requires: the fingerprint decides which releases carry 2.11's rule (see Versions above).
PATCH = Patch("inductor_realize", targets=Target(
    "torch._inductor.ir:StorageBox.should_realize_on_reuse", f"{_BODY}:make_replacement",
    {FINGERPRINT_TORCH_2_11_0}),  # torch 2.11.0, 2.12.1 (2.11's rule)
    summary="torch 2.11/2.12 Inductor: realize a reused Pointwise/Reduction when materializing moves fewer bytes "
            "than recomputing it in every consumer (backport of pytorch#176994 / vllm#42686)",
    requires={"torch": ">=2.11"}, inductor_cache_key=True)
