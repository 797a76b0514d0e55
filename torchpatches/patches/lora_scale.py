"""lora_scale: diffusers' ``scale_lora_layers`` / ``unscale_lora_layers`` without the generator walk (eager host time).

What goes wrong upstream
    A forward decorated with ``@apply_lora_scale`` (FLUX.1, FLUX.2, SD3, QwenImage, Wan and 35 more in diffusers
    0.42.1) that is given a LoRA ``scale`` other than 1 in its attention kwargs -- how a LoRA is weighted:
    ``pipe(..., joint_attention_kwargs={"scale": 0.8})`` -- calls ``scale_lora_layers(self, scale)`` before the
    forward and ``unscale_lora_layers(self, scale)`` after it, on every step. Each walks ``model.modules()``:
    generators nested one per tree level, and an ABC ``isinstance`` per module. FLUX.1 with adapters on its 17
    projection kinds has 6,229 modules (most of them inside the LoRA layers); docs/lora.md ("``lora_scale``")
    has the host time of the two walks per step, beside the fused step they delay. No upstream issue as of
    diffusers 0.42.1.

What the patch changes
    The same walk without generators: the modules in ``modules()``' order (pre-order, each module once by the
    memo set ``named_modules`` keeps, ``None`` children skipped), ``isinstance(module, BaseTunerLayer)`` decided
    once per class (and again after any ``ABC.register``); then, in that order, each tuner layer's own
    ``scale_layer`` / ``unscale_layer`` / ``set_scale``, called as diffusers calls them. Every value and every call
    is diffusers'; only the walk's host time changes. The original runs instead under torch.compile (Dynamo
    traces diffusers' walk), when a module of the tree overrides ``modules`` or ``named_modules`` (class or
    instance), when a module's class changes how it is tested as an instance (``__class__``), and when the walk
    raises (the original then raises its own error). One difference by design: the layers are collected before
    the first one is scaled, so a ``scale_layer`` that adds modules to the tree mid-walk is not followed (peft's
    do not touch the tree).

Versions
    diffusers 0.35 - 0.42: both functions fingerprinted with tools/fingerprint_diffusers.py in 0.35.0, 0.35.2,
    0.36.0, 0.37.0, 0.38.0, 0.39.0, 0.40.0, 0.41.0, 0.42.0 and 0.42.1 (installed, tested);
    ``unscale_lora_layers`` has two sources, differing in one type hint. With peft installed (the functions import
    it; without peft the decorator never calls them). Any torch.

When to delete
    When diffusers scales LoRA layers without walking the whole module tree per forward (a list of tuner layers
    kept by the loader, or a scale passed down instead of written into every layer).
"""
from __future__ import annotations

import abc
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

from .._core.compat import is_compiling
from .._core.declare import Patch, Target

__all__ = ["PATCH", "tuner_layers"]

_MODULE = "diffusers.utils.peft_utils"
#: Modules that bind the functions by name and call them per forward (``diffusers.utils`` re-exports them:
#: ``from diffusers.utils import scale_lora_layers``).
_SCALE_ALIASES = (
    "diffusers.utils:scale_lora_layers",
    "diffusers.models.transformers.transformer_motif_video:scale_lora_layers",
    "diffusers.models.transformers.transformer_nucleusmoe_image:scale_lora_layers",
)
_UNSCALE_ALIASES = tuple(alias.replace(":scale_", ":unscale_") for alias in _SCALE_ALIASES)

_MODULE_WALK = (torch.nn.Module.modules, torch.nn.Module.named_modules)
# What a walk does with a class's instances: skip them (None children), refuse (an own walk), or visit them.
_SKIP, _REFUSE, _OTHER, _LAYER = range(4)
#: (layer class, abc cache token) -> {class: is a subclass of the layer class}; weak, so that classes made at run
#: time are not kept alive by it (a walk looks it up once per class).
_IS_LAYER: Dict[tuple, "weakref.WeakKeyDictionary[type, bool]"] = {}


def _kind(cls: type, layer_class: type, is_layer: Any) -> int:
    """Read again in every walk: a class's ``modules`` / ``named_modules`` may be replaced between two walks."""
    if cls.modules is not _MODULE_WALK[0] or cls.named_modules is not _MODULE_WALK[1]:
        return _REFUSE
    layer = is_layer.get(cls)
    if layer is None:
        layer = is_layer[cls] = issubclass(cls, layer_class)
    return _LAYER if layer else _OTHER


