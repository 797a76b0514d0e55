"""inductor_opaque_strides: a custom op that takes an opaque object lowers under a fixed-stride layout constraint
(torch 2.11).

What goes wrong upstream
    Inductor's ``lowering.constrain_to_fx_strides`` (the layout constraint of ops tagged
    ``needs_fixed_stride_order``, and of every custom op when
    ``torch._functorch.config.custom_op_default_layout_constraint = "needs_fixed_stride_order"``, as vLLM sets it)
    asks every IR argument for the strides of its FX value. In torch 2.11 an opaque object
    (``torch._library.opaque_object.register_opaque_type``, value or reference type) is an IR node too
    (``ir.TorchBindObject``), and its FX value a ``FakeScriptObject``: compiling fails with ``LoweringException:
    AttributeError: Tried to call __getattr__ with attr 'stride' on a FakeScriptObject``. pytorch/pytorch#175973,
    fixed by #177991 (in 2.12); vLLM's ``env_override.py`` carries the same change for 2.11.

What the patch changes
    ``constrain_to_fx_strides`` as 2.12.1 ships it: only an IR node that is not a non-tensor object
    (``ir.NonTensorObj``, and ``ir.OpaqueMultiOutput`` where it exists) whose FX value is a tensor gets a stride
    order; anything else is passed through. It also rebinds ``torch._inductor.graph``'s own name for it (user Triton
    kernels' constraint). Where it applies the unpatched compile fails, so code it produced must not be served to
    an unpatched process: it enters Inductor's cache key. The layout constraints torch registered with the original
    while ``lowering`` was imported (``convolution_backward``'s) keep it; they take tensors only. Inductor registers
    a custom op's implicit fallback, with the constraint of that moment, once per process: an op first lowered while
    the patch was applied keeps the replacement after ``revert()``.

Versions
    torch 2.11.0 (fingerprint ``28ecb2eb12062273``); 2.12.1 (``6aaad405bdc93ecb``), 2.13.0 and 2.15.0 carry the fix
    and are skipped by fingerprint.

When to delete
    When the supported torch floor is 2.12.
"""
from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.inductor_opaque_strides"
#: fingerprint(torch._inductor.lowering.constrain_to_fx_strides) of torch 2.11.0.
FINGERPRINT_TORCH_2_11_0 = "28ecb2eb12062273"


PATCH = Patch("inductor_opaque_strides", targets=Target(
    "torch._inductor.lowering:constrain_to_fx_strides", f"{_BODY}:make_replacement", {FINGERPRINT_TORCH_2_11_0},
    aliases=("torch._inductor.graph:constrain_to_fx_strides",)),
    summary="torch 2.11 Inductor: opaque-object arguments pass fixed-stride layout constraints (pytorch#175973)",
    requires={"torch": ">=2.11"}, inductor_cache_key=True)
