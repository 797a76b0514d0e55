"""What every eager fusion patch (adaln, qk_norm_rope, gate_residual, gelu_gemm, swiglu) shares.

A fused pattern is declared, not hand-written: :func:`fused` turns a *body* into the replacement of a
diffusers method. The body has the original's signature (spelled once, there), decides from named
predicates whether it covers the call and returns :data:`FALLBACK` before doing anything if not; the
replacement owns the rest:

    compiling or recording in any form?  (:func:`steps_aside`)   -> original(self, *args, **kwargs)
    a global the original reads replaced? (:class:`Assumptions`) -> original(self, *args, **kwargs)
    body(self, *args, **kwargs) is FALLBACK                      -> original(self, *args, **kwargs)

A fused path may only skip diffusers' code where that changes nothing a user can observe, so it steps aside:

- under torch.compile (Inductor fuses diffusers' own code), ``torch.jit.trace`` (a kernel would see traced
  sizes), forward-mode AD and functorch transforms (vmap, grad, jvp: dual and wrapped tensors), and with
  module-global forward hooks (:func:`steps_aside`);
- when a global the replaced stretch looks up at call time is not what it was when the patch was applied:
  every module global the original's code reads (``apply_rotary_emb``, ``dispatch_attention_fn``, ...), and
  the functions reached through modules that a target declares (``F.layer_norm``, ``LayerNorm.forward``, ...).
  A torchpatches replacement of the captured object (the ``rope`` patch's) counts as the object itself;
- per call (:func:`fusable`): tensors other than plain float ``torch.Tensor`` on a served device (CUDA; on
  CPU only while a test forces a tier, ``ops/_tiers``), autocast on for that device (diffusers' result
  dtype would differ), a gradient wanted (inputs or parameters); modules the fused path does not call
  that are not exactly the stock class without hooks (:func:`stock`).

A check that reads several submodules can be decided once per module instance and input signature with
:func:`remembered` (decided again when the module's or those submodules' state changes: hooks, a
``forward`` on the instance, training mode, parameters after ``.to()``, a submodule replaced or rebound).

``pattern_on(name)`` says whether a sibling pattern is applied right now, from the registry's mark on its
targets (``__torchpatches_patch__``). The only state here is :func:`remembered`'s, weakly keyed by module.
"""
from __future__ import annotations

import functools
import importlib
import operator
import sys
import types
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple, Union

import torch

from .._core.compat import is_compiling
from .._core.declare import Target
from .._core.lazy import BODY_REFERENCE, reference_name, resolve
from .._core.slot import MARK_ORIGINAL, MARK_PATCH
from ..ops._runtime.tiers import FLOAT_DTYPES, eager_transforms, forced_tier

__all__ = ["FALLBACK", "declined", "why_not_fusable", "FLOAT_DTYPES", "LAYER_NORM", "RMS_NORM", "GELU", "SILU", "CAT",
           "LINEAR", "DROPOUT", "fused", "steps_aside", "fusable", "stock", "linear", "dropout",
           "plain_layer_norm",
           "plain_rms_norm", "tensors_fit", "pattern_on", "Assumptions", "remembered"]


#: A fused body: the function, or ``"module:attribute"`` naming it (imported when its target is patched).
Body = Union[str, Callable[..., Any]]

#: A body's answer for a call it does not cover (given before it does anything): the original runs.
FALLBACK = object()

#: While ``torchpatches.coverage`` watches a call: its recorder, told each patched call's outcome
#: (``record(pattern, self, reason)``, reason None when fused) and why a predicate declined (``note(text)``).
#: None otherwise: the fused path then pays one global read per call.
observer: Optional[Any] = None


def _note(text: str) -> None:
    """Why a predicate said no, for the observer (only called on a predicate's declining path). The global is read
    once: another thread's ``coverage`` may remove the recorder between two reads."""
    seen = observer
    if seen is not None:
        seen.note(text)


def declined(reason: str) -> object:
    """:data:`FALLBACK`, with ``reason`` told to the observer: ``return declined("...")`` in a body."""
    _note(reason)
    return FALLBACK

