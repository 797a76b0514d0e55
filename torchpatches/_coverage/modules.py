"""The model's side of the coverage report: names of its modules and attention processors, and which of its classes
a fusion pattern targets (applied or not) and which none does."""
from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, Iterator, List, Tuple

import torch

from ..patches import PATCH_MODULES

#: Where a class comes from for it to be worth listing as not targeted: the model libraries' own classes (torch's
#: building blocks, Linear, LayerNorm..., are reached through the classes that use them).
LISTED_LIBRARIES = ("diffusers.", "peft.", "transformers.")


def _objects(model: torch.nn.Module) -> Iterator[Tuple[str, Any]]:
    """(name, object) for every submodule of ``model`` and every attention processor it holds
    (``<module>.processor``)."""
    for name, module in model.named_modules():
        yield name or type(model).__name__, module
        processor = module.__dict__.get("processor")
        if processor is not None and not isinstance(processor, torch.nn.Module):
            yield f"{name}.processor" if name else "processor", processor


def named_objects(model: torch.nn.Module) -> Dict[int, str]:
    """id -> name for every submodule and attention processor of ``model``."""
    names: Dict[int, str] = {}
    for name, obj in _objects(model):
        names.setdefault(id(obj), name)
    return names


def objects_by_class(model: torch.nn.Module) -> Dict[type, int]:
    """Each class of the model's submodules and attention processors, and how many instances it has."""
    counts: Dict[type, int] = {}
    for _, obj in _objects(model):
        counts[type(obj)] = counts.get(type(obj), 0) + 1
    return counts


def fusion_targets() -> Dict[Tuple[str, str], str]:
    """(module, class qualname) -> the fusion pattern that targets a method of that class, for every patch made by
    ``_fused_common.fused`` (whatever its state: applied, disabled, skipped)."""
    targets: Dict[Tuple[str, str], str] = {}
    for patch_module in PATCH_MODULES:
        module = sys.modules.get(f"torchpatches.patches.{patch_module}")
        patch = getattr(module, "PATCH", None)
        for target in _declared_targets(patch):
            pattern = getattr(target.make_replacement, "__torchpatches_fused__", None)
            if pattern is None:
                continue
            module_name, qualname = target.path.split(":", 1)
            owner = qualname.rpartition(".")[0]
            if owner:
                targets[(module_name, owner)] = pattern
    return targets


def _declared_targets(patch: Any) -> Iterable[Any]:
    targets = getattr(patch, "targets", ())
    return targets if isinstance(targets, tuple) else ()  # a lazily built table is not a fusion pattern's


def targeting(cls: type, targets: Dict[Tuple[str, str], str]) -> List[str]:
    """The patterns that target ``cls`` or a class it inherits the targeted method from."""
    found = []
    for base in cls.__mro__:
        pattern = targets.get((base.__module__, base.__qualname__))
        if pattern is not None and pattern not in found:
            found.append(pattern)
    return found


def untargeted(classes: Dict[type, int], targets: Dict[Tuple[str, str], str]) -> List[Tuple[str, int]]:
    """(class name, instances) of the model libraries' classes in the model that no fusion pattern targets."""
    rows = [(cls.__qualname__, count) for cls, count in classes.items()
            if cls.__module__.startswith(LISTED_LIBRARIES) and not targeting(cls, targets)]
    return sorted(rows, key=lambda row: (-row[1], row[0]))

