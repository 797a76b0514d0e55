"""Make Inductor's compile caches see which Inductor-internal patches are active.

A patch such as ``inductor_realize`` changes the code Inductor generates without changing the
FX graph, so the FX graph cache and the AOTAutograd cache would serve an artifact compiled
*without* the patch to a patched process, and the other way round.

Mechanism: a key component that Inductor computes at lookup time. Both caches build their key by
pickling a details object: ``torch._inductor.codecache.FxGraphHashDetails`` for the FX graph cache,
and its subclass ``AOTAutogradCacheDetails`` for the AOTAutograd cache (verified on torch 2.11, 2.13
and pytorch main). We wrap ``FxGraphHashDetails.__init__`` once: after the original ran, it adds one
attribute, ``torchpatches``, holding the tokens of the Inductor patches in effect *for this compile*,
so they are pickled into the key (and show in the cache's debug lines). With no token active it
adds nothing, so a process with no Inductor patch applied shares keys with plain torch.

Why not ``torch.compiler.config.cache_key_tag`` (what this module did before): it is the user's.
A plain assignment, ``config.patch(cache_key_tag=...)`` (including a first compile inside such a
block, where Inductor patches apply) or, on torch >= 2.13, another thread's override all dropped
the token while the patch stayed applied, and a patched process was served an unpatched artifact.
The component here is read at every lookup from what is applied now; nothing the user does with
their own tag can remove it.

Where Inductor lowers a graph in a child process (``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess``,
``async+...``, ``progressive+...``), the child does not import torchpatches, so its code is
unpatched: the component is then empty (the key does not claim the patch) and
:func:`lowering_elsewhere` says why, for ``status()``. Inductor's compile *workers*
(``compile_threads``) only compile kernel source that was generated in this process, after
lowering, so they need nothing.

A patch's token (:func:`cache_token`) names the patch, the original it replaced and the patch's own
code; :func:`add_patch_token` is what a target slot calls when it swaps such a patch in, and
:func:`remove_token` when it swaps it out.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import marshal
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from . import gates as _gates

if TYPE_CHECKING:
    from .declare import Patch, Target

__all__ = ["SEPARATOR", "cache_token", "add_patch_token", "add_token", "remove_token", "active_tokens",
           "key_component", "lowering_elsewhere", "is_supported", "KEY_ATTRIBUTE"]

logger = logging.getLogger("torchpatches")

#: Tokens look like "torchpatches:inductor_realize@1d32e5f50cbc847e.<patch code>" and never contain it.
SEPARATOR = ";"
#: The attribute added to Inductor's cache-key details (and so to the key).
KEY_ATTRIBUTE = "torchpatches"
_HOOK_MARK = "__torchpatches_cache_key_hook__"
_FX_COMPILE_MODE_ENV = "TORCHINDUCTOR_FX_COMPILE_MODE"

_lock = threading.RLock()
_tokens: List[str] = []


def active_tokens() -> List[str]:
    """The tokens torchpatches has added and not removed, oldest first."""
    with _lock:
        return list(_tokens)


def lowering_elsewhere() -> Optional[str]:
    """None when Inductor lowers graphs in this process; else a sentence saying where and why that
    matters (the child process does not import torchpatches, so Inductor patches are not in effect)."""
    compile_fx = sys.modules.get("torch._inductor.compile_fx")
    if compile_fx is not None and hasattr(compile_fx, "fx_compile_mode"):
        mode = getattr(compile_fx.fx_compile_mode, "name", str(compile_fx.fx_compile_mode)).upper()
        in_process = mode in ("NORMAL", "SERIALIZE")
        if in_process and not (getattr(compile_fx, "fx_compile_async", False)
                               or getattr(compile_fx, "fx_compile_progressive", False)):
            return None
        shown = os.environ.get(_FX_COMPILE_MODE_ENV) or mode.lower()
    else:  # Inductor not loaded yet: read the variable the way compile_fx will
        shown = os.environ.get(_FX_COMPILE_MODE_ENV)
        if not shown:
            return None
        value = shown.lower()
        for prefix in ("progressive+", "async+"):
            if value.startswith(prefix):
                return _elsewhere_reason(shown)
        if value.upper() not in ("SUBPROCESS",):
            return None  # NORMAL, SERIALIZE (in process) or a value Inductor rejects (then NORMAL)
    return _elsewhere_reason(shown)


def _elsewhere_reason(shown: str) -> str:
    return (f"not in effect: {_FX_COMPILE_MODE_ENV}={shown} lowers graphs in a child process that does not "
            "import torchpatches (Inductor's cache key does not claim this patch there)")


def key_component() -> Tuple[str, ...]:
    """What enters Inductor's cache key now: the active tokens, or () where lowering happens elsewhere."""
    with _lock:
        tokens = tuple(_tokens)
    if not tokens or lowering_elsewhere() is not None:
        return ()
    return tokens


