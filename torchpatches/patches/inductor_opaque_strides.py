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
from __future__ import annotations

from typing import Any, Callable

from .._core.declare import Patch, Target

__all__ = ["PATCH", "make_replacement", "FINGERPRINT_TORCH_2_11_0"]

#: fingerprint(torch._inductor.lowering.constrain_to_fx_strides) of torch 2.11.0.
FINGERPRINT_TORCH_2_11_0 = "28ecb2eb12062273"


def make_replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch 2.12.1's ``constrain_to_fx_strides``; runs when ``torch._inductor.lowering`` is imported."""
    import torch
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    not_tensors = tuple(getattr(ir, name) for name in ("NonTensorObj", "OpaqueMultiOutput") if hasattr(ir, name))

    def constrain_to_fx_strides(fx_node: Any, *args: Any, **kwargs: Any) -> Any:
        """torchpatches: opaque objects keep no stride order (pytorch#175973, torch 2.12.1's version)."""

        def apply_constraint(arg: Any, fx_arg: Any) -> Any:
            if isinstance(arg, ir.IRNode) and not isinstance(arg, not_tensors):
                fake_val = fx_arg.meta.get("val")
                if not isinstance(fake_val, torch.Tensor):
                    return arg
                stride_order = ir.get_stride_order(fake_val.stride(), V.graph.sizevars.shape_env)
                return ir.ExternKernel.require_stride_order(arg, stride_order)
            if isinstance(arg, dict):
                return {key: apply_constraint(arg[key], fx_arg[key]) for key in arg}
            return arg

        args = tuple(apply_constraint(arg, fx_arg) for arg, fx_arg in zip(args, fx_node.args))
        kwargs = {k: apply_constraint(v, fx_node.kwargs[k]) for k, v in kwargs.items()}
        return args, kwargs

    return constrain_to_fx_strides


PATCH = Patch(
    name="inductor_opaque_strides",
    summary="torch 2.11 Inductor: opaque-object arguments pass fixed-stride layout constraints (pytorch#175973)",
    targets=(
        Target("torch._inductor.lowering:constrain_to_fx_strides", make_replacement=make_replacement,
               fingerprints=frozenset({FINGERPRINT_TORCH_2_11_0}),
               aliases=("torch._inductor.graph:constrain_to_fx_strides",)),
    ),
    requires={"torch": ">=2.11"},
    inductor_cache_key=True,
)
