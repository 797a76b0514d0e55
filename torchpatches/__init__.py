"""torchpatches: version-gated, fingerprinted, reversible patches for ``torch.compile`` users.

``import torchpatches`` applies every eligible patch once. Patches whose target module is not
imported yet (Inductor, diffusers) are *pending* and apply when that module is imported.

    torchpatches.status()               # name -> PatchStatus(state, reason); str() is a table
    torchpatches.revert("rope")         # the original objects are back, by identity
    torchpatches.apply("rope")          # and on again
    with torchpatches.disabled("inductor_realize"): ...
    with torchpatches.only("rope"): ...  # exactly these on inside the block, as before after it

``TORCHPATCHES_DISABLE=rope,inductor_realize`` (or ``all``) keeps patches off from the start;
an explicit ``apply(name)`` still applies a patch the environment disabled.
"""
from __future__ import annotations

import contextlib
import importlib
import traceback
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from ._core import env as _env
from ._core.declare import Patch, Site, Target
from ._core.import_hooks import not_installed_reason
from ._core.registry import Registry
from ._core.status import PatchState, PatchStatus, Status, TargetStatus
from .patches import PATCH_MODULES

if TYPE_CHECKING:
    from ._coverage.report import CoverageReport
    from ._doctor.report import DoctorReport

__version__ = "0.1.0"

__all__ = [
    "apply",
    "revert",
    "disabled",
    "only",
    "status",
    "patch_names",
    "doctor",
    "coverage",
    "Patch",
    "Target",
    "Site",
    "PatchState",
    "PatchStatus",
    "TargetStatus",
    "Status",
]

Names = Union[str, Iterable[str], None]


def _load_patches() -> Tuple[List[Patch], Dict[str, str], Dict[str, str]]:
    """The patches, the patch files that failed to load, and those skipped: every patch when torch is not
    installed (their replacement code needs it), one whose file imports another package that is not installed --
    nothing to patch then, so not a failure."""
    no_torch = not_installed_reason("torch")
    if no_torch is not None:
        return [], {}, dict.fromkeys(PATCH_MODULES, no_torch)
    patches: List[Patch] = []
    errors: Dict[str, str] = {}
    skipped: Dict[str, str] = {}
    for module_name in PATCH_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.patches.{module_name}")
            patches.append(module.PATCH)
        except Exception as error:  # one broken patch file must not take the others down
            missing = _not_installed(error)
            if missing is not None:
                skipped[module_name] = missing
            else:
                errors[module_name] = "".join(traceback.format_exception_only(type(error), error)).strip()
    return patches, errors, skipped


def _not_installed(error: BaseException) -> Optional[str]:
    """Why a patch file could not load when it is for want of a package that is not installed, else None."""
    name = getattr(error, "name", None) if isinstance(error, ImportError) else None
    if not name:
        return None
    return not_installed_reason(name.split(".", 1)[0])


_registry = Registry(*_load_patches())


def patch_names() -> Tuple[str, ...]:
    """Every patch this version of torchpatches knows, in the order they apply."""
    return _registry.names


def apply(name: Names = None) -> Status:
    """Apply the named patch(es), or with no name every patch TORCHPATCHES_DISABLE does not disable.

    Idempotent. Patches whose target module is not imported yet become pending.
    Unknown names raise ``ValueError``.
    """
    _apply(name)
    return status()


def _apply(name: Names) -> None:
    if name is None:
        off = _env.disabled_names(_registry.names)
        _registry.revert(sorted(off), f"disabled by {_env.ENV_VAR}")
        _registry.apply([patch for patch in _registry.names if patch not in off])
    else:
        _registry.apply(name)


def revert(name: Names = None) -> Status:
    """Put back the original objects (the same objects, ``is``) of the named patch(es), or of all."""
    _registry.revert(name)
    return status()


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Revert the named patches (all if none named) for the ``with`` block; re-apply those that were on.

    ``disabled("a", "b")`` and ``disabled(["a", "b"])`` are the same; names are checked as by ``apply``.
    """
    names = _one_list(names)
    chosen = _registry.resolve_names(names or None)
    were_on = [name for name in chosen if _registry.is_wanted(name)]
    _registry.revert(were_on, "disabled by torchpatches.disabled()")
    try:
        yield
    finally:
        _registry.apply(were_on)


@contextlib.contextmanager
def only(*names: str) -> Iterator[None]:
    """Exactly the named patches on inside the ``with`` block (every other one reverted; none named:
    all off); after it, every patch is on or off as before the block, also on an exception.

    For measuring one patch alone (tests, benchmarks). Unknown names raise ``ValueError`` before
    anything changes.
    """
    chosen = _registry.resolve_names(_one_list(names))
    before = _registry.wanted()
    _registry.revert([name for name in _registry.names if name not in chosen], "disabled by torchpatches.only()")
    _registry.apply(chosen)
    try:
        yield
    finally:
        _registry.restore(before)


def _one_list(names: Tuple[object, ...]) -> Tuple[object, ...]:
    """``f(["a", "b"])`` means ``f("a", "b")`` for the ``*names`` context managers, as ``apply`` takes a list."""
    if len(names) == 1 and not isinstance(names[0], (str, bytes, bytearray)) and names[0] is not None:
        try:
            return tuple(names[0])  # type: ignore[arg-type]
        except TypeError:
            pass  # not iterable: resolve_names says what is wrong with it
    return names


def status() -> Status:
    """Each patch's state (applied / skipped / disabled / failed / pending) and the reason."""
    return _registry.status()


def doctor(fn_or_module: Any, *args: Any, **kwargs: Any) -> "DoctorReport":
    """Graph breaks and recompiles of ``fn_or_module(*args, **kwargs)`` under ``torch.compile``, each
    break mapped to the patch that removes it; whether ``fullgraph=True`` compiles (tried).

    ``fn_or_module`` is compiled with ``backend="eager"`` and called once; a zero-argument callable that
    is neither a module nor compiled is run as it is, capturing every compile inside it. Returns a
    ``DoctorReport``: ``str()`` is a table, ``.to_json()`` the stable form, ``.exit_code`` 0 when no
    graph break remains (1 when breaks remain, 3 when nothing was compiled: not judged). Calls
    ``torch._dynamo.reset()`` between its runs.
    """
    import sys

    from ._doctor import diagnose as _doctor  # lazily: the doctor is not part of the import path

    return _doctor.doctor(sys.modules[__name__], fn_or_module, args, kwargs)


def coverage(model: Any, *args: Any, **kwargs: Any) -> "CoverageReport":
    """What fused in ``model(*args, **kwargs)`` and why not: calls it once, watched, and reports per fusion
    pattern and class the calls fused and those handed to diffusers' code with the reason (compiling, autocast, a
    gradient wanted, a hooked or subclassed module, a dtype, not CUDA, a replaced global, a shape the pattern does
    not serve), the classes of the model a pattern targets that is not applied, and those no pattern targets. On
    CUDA it then times the call with and without torchpatches (warm-up, alternated, CUDA events, medians).

    Call it as you call the model (inside ``torch.inference_mode()`` if that is how you run it): the outcome
    depends on that state. Returns a ``CoverageReport``: ``str()`` is a table, ``.to_json()`` the stable form.
    """
    import sys

    from ._coverage import run as _coverage  # lazily: not part of the import path

    return _coverage.coverage(sys.modules[__name__], model, args, kwargs)


_apply(None)  # at import: every eligible patch, without building a status report