def _details_classes() -> List[type]:
    """Inductor's cache-key detail classes whose ``__init__`` we wrap (imported: Inductor is loaded)."""
    from torch._inductor.codecache import FxGraphHashDetails

    classes: List[type] = [FxGraphHashDetails]
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCacheDetails
    except ImportError:  # no AOTAutograd cache on this torch: nothing to cover
        return classes
    if not issubclass(AOTAutogradCacheDetails, FxGraphHashDetails):  # covered through super() otherwise
        classes.append(AOTAutogradCacheDetails)
    return classes


def _hooked_init(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # Looked up by name, not closed over: after torchpatches is imported again (a reload, or
        # removed from sys.modules), the tokens of the module now in use are the ones that count.
        module = sys.modules.get(__name__)
        component = module.key_component() if module is not None else ()
        if component:
            setattr(self, KEY_ATTRIBUTE, component)

    setattr(__init__, _HOOK_MARK, True)
    return __init__


def install_hook() -> None:
    """Wrap the cache-key details once per process (idempotent). Raises if this torch has no such class."""
    for cls in _details_classes():
        init = cls.__dict__.get("__init__")
        if init is None or not callable(init):
            raise RuntimeError(f"{cls.__qualname__} has no __init__ of its own; cannot enter Inductor's cache key")
        if getattr(init, _HOOK_MARK, False):
            continue
        cls.__init__ = _hooked_init(init)


def is_supported() -> bool:
    """Whether this torch has the cache-key details class our tokens can enter (imports Inductor)."""
    try:
        _details_classes()
    except ImportError:
        return False
    return True


def add_token(token: str) -> None:
    """Make ``token`` part of Inductor's cache key while it is active; a no-op if it already is.

    Raises (and adds nothing) when the key cannot be reached on this torch: an Inductor patch that
    cannot enter the key must not apply.
    """
    if not isinstance(token, str) or not token or SEPARATOR in token:
        raise ValueError(f"cache-key token {token!r} must be a non-empty str without {SEPARATOR!r}")
    with _lock:
        if token in _tokens:
            return
        install_hook()
        _tokens.append(token)
    logger.debug("torchpatches: Inductor cache-key tokens are now %r", _tokens)


def remove_token(token: str) -> None:
    """Take ``token`` out of Inductor's cache key; a no-op if it is not active."""
    with _lock:
        if token in _tokens:
            _tokens.remove(token)
    logger.debug("torchpatches: Inductor cache-key tokens are now %r", _tokens)


def cache_token(patch: "Patch", target: "Target", original_fingerprint: str) -> str:
    """The text an Inductor patch adds to the compile cache key while it is applied.

    It names the original it replaced and the code of the patch itself (the module that builds
    the replacement), so neither a different torch nor a newer torchpatches is served artifacts
    compiled under the other. Where that module has no readable source (``python -c``, a zip or a
    wheel without .py files) the bytecode of ``make_replacement`` stands in: never a shared
    placeholder, which would let two different patch codes share cache entries.
    """
    patch_module = inspect.getmodule(target.make_replacement)
    try:
        if patch_module is None:
            raise TypeError("no module")
        patch_code = _gates.fingerprint(patch_module)
    except (OSError, TypeError):
        code = getattr(target.make_replacement, "__code__", None)
        blob = marshal.dumps(code) if code is not None else repr(target.make_replacement).encode()
        patch_code = "b" + hashlib.sha256(blob).hexdigest()[:15]
    return f"torchpatches:{patch.name}@{original_fingerprint}.{patch_code}"


def add_patch_token(patch: "Patch", target: "Target", original_fingerprint: str) -> str:
    """Add the token of ``patch`` applied over the original with ``original_fingerprint``; returns it."""
    token = cache_token(patch, target, original_fingerprint)
    add_token(token)
    return token
