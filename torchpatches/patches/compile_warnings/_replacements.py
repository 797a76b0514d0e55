"""How compile_warnings rebuilds each kind of target (imported with the target table, when diffusers is).

The replacements are the *same source* as the verified originals (fingerprinted), recompiled
(:func:`._rebind.rebind_globals`) so that a few global names -- ``logger``, ``deprecate`` -- resolve
to compile-safe stand-ins held in a closure; line numbers and file names stay those of diffusers.
"""
from __future__ import annotations

import functools
import logging
import sys
import types
from typing import Any, Callable, Dict, Mapping, Optional

from ..._core.compat import is_compiling
from ...compile import OnceLogger, constant_query, warn_once
from ._rebind import rebind_globals

__all__ = ["once_logger_for", "compile_safe_deprecate", "lora_wrapper_replacement", "rebind_logger", "lora_forward",
           "dispatch_attention", "rebind_deprecate"]


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


_expired = constant_query(_expired_query)


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


# ---- the make_replacement functions of the target table ----------------------------------------


def _module_logger(module_name: str) -> Any:
    return once_logger_for(sys.modules[module_name].logger)


def rebind_logger(module_name: str) -> Callable[[Any], Any]:
    """A make_replacement: the original function with its module's ``logger`` made compile-safe."""

    def make(original: Any) -> Any:
        return rebind_globals(original, {"logger": _module_logger(module_name)})

    return make


def lora_forward(module_name: Optional[str]) -> Callable[[Any], Any]:
    """A make_replacement for an ``@apply_lora_scale`` forward: the wrapper's scale warning, and
    (with ``module_name``) the forward's own ``logger`` sites."""

    def make(original: Any) -> Any:
        inner = {"logger": _module_logger(module_name)} if module_name else None
        return lora_wrapper_replacement(original, _module_logger("diffusers.utils.peft_utils"), inner)

    return make


#: DIFFUSERS_ATTN_CHECKS=1: Dynamo 2.11 and 2.12 fail (a bare AssertionError, not a graph break) on this
#: set difference; the comprehension is the same set and traces on 2.11 through 2.15.
_ATTN_CHECKS_EDIT = (
    "removed_kwargs = set(kwargs) - set(_AttentionBackendRegistry._supported_arg_names[backend_name])",
    "removed_kwargs = {k for k in kwargs if k not in _AttentionBackendRegistry._supported_arg_names[backend_name]}",
)


def dispatch_attention(original: Any) -> Any:
    """A make_replacement for ``dispatch_attention_fn``: its ``logger`` made compile-safe, the set edited."""
    logger = _module_logger("diffusers.models.attention_dispatch")
    return rebind_globals(original, {"logger": logger}, edits=(_ATTN_CHECKS_EDIT,))


def rebind_deprecate(original: Any) -> Any:
    """A make_replacement: the original function with ``deprecate`` made compile-safe."""
    deprecation_utils = sys.modules["diffusers.utils.deprecation_utils"]
    return rebind_globals(original, {"deprecate": compile_safe_deprecate(deprecation_utils.deprecate)})