#: Functions reached through modules by the code a fused path skips ("module:qualname").
LAYER_NORM = ("torch.nn.functional:layer_norm", "torch.nn.modules.normalization:LayerNorm.forward")
RMS_NORM = ("torch.nn.functional:rms_norm", "torch.nn.modules.normalization:RMSNorm.forward")
GELU = ("torch.nn.functional:gelu", "torch.nn.modules.activation:GELU.forward")
SILU = ("torch.nn.functional:silu", "torch.nn.modules.activation:SiLU.forward")
CAT = ("torch:cat",)
#: What :func:`linear` and :func:`dropout` skip past: a target whose body calls them declares these.
LINEAR = ("torch.nn.functional:linear", "torch.nn.modules.linear:Linear.forward")
DROPOUT = ("torch.nn.functional:dropout", "torch.nn.modules.dropout:Dropout.forward")


# ---- the globals a fused path assumes -------------------------------------------------------------


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # comprehensions, lambdas
            yield from _global_names(const)


def _unmarked(obj: Any) -> Any:
    """A torchpatches replacement stands for the original it replaces."""
    original = getattr(obj, MARK_ORIGINAL, None) if callable(obj) else None
    return obj if original is None else original


class Assumptions:
    """The objects a fused path assumes, captured when the patch is applied, checked by identity per call."""

    __slots__ = ("_checks", "_names")

    def __init__(self, original: Callable[..., Any], declared: Iterable[str] = ()) -> None:
        g = getattr(original, "__globals__", {})
        code = getattr(original, "__code__", None)
        names = sorted({n for n in _global_names(code) if n in g}) if code is not None else []
        reads = [functools.partial(g.get, name) for name in names]
        for path in declared:
            module_name, qualname = path.split(":", 1)
            reads.append(functools.partial(operator.attrgetter(qualname), importlib.import_module(module_name)))
        self._checks: Tuple[Tuple[Callable[[], Any], Any], ...] = tuple((read, _unmarked(read())) for read in reads)
        self._names = tuple(names) + declared

    def intact(self) -> bool:
        for read, want in self._checks:
            now = read()
            if now is not want and getattr(now, MARK_ORIGINAL, None) is not want:
                return False
        return True

    def replaced(self) -> Tuple[str, ...]:
        """The names whose object is no longer the one captured (what made :meth:`intact` false)."""
        names = []
        for name, (read, want) in zip(self._names, self._checks):
            now = read()
            if now is not want and getattr(now, MARK_ORIGINAL, None) is not want:
                names.append(name)
        return tuple(names)


# ---- the replacement ---------------------------------------------------------------------------------


def steps_aside() -> bool:
    """Every fused path runs diffusers' code now: compiling, jit tracing, forward AD or a functorch
    transform, or module-global forward hooks (they expect every module call to happen)."""
    if is_compiling():
        return True
    m = torch.nn.modules.module
    return eager_transforms() or bool(m._global_forward_hooks or m._global_forward_pre_hooks)


def _why_aside() -> str:
    """Which of :func:`steps_aside`'s conditions holds (for the observer)."""
    if is_compiling():
        return "compiling: torch.compile runs diffusers' code (Inductor fuses it)"
    if eager_transforms():
        return "torch.jit.trace, forward-mode AD or a functorch transform is active"
    return "module-global forward hooks are registered"


#: What every fused pattern is gated on: the diffusers release its fingerprints were taken on, and torch.
FUSED_REQUIRES = {"diffusers": ">=0.42,<0.43", "torch": ">=2.4"}


def fused_target(pattern: str, path: str, body: Body, fingerprint: str, assumes: Iterable[str] = ()) -> Target:
    """The target ``path`` replaced by ``fused(pattern, body, assumes)``, verified by one fingerprint."""
    return Target(path, make_replacement=fused(pattern, body, tuple(assumes)), fingerprints=frozenset({fingerprint}))


