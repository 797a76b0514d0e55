"""Replacement builders for the ``compile_warnings`` patch (imported lazily, when diffusers is).

The replacements are the *same source* as the verified originals (fingerprinted), recompiled so
that a few global names -- ``logger``, ``deprecate`` -- resolve to compile-safe stand-ins held in a
closure. Every other global is read live from the original module (its ``__dict__`` is the new
function's globals), so other patches that rebind module attributes (``rope`` rebinds
``apply_rotary_emb``) still take effect, and line numbers / filenames stay those of diffusers.
"""
from __future__ import annotations

import __future__
import ast
import functools
import inspect
import logging
import sys
import textwrap
import types
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from ._compat import is_compiling
from .compile import OnceLogger, warn_once

__all__ = ["rebind_globals", "once_logger_for", "compile_safe_deprecate", "lora_wrapper_replacement"]


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
    compiled = compile(module, code.co_filename, "exec", flags=_future_flags(func), dont_inherit=True)
    namespace: Dict[str, Any] = {}
    exec(compiled, func.__globals__, namespace)  # noqa: S102 - the source is the fingerprinted original
    new = namespace["_torchpatches_factory"](**closure)
    new.__qualname__, new.__module__, new.__doc__ = func.__qualname__, func.__module__, func.__doc__
    new.__defaults__, new.__kwdefaults__ = func.__defaults__, func.__kwdefaults__
    new.__dict__.update(func.__dict__)
    return new


def _future_flags(func: types.FunctionType) -> int:
    flags = 0
    for name in __future__.all_feature_names:
        feature = getattr(__future__, name)
        if func.__globals__.get(name) is feature:
            flags |= feature.compiler_flag
    return flags


_once_loggers: Dict[str, OnceLogger] = {}


def once_logger_for(logger: logging.Logger) -> OnceLogger:
    """One :class:`OnceLogger` per logger, so every patched site of a module shares it."""
    found = _once_loggers.get(logger.name)
    if found is None or found.logger is not logger:
        found = _once_loggers[logger.name] = OnceLogger(logger)
    return found


def compile_safe_deprecate(original: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers' ``deprecate`` that, under compile, warns at trace time instead of breaking the graph.

    In eager it *is* the original call (same warnings, same errors). Under compile it handles the
    form model code uses in forward -- ``deprecate(name, version, message)`` with no ``take_from``,
    whose result is None and whose only effects are the FutureWarning (same text, through
    :func:`warn_once`) and a ValueError for an expired deprecation (checked through a constant
    query, raised at trace time as eager would raise it). Other forms (``take_from=...`` pops
    from a dict) call the original.
    """

    @functools.wraps(original)
    def deprecate(*args: Any, take_from: Any = None, standard_warn: bool = True, stacklevel: int = 2) -> Any:
        if take_from is None and is_compiling():
            for attribute, version_name, message in _deprecation_tuples(args):
                _check_not_expired(attribute, version_name, message)
                warning = f"`{attribute}` is deprecated and will be removed in version {version_name}."
                text = (warning + " " if standard_warn else "") + message
                # Under compile our frame is a traced user frame: stacklevel counts from it as in eager.
                warn_once(text, FutureWarning, stacklevel=stacklevel)
            return None
        return original(*args, take_from=take_from, standard_warn=standard_warn, stacklevel=stacklevel + 1)

    return deprecate


def _deprecation_tuples(args: tuple) -> tuple:
    return args if isinstance(args[0], tuple) else (args,)


def _check_not_expired(attribute: str, version_name: str, message: str) -> None:
    if _expired(version_name):
        raise ValueError(
            f"The deprecation tuple {(attribute, version_name, message)} should be removed since diffusers'"
            f" version {_diffusers_version()} is >= {version_name}"
        )


def _diffusers_version() -> str:
    from diffusers import __version__

    return __version__


def _expired_query(version_name: str) -> bool:
    from packaging import version

    return version.parse(version.parse(_diffusers_version()).base_version) >= version.parse(version_name)


def _make_expired() -> Callable[[str], bool]:
    from .compile import constant_query

    return constant_query(_expired_query)


_expired = _make_expired()


def lora_wrapper_replacement(
    wrapper: types.FunctionType, peft_logger: OnceLogger, inner_bindings: Optional[Mapping[str, Any]] = None
) -> types.FunctionType:
    """A copy of an ``@apply_lora_scale`` wrapper whose scale warning goes through ``peft_logger``.

    The target's fingerprint covers the wrapper and the forward it wraps (every ``__wrapped__`` layer);
    the decorator that makes such wrappers, ``apply_lora_scale``, is in the patch's ``verifies``. With
    ``inner_bindings`` the wrapped forward is rebuilt too, for its own ``logger`` sites.
    """
    names = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__ or ())))
    inner = names["forward_fn"]
    new_inner = rebind_globals(inner, inner_bindings) if inner_bindings else inner
    new = rebind_globals(wrapper, {"logger": peft_logger, "forward_fn": new_inner})
    functools.update_wrapper(new, new_inner)
    return new
