"""Make Inductor's compile caches see which Inductor-internal patches are active.

A patch such as ``inductor_realize`` changes the code Inductor generates without changing the
FX graph, so the FX graph cache and the AOTAutograd cache (whose keys hash the graph, the
inputs, the configs and the torch sources) would serve an artifact compiled *without* the
patch to a patched process, and the other way round. ``torch.compiler.config.cache_key_tag``
(env ``TORCH_COMPILE_CACHE_KEY_TAG``, torch >= 2.6; verified on 2.11 and 2.13) is hashed into
both keys: ``FxGraphHashDetails.__init__`` stores it and ``AOTAutogradCacheDetails`` subclasses
``FxGraphHashDetails``. It also enters the autotune-cache and PGO (automatic-dynamic) keys, so
patched and unpatched runs keep separate profiles too.

We append one token per active patch to whatever tag the user set, and remove exactly that
token again, so the user's own tag is never overwritten. The environment variable is left
alone: a child process that imports torchpatches adds its own tokens, and one that does not is
not patched and must not claim to be.

Threads: on torch 2.11 the tag is one process-wide value. On torch 2.13 (verified; maybe 2.12)
config overrides live in ``ContextVar``s, so a value set by attribute is seen by the setting
thread / context only. There we write the tokens into the process-wide layer under the overrides
(the ``TORCH_COMPILE_CACHE_KEY_TAG`` value read at import, else the default), which every thread
and context without its own override reads, and restore that layer exactly when the last token
goes; the calling context's own override, if it has one, is updated as well. Another thread's or
context's own override of the tag cannot be reached (:func:`tag_is_thread_local` says whether
this torch works that way).

On a torch without ``cache_key_tag`` (before 2.6) nothing is changed and a warning says that
patched and unpatched compiles may share cache entries; :func:`is_supported` lets the
registry decide what to do (no Inductor patch we ship targets such a torch).

A patch's token (:func:`cache_token`) names the patch, the original it replaced and the patch's own
code; :func:`add_patch_token` is what a target slot calls when it swaps such a patch in, and
:func:`remove_token` when it swaps it out.
"""
from __future__ import annotations

import contextvars
import inspect
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from . import _gates

if TYPE_CHECKING:
    from ._declare import Patch, Target

__all__ = [
    "SEPARATOR",
    "cache_token",
    "add_patch_token",
    "add_token",
    "remove_token",
    "active_tokens",
    "is_supported",
    "tag_is_thread_local",
]

logger = logging.getLogger("torchpatches")

# Between the user's tag and each of our tokens. Tokens look like
# "torchpatches:inductor_realize@1d32e5f50cbc847e", so they never contain it.
SEPARATOR = ";"

_lock = threading.RLock()
# Our tokens, in the order they were added. The tag we last wrote is always
# user_tag + "".join(SEPARATOR + token ...) unless someone changed the tag since.
_tokens: List[str] = []
_warned_unsupported = False
# Thread-local-config torch only: the process-wide layer's value before our first token.
_global_base: Optional[str] = None


def _compiler_config() -> Optional[Any]:
    """``torch.compiler.config`` if this torch has ``cache_key_tag``, else None (imports nothing heavy)."""
    try:
        import torch.compiler.config as compiler_config
    except ImportError:
        return None
    return compiler_config if hasattr(compiler_config, "cache_key_tag") else None


def is_supported() -> bool:
    """Whether this torch has a cache-key tag that our tokens can enter."""
    return _compiler_config() is not None


def tag_is_thread_local() -> bool:
    """Whether this torch keeps config overrides per thread/context (ContextVar), as 2.13 does."""
    config = _compiler_config()
    entry = getattr(config, "_config", {}).get("cache_key_tag") if config is not None else None
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


def _process_wide_layer(config: Any) -> Optional[Tuple[Any, str]]:
    """(config entry, attribute) holding the tag for contexts without an override; None on 2.11."""
    if not tag_is_thread_local():
        return None
    entry = config._config["cache_key_tag"]
    unset = getattr(sys.modules.get("torch.utils._config_module"), "_UNSET_SENTINEL", None)
    from_env = getattr(entry, "env_value_default", unset)
    return entry, ("env_value_default" if from_env is not unset else "default")