def fused(pattern: str, body: Body, assumes: Iterable[str] = ()) -> Callable[[Any], Any]:
    """A ``make_replacement`` for a method: ``body`` where it covers the call, else the original.

    ``body`` is a function or a ``"module:attribute"`` reference to one, imported when the target is patched."""
    reference = None if callable(body) else body
    name = getattr(body, "__name__", "body") if reference is None else reference_name(reference)  # checks it
    declared = tuple(assumes)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        body_fn = resolve(body)
        assumptions = Assumptions(original, declared)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen = observer  # read once: another thread's coverage may remove it meanwhile
            if not steps_aside() and assumptions.intact():
                out = body_fn(self, *args, **kwargs)
                if out is not FALLBACK:
                    if seen is not None:
                        seen.record(pattern, self, None)
                    return out
            if seen is not None:
                seen.record(pattern, self, _why_declined(seen, assumptions, body_fn))
            return original(self, *args, **kwargs)

        # The original's name and docstring; no __wrapped__ (inspect.unwrap / fingerprint see this function).
        functools.update_wrapper(method, original, assigned=("__name__", "__qualname__", "__doc__"), updated=())
        del method.__wrapped__  # the registry marks it with the original and the patch name
        # A code object of its own, as each original has: Dynamo keeps its compiled entries (and counts recompiles
        # against recompile_limit) per code object. Shared, the forwards of FLUX's double and single blocks would be
        # one frame to Dynamo, whose guard on ``original`` fails at the second block: a recompile under diffusers'
        # regional compile, a hard failure with fullgraph=True and recompile_limit=1.
        method.__code__ = method.__code__.replace(co_name=original.__name__, co_qualname=original.__qualname__)
        return method

    make.__name__ = f"{pattern}_{name}"
    make.__torchpatches_fused__ = pattern  # what torchpatches.coverage lists as this target's pattern
    if reference:
        setattr(make, BODY_REFERENCE, reference)
    return make


def _why_declined(seen: Any, assumptions: Assumptions, body: Callable[..., Any]) -> str:
    """Why a call ran diffusers' code (for the observer): the replacement's own checks first, then the last
    predicate the body asked that said no, else the body's own shape and configuration checks."""
    if steps_aside():
        return _why_aside()
    replaced = assumptions.replaced()
    if replaced:
        return f"a global the original reads was replaced: {', '.join(replaced)}"
    body_name = getattr(body, "__name__", "body")
    return seen.last_note() or f"a shape or configuration the fused path does not serve ({body_name})"


# ---- per-call predicates -----------------------------------------------------------------------------


def fusable(x: Any, modules: Iterable[torch.nn.Module], *tensors: Optional[torch.Tensor]) -> bool:
    """``x`` is a plain float tensor on a device the fused tiers serve, autocast is off there, and no
    gradient would be recorded through ``x``, ``tensors`` or the parameters of ``modules``."""
    ok = (
        type(x) is torch.Tensor
        and x.dtype in FLOAT_DTYPES
        and (x.device.type == "cuda" or forced_tier() is not None)
        and not torch.is_autocast_enabled(x.device.type)
        and _grad_free(modules, x, *tensors)
    )
    if not ok and observer is not None:  # the words only while watched
        _note(why_not_fusable(x))
    return ok


def why_not_fusable(x: Any, dtypes: Iterable[torch.dtype] = FLOAT_DTYPES) -> str:
    """Which of :func:`fusable`'s conditions ``x`` fails, in words (for the observer)."""
    if type(x) is not torch.Tensor:
        return f"the input is a {type(x).__name__}, not a plain torch.Tensor"
    if x.dtype not in dtypes:
        return f"dtype {x.dtype} (the fused ops serve {', '.join(str(d) for d in dtypes)})"
    if x.device.type != "cuda" and forced_tier() is None:
        return f"device {x.device.type}: the fused tiers serve CUDA"
    if torch.is_autocast_enabled(x.device.type):
        return "autocast is on (diffusers' result dtype would differ)"
    return "a gradient is wanted (an input or a parameter requires grad)"


def _grad_free(modules: Iterable[torch.nn.Module], *tensors: Optional[torch.Tensor]) -> bool:
    if not torch.is_grad_enabled():
        return True
    if any(t is not None and t.requires_grad for t in tensors):
        return False
    return not any(p.requires_grad for module in modules for p in module.parameters())


# ---- verdicts remembered per module instance -----------------------------------------------------------

#: module -> (its state and its named children's when the verdicts were made, {key: verdict}).
_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, Tuple[tuple, dict]]" = weakref.WeakKeyDictionary()


