"""named_parameters: a fused replacement whose signature spells out the original's parameters.

diffusers' ``Attention.forward`` passes a processor only the keyword arguments its ``__call__``'s signature names
(QwenImage's ``encoder_hidden_states_mask``, Z-Image's ``freqs_cis``): a replacement of ``(self, *args, **kwargs)``
would be handed none of them.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

__all__ = ["named_parameters"]


def named_parameters(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``make`` (a :func:`fused` factory) whose replacement spells out the original's parameters: diffusers'
    ``Attention.forward`` passes a processor only the keyword arguments its ``__call__``'s signature names
    (QwenImage's ``encoder_hidden_states_mask``, Z-Image's ``freqs_cis``), and reads that signature under
    ``torch.compile`` too. A real parameter list (not a ``__signature__`` attribute, which Dynamo cannot read
    without a graph break) keeps both working. Positional-or-keyword parameters with plain defaults only."""

    def make_named(original: Any) -> Any:
        code = original.__code__
        names = code.co_varnames[:code.co_argcount]
        defaults = original.__defaults__ or ()
        if code.co_kwonlyargcount or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
            raise TypeError(f"{original.__qualname__}: only positional-or-keyword parameters can be named")
        first_default = len(names) - len(defaults)
        params = ", ".join(n if i < first_default else f"{n}=_defaults[{i - first_default}]"
                           for i, n in enumerate(names))
        namespace = {"_method": (make(original),), "_defaults": defaults}
        # In a tuple: benchmarks/dit.py takes the functions a replacement closes over for its pattern's body.
        exec(f"def {code.co_name}({params}):\n    return _method[0]({', '.join(names)})\n", namespace)
        method = namespace[code.co_name]
        functools.update_wrapper(method, original, assigned=("__name__", "__qualname__", "__doc__"), updated=())
        del method.__wrapped__  # as fused(): the registry marks it with the original
        return method

    functools.update_wrapper(make_named, make)  # a fused() factory still (benchmarks/dit.py finds patterns so)
    return make_named
