"""A function recompiled from its own (fingerprinted) source with some global names rebound.

The copy keeps the original's file, line numbers, defaults and closure; every global it does not
rebind is read live from the original module (its ``__dict__`` is the copy's globals), so other patches
that rebind module attributes (``rope`` rebinds ``apply_rotary_emb``) still take effect.
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from typing import Any, Dict, Mapping, Sequence, Tuple

from ..._core.gates import future_flags

__all__ = ["rebind_globals"]


def rebind_globals(
    func: types.FunctionType, bindings: Mapping[str, Any], edits: Sequence[Tuple[str, str]] = ()
) -> types.FunctionType:
    """``func`` recompiled from its source with the global names in ``bindings`` bound to new values.

    Free variables of ``func`` (closures) keep their current values unless ``bindings`` names them;
    that includes the ``__class__`` cell of a method using zero-argument ``super()`` (the factory's
    parameter named ``__class__`` is the cell the compiler makes ``super()`` read).
    ``edits`` are exact ``(old, new)`` source replacements (one line each, so line numbers hold);
    each ``old`` must occur exactly once. Decorators are not re-applied: the caller wraps the
    result as the original was wrapped.
    """
    code = func.__code__
    # From the code object: getsource(func) would follow __wrapped__ to the decorated function.
    source = textwrap.dedent(inspect.getsource(code))
    for old, new in edits:
        if source.count(old) != 1 or "\n" in old or "\n" in new:
            raise ValueError(f"edit {old!r} does not match {func.__qualname__} exactly once on one line")
        source = source.replace(old, new)
    tree = ast.parse(source)
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef) or definition.name != code.co_name:
        raise TypeError(f"the source of {func.__qualname__} is not a plain def")
    definition.decorator_list = []
    # Keep diffusers' line numbers, so tracebacks and trace-time warnings point at the real file.
    # (co_firstlineno is the first decorator's line, where getsource starts.)
    ast.increment_lineno(tree, code.co_firstlineno - 1)
    closure = {name: cell.cell_contents for name, cell in zip(code.co_freevars, func.__closure__ or ())}
    closure.update(bindings)
    factory = ast.FunctionDef(
        name="_torchpatches_factory",
        args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg=name) for name in closure], vararg=None,
            kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[],
        ),
        body=[definition, ast.Return(value=ast.Name(id=definition.name, ctx=ast.Load()))],
        decorator_list=[],
        returns=None,
        **({"type_params": []} if sys.version_info >= (3, 12) else {}),
    )
    module = ast.fix_missing_locations(ast.Module(body=[factory], type_ignores=[]))
    compiled = compile(module, code.co_filename, "exec", flags=future_flags(func.__globals__), dont_inherit=True)
    namespace: Dict[str, Any] = {}
    exec(compiled, func.__globals__, namespace)  # noqa: S102 - the source is the fingerprinted original
    new = namespace["_torchpatches_factory"](**closure)
    new.__qualname__, new.__module__, new.__doc__ = func.__qualname__, func.__module__, func.__doc__
    new.__defaults__, new.__kwdefaults__ = func.__defaults__, func.__kwdefaults__
    new.__dict__.update(func.__dict__)
    return new