def tuner_layers(model: Any, layer_class: type) -> Optional[List[Any]]:
    """The modules of ``model.modules()`` that are instances of ``layer_class``, in that order; None where
    ``modules()`` could answer otherwise than ``nn.Module``'s walk (an override, an instance attribute, a module
    whose ``__class__`` is not its type) or the walk raises: then only the original can say what happens."""
    if not isinstance(model, torch.nn.Module):
        return None
    key = (layer_class, abc.get_cache_token())
    is_layer = _IS_LAYER.get(key)
    if is_layer is None:
        _IS_LAYER.clear()  # an ABC.register anywhere, or another peft class: decide every class again
        is_layer = _IS_LAYER[key] = weakref.WeakKeyDictionary()
    kinds: Dict[type, int] = {type(None): _SKIP}  # this walk's (named_modules skips None children)
    found: List[Any] = []
    memo: set = set()  # named_modules' memo: a module reached twice is visited once
    stack = [model]
    pop, push, seen, see, kind_of = stack.pop, stack.extend, memo.__contains__, memo.add, kinds.get
    try:
        while stack:  # pre-order: children pushed in reverse, so they pop in named_modules' order
            module = pop()
            if seen(module):
                continue
            see(module)
            cls = type(module)
            kind = kind_of(cls)
            if kind is None:
                kind = kinds[cls] = _kind(cls, layer_class, is_layer)
            if kind == _SKIP:
                continue
            instance = module.__dict__
            if kind == _REFUSE or module.__class__ is not cls or "modules" in instance or "named_modules" in instance:
                return None
            if kind == _LAYER:
                found.append(module)
            children = instance["_modules"]
            if children:
                push(reversed(children.values()))
    except Exception:  # noqa: BLE001 - a module without _modules, an unhashable one: diffusers' walk decides
        return None
    return found


def _layer_class() -> type:
    from peft.tuners.tuners_utils import BaseTunerLayer  # as diffusers: imported per call, before anything else

    return BaseTunerLayer


def _scale_replacement(original: Callable[..., None]) -> Callable[..., None]:
    def scale_lora_layers(model, weight):
        layer_class = _layer_class()
        if weight == 1.0:
            return
        layers = None if is_compiling() else tuner_layers(model, layer_class)
        if layers is None:
            return original(model, weight)
        for module in layers:
            module.scale_layer(weight)

    return _named_like(scale_lora_layers, original)


def _unscale_replacement(original: Callable[..., None]) -> Callable[..., None]:
    def unscale_lora_layers(model, weight=None):
        layer_class = _layer_class()
        if weight is None or weight == 1.0:
            return
        layers = None if is_compiling() else tuner_layers(model, layer_class)
        if layers is None:
            return original(model, weight)
        for module in layers:
            if weight != 0:
                module.unscale_layer(weight)
            else:
                for adapter_name in module.active_adapters:
                    module.set_scale(adapter_name, 1.0)  # diffusers: weight 0 resets each scale to its initial value

    return _named_like(unscale_lora_layers, original)


def _named_like(replacement: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    replacement.__qualname__, replacement.__doc__ = original.__qualname__, original.__doc__
    replacement.__module__ = original.__module__
    return replacement


PATCH = Patch(
    name="lora_scale",
    summary="diffusers scale_lora_layers / unscale_lora_layers (a LoRA scale per forward) without the generator walk",
    targets=(
        Target(f"{_MODULE}:scale_lora_layers", make_replacement=_scale_replacement,
               fingerprints=frozenset({"fc53e9824dec8d29"}),  # diffusers 0.35.0 - 0.42.1
               aliases=_SCALE_ALIASES),
        Target(f"{_MODULE}:unscale_lora_layers", make_replacement=_unscale_replacement,
               fingerprints=frozenset({
                   "1d40701326d52a00",  # diffusers 0.37.0 - 0.42.1
                   "7019e0c8dfa78317",  # diffusers 0.35.0 - 0.36.0 (``Optional[float]`` for ``float | None``)
               }),
               aliases=_UNSCALE_ALIASES),
    ),
    requires={"diffusers": ">=0.35,<0.43", "peft": ">=0.17"},
)