def _state(module: Any) -> tuple:
    """What a module's verdicts depend on, read from its ``__dict__`` (``nn.Module.__getattr__`` costs more than
    the rest together): its class, its forward hooks, a ``forward`` set on the instance (accelerate's and
    diffusers' hooks), training mode, and its own parameters: which objects (by id: a tensor compared with
    ``==`` would compare elements), their types, dtypes, devices (``.to()``) and shapes (``p.data = ...`` keeps the
    object: the fused paths call their ops' unchecked entries with these weights). Nothing that refers back to
    the module (a bound ``forward`` would keep it alive through the weak-keyed entry)."""
    d = module.__dict__
    return (type(module), len(d["_forward_hooks"]), len(d["_forward_pre_hooks"]), "forward" in d,
            d.get("_compiled_call_impl") is not None, d["training"],
            *((id(p), type(p), p.dtype, p.device, p.shape) if p is not None else None
              for p in d["_parameters"].values()))


def remembered(module: Any, key: Any, check: Callable[[], bool], children: Tuple[str, ...] = ()) -> bool:
    """``check()``, computed once per ``module`` instance and ``key`` (the input signature the check reads:
    dtype, device, width...) while the module's state and that of its ``children`` (submodule names: the same
    objects, in the same state) are unchanged (:func:`_state`); recomputed after any change. Worth it where
    ``check`` reads several submodules (each ``nn.Module.__getattr__`` costs about a microsecond)."""
    if not isinstance(module, torch.nn.Module) or observer is not None:  # observed: the checks say why not
        return check()
    try:
        modules = module.__dict__["_modules"]
        state = [_state(module)]
        for name in children:  # by id: the entry must not keep a replaced child (or, through it, module) alive
            child = modules.get(name)
            state.append(None if child is None else (id(child), _state(child)))
        entry = _VERDICTS.get(module)
        if entry is None or entry[0] != state:
            entry = _VERDICTS[module] = (state, {})
    except (KeyError, TypeError):  # a module that skipped Module.__init__, or one that is not hashable
        return check()
    verdict = entry[1].get(key)
    if verdict is None:
        verdict = entry[1][key] = bool(check())
    return verdict


# ---- module predicates -------------------------------------------------------------------------------


def stock(module: Any, cls: type) -> bool:
    """``module`` is exactly ``cls`` and nothing observes or wraps its forward."""
    ok = (
        type(module) is cls
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__  # accelerate and diffusers hooks replace the bound forward
        and module.__dict__.get("_compiled_call_impl") is None  # nn.Module.compile(): calls go to compiled code
    )
    if not ok and observer is not None:  # the words only while watched
        _note(_why_not_stock(module, cls))
    return ok


def _why_not_stock(module: Any, cls: type) -> str:
    name = type(module).__name__
    if type(module) is not cls:
        relation = "a subclass of" if isinstance(module, cls) else "not"
        return f"a submodule is {name}, {relation} {cls.__name__}"
    if module._forward_hooks or module._forward_pre_hooks:
        return f"a {name} submodule has forward hooks"
    if "forward" in module.__dict__:
        return f"a {name} submodule's forward is replaced on the instance (accelerate or diffusers hooks)"
    return f"a {name} submodule is compiled (nn.Module.compile())"


def _torch_own(fn: Any, module_name: str) -> Any:
    """``fn`` where it is torch's own (defined in ``module_name``), else a sentinel no function is: a library that
    replaced it before torchpatches was imported makes :func:`linear` / :func:`dropout` call modules."""
    return fn if getattr(fn, "__module__", None) == module_name else _torch_own


#: The call path a stock layer's call runs (``Module.__call__`` -> ``_call_impl`` -> its class's ``forward``), as
#: torch defines it; :func:`linear` and :func:`dropout` stand in for it only while it is that.
_MODULE_CALL = _torch_own(torch.nn.Module.__call__, "torch.nn.modules.module")
_CALL_IMPL = _torch_own(torch.nn.Module._call_impl, "torch.nn.modules.module")
_LINEAR_FORWARD = _torch_own(torch.nn.Linear.forward, "torch.nn.modules.linear")
_DROPOUT_FORWARD = _torch_own(torch.nn.Dropout.forward, "torch.nn.modules.dropout")