def _set_current_tag(config: Any, value: str) -> None:
    """Set the tag this context reads: its override on 2.11; on thread-local torch only an existing one."""
    layer = _process_wide_layer(config)
    if layer is not None:
        unset = getattr(sys.modules.get("torch.utils._config_module"), "_UNSET_SENTINEL", None)
        if layer[0].user_override.get() is unset:
            return  # this context reads the process-wide layer, which _sync_process_wide_layer writes
    config.cache_key_tag = value


def _sync_process_wide_layer(config: Any) -> None:
    """Mirror our tokens into the layer that threads without their own override read."""
    global _global_base
    layer = _process_wide_layer(config)
    if layer is None:
        return
    entry, attribute = layer
    if _global_base is None:
        _global_base = getattr(entry, attribute)
    setattr(entry, attribute, _global_base + _suffix(_tokens))
    if not _tokens:
        _global_base = None


def active_tokens() -> List[str]:
    """The tokens torchpatches has added and not removed, oldest first."""
    with _lock:
        return list(_tokens)


def _suffix(tokens: List[str]) -> str:
    return "".join(SEPARATOR + token for token in tokens)


def _user_tag(current: str) -> str:
    """The user's part of ``current``: the tag without the suffix of our tokens.

    If the user replaced the tag after we added tokens (so our suffix is gone), the whole
    tag is theirs; any of our tokens still inside it are removed individually by the caller.
    """
    suffix = _suffix(_tokens)
    if suffix and current.endswith(suffix):
        return current[: -len(suffix)]
    return current


def _strip_token(tag: str, token: str) -> str:
    """Remove one stray ``token`` from a tag that no longer ends with our suffix."""
    parts = tag.split(SEPARATOR)
    if token in parts:
        parts.remove(token)
    return SEPARATOR.join(parts)


def _warn_unsupported_once() -> None:
    global _warned_unsupported
    if not _warned_unsupported:
        _warned_unsupported = True
        logger.warning(
            "torch.compiler.config.cache_key_tag does not exist in this torch: Inductor's caches "
            "cannot tell patched from unpatched compiles (set TORCHINDUCTOR_FX_GRAPH_CACHE=0 to be safe)"
        )


def add_token(token: str) -> None:
    """Append ``token`` to the cache-key tag, after the user's tag; a no-op if already there."""
    if not token or SEPARATOR in token:
        raise ValueError(f"cache-key token {token!r} must be non-empty and contain no {SEPARATOR!r}")
    config = _compiler_config()
    with _lock:
        if token in _tokens:
            return
        if config is None:
            _tokens.append(token)
            _warn_unsupported_once()
            return
        user_tag = _user_tag(config.cache_key_tag)
        _tokens.append(token)
        _set_current_tag(config, user_tag + _suffix(_tokens))
        _sync_process_wide_layer(config)
        logger.debug("Inductor cache_key_tag is now %r", config.cache_key_tag)


def remove_token(token: str) -> None:
    """Remove ``token`` from the cache-key tag; with no tokens left the user's tag is back exactly."""
    config = _compiler_config()
    with _lock:
        if token not in _tokens:
            return
        if config is None:
            _tokens.remove(token)
            return
        current = config.cache_key_tag
        ours_intact = current.endswith(_suffix(_tokens))
        user_tag = _user_tag(current)
        _tokens.remove(token)
        if ours_intact:
            _set_current_tag(config, user_tag + _suffix(_tokens))
        else:
            # Someone rewrote the tag since we added tokens; take out only what is ours.
            _set_current_tag(config, _strip_token(current, token))
        _sync_process_wide_layer(config)
        logger.debug("Inductor cache_key_tag is now %r", config.cache_key_tag)


def cache_token(patch: "Patch", target: "Target", original_fingerprint: str) -> str:
    """The text an Inductor patch adds to the compile cache key while it is applied.

    It names the original it replaced and the code of the patch itself (the module that builds
    the replacement), so neither a different torch nor a newer torchpatches is served artifacts
    compiled under the other.
    """
    patch_module = inspect.getmodule(target.make_replacement)
    patch_code = _gates.fingerprint(patch_module) if patch_module is not None else "unknown"
    return f"torchpatches:{patch.name}@{original_fingerprint}.{patch_code}"


def add_patch_token(patch: "Patch", target: "Target", original_fingerprint: str) -> str:
    """Add the token of ``patch`` applied over the original with ``original_fingerprint``; returns it."""
    token = cache_token(patch, target, original_fingerprint)
    add_token(token)
    return token
