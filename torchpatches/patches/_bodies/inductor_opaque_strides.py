"""The ``inductor_opaque_strides`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/inductor_opaque_strides.py``."""
from __future__ import annotations

from typing import Any, Callable


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