def linear(module: Any, x: torch.Tensor) -> Any:
    """``module(x)``; for a stock ``nn.Linear`` (:func:`stock`, and torch's own call path and ``forward`` on the
    class) what its ``forward`` computes, ``F.linear(x, weight, bias)``, without ``nn.Module``'s call path and two
    ``__getattr__`` (about 5 us of host time a call on the CPU; a FLUX.1-dev step makes 466 linear calls). A LoRA
    layer, a hooked or compiled ``Linear``, a subclass, a weight or bias that is not in ``_parameters`` (deleted and
    set again as a plain attribute, or an instance attribute that shadows it, as ``forward``'s ``self.weight`` would
    read): the module call. The caller's target assumes :data:`LINEAR` (checked per call)."""
    cls = torch.nn.Linear  # the checks inline: a helper's call would cost what part of the bypass saves
    if (stock(module, cls) and cls.__call__ is _MODULE_CALL and cls._call_impl is _CALL_IMPL
            and cls.forward is _LINEAR_FORWARD):
        d = module.__dict__
        if "weight" not in d and "bias" not in d:
            try:
                params = d["_parameters"]  # exactly nn.Linear: weight and bias live there (bias=False: None)
                weight, bias = params["weight"], params["bias"]
            except KeyError:
                return module(x)
            return torch.nn.functional.linear(x, weight, bias)
    return module(x)


def dropout(module: Any, x: torch.Tensor) -> Any:
    """``module(x)``; ``x`` itself for a stock ``nn.Dropout`` in eval mode (what ``F.dropout(x, p, False)``
    returns: the same tensor), where the class's call path and ``forward`` are torch's own. In training mode, or for
    anything else, the module call. The caller's target assumes :data:`DROPOUT`."""
    cls = torch.nn.Dropout
    if (stock(module, cls) and module.__dict__.get("training") is False and cls.__call__ is _MODULE_CALL
            and cls._call_impl is _CALL_IMPL and cls.forward is _DROPOUT_FORWARD):
        return x
    return module(x)


def plain_layer_norm(norm: Any, width: int, cls: type = torch.nn.LayerNorm) -> bool:
    """A stock ``cls(width)`` without affine parameters, nothing hooked (``cls``: ``nn.LayerNorm``, or a
    model's own LayerNorm class such as diffusers' ``FP32LayerNorm`` where the op's rounding mode matches it)."""
    if not stock(norm, cls):
        return False
    params = norm._parameters  # exactly cls: weight and bias live there (one read instead of two __getattr__)
    ok = params.get("weight") is None and params.get("bias") is None and tuple(norm.normalized_shape) == (width,)
    if not ok and observer is not None:  # the words only while watched
        _note(f"a {cls.__name__} with affine parameters or of another width than {width}")
    return ok


def plain_rms_norm(norm: Any, x: torch.Tensor) -> bool:
    """A stock ``torch.nn.RMSNorm(head_dim)`` with a weight of x's dtype (torch's fused one-rounding path)."""
    if not stock(norm, torch.nn.RMSNorm):
        return False
    weight = norm._parameters.get("weight")  # exactly RMSNorm: its weight lives there
    ok = (
        norm.eps is not None
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and tuple(norm.normalized_shape) == (x.shape[-1],)
        and weight.shape == (x.shape[-1],)
        and weight.dtype == x.dtype
        and weight.device == x.device
    )
    if not ok and observer is not None:  # the words only while watched
        _note("an RMSNorm without eps, without a weight, or whose weight's width, dtype or device is not the input's")
    return ok


def tensors_fit(*tensors: Optional[torch.Tensor], dtype: torch.dtype, device: torch.device) -> bool:
    """Every tensor given is a plain ``torch.Tensor`` of ``dtype`` on ``device`` (None entries are skipped)."""
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or t.dtype != dtype or t.device != device:
            if observer is not None:  # the words only while watched
                _note(f"a {type(t).__name__} of {t.dtype} on {t.device} where the fused path needs {dtype} on {device}")
            return False
    return True


# ---- siblings ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _target_sites(name: str) -> Tuple[Tuple[str, str, str], ...]:
    """(module, owner qualname, attribute) of each target the named patch declares."""
    patch = importlib.import_module(f"{__package__}.{name}").PATCH
    sites = []
    for target in patch.targets:
        module_name, qualname = target.path.split(":", 1)
        owner, _, attribute = qualname.rpartition(".")
        sites.append((module_name, owner, attribute))
    return tuple(sites)


def pattern_on(name: str) -> bool:
    """True while the named fusion pattern is applied: one of its targets carries the registry's mark."""
    for module_name, owner, attribute in _target_sites(name):
        cls = getattr(sys.modules.get(module_name), owner, None)
        fn = vars(cls).get(attribute) if isinstance(cls, type) else None
        if getattr(fn, MARK_PATCH, None) == name:
            return True
    return False
