"""The ``lora_scale`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/lora_scale.py``."""
from __future__ import annotations

import abc
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

from ..._core.compat import is_compiling

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
