"""inductor_pattern_dtypes: a pattern anchored on a custom op fires whatever the dtypes of its inputs (torch 2.11 -
2.15).

What goes wrong upstream
    ``PatternMatcherPass.apply`` skips every anchor node with an input Inductor cannot generate code for
    (``fallback_node_due_to_unsupported_type(node, allow_cpu_inputs=False)``: complex, ``float8_e8m0fnu``, meta or
    sparse inputs...), because some of Inductor's own patterns for aten ops generate code. The skip also hits custom
    ops and functionalization wrappers, which a pass replaces by other custom ops: a replacement registered for
    ``mylib::foo(x, scale)`` fires with an fp32 scale and never with a ``float8_e8m0fnu`` or complex one, silently
    (pytorch/pytorch#193710; fix proposed in #196013, open; vLLM's ``env_override.py`` carries it for its MX-format
    fusions, vllm-project/vllm#58189).

What the patch changes
    ``torch._inductor.pattern_matcher``'s own name for ``fallback_node_due_to_unsupported_type`` (read only by
    ``PatternMatcherPass.apply``; ``lowering`` keeps its own) answers as the original for a built-in ``OpOverload``
    (aten, prims) and False for anything else: a custom op or a higher-order operator is matched whatever its input
    dtypes, as #196013 writes the condition. Replacements fire where they did not, so the patch enters Inductor's
    cache key.

Versions
    ``fallback_node_due_to_unsupported_type`` fingerprints ``e239b0aeb63c033f`` (torch 2.11.0, 2.12.1, 2.13.0) and
    ``1d9bcb957d39d426`` (2.15.0); the call site is verified through ``PatternMatcherPass.apply``'s fingerprint per
    release (below).

When to delete
    When the supported torch floor carries pytorch#196013 (or another fix of #193710).
"""
from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.inductor_pattern_dtypes"
_PM = "torch._inductor.pattern_matcher"


PATCH = Patch("inductor_pattern_dtypes", targets=Target(
    f"{_PM}:fallback_node_due_to_unsupported_type", f"{_BODY}:make_replacement",
    {"e239b0aeb63c033f", "1d9bcb957d39d426"}),  # torch 2.11.0, 2.12.1, 2.13.0; torch 2.15.0
    summary="Inductor pattern matcher: patterns anchored on custom ops fire whatever their input dtypes "
            "(pytorch#193710)",
    # The one reader of that name, whose skip the patch narrows: torch 2.11.0, 2.12.1, 2.13.0, 2.15.0.
    verifies={f"{_PM}:PatternMatcherPass.apply": {"fbf0155c1a3bcabb", "b5eabb7c1c4f8159", "bb21453f423fb44e",
                                                  "c8aa441b1c6b03d8"}},
    requires={"torch": ">=2.11"}, inductor_cache_key=True)
