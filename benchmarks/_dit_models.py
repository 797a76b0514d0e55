"""The diffusion transformers ``dit.py`` (and ``flux_cp.py``, ``flux_lora.py``) measure, from the model registry
(``torchpatches/_harness/registry.py``): each family's production config with the block subset run, and the inputs
its diffusers 0.42.1 pipeline passes its transformer (``torchpatches/_harness/production.py``). Batch 1 everywhere.
``python benchmarks/dit.py --list`` prints each model's shapes. Not a benchmark itself.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from harness import production, registry

__all__ = ["Spec", "SPECS", "flux_inputs", "layers_of", "with_layers", "tiny_config_name", "tiny_config"]

Randn = Callable[..., torch.Tensor]


class Spec:
    """One model: its diffusers class, production config (with the default layer subset), the config keys and
    module attributes of its block lists, the full model's layer counts, and its inputs builder. ``derive``: the
    config entries that follow the layer counts (HiDream's ``llama_layers``, one per block), applied to the default
    config and by :func:`with_layers`."""

    def __init__(self, cls_name: str, config: Dict[str, Any], layer_keys: Tuple[str, ...],
                 block_lists: Tuple[str, ...], full_layers: Tuple[int, ...],
                 inputs: Callable[[Dict[str, Any], Randn, torch.device, torch.dtype], Dict[str, Any]],
                 derive: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None) -> None:
        self.cls_name, self.config, self.layer_keys = cls_name, derive(config) if derive else config, layer_keys
        self.block_lists, self.full_layers, self.inputs, self.derive = block_lists, full_layers, inputs, derive
        self.about = ""  # the registry row's description (model, shapes, the block subset run)


def _spec(family: Any) -> Spec:
    row = family.production
    spec = Spec(family.cls, row.config, row.layer_keys, row.block_lists, row.full_layers, row.inputs, row.derive)
    spec.about = row.about
    return spec


flux_inputs = production.flux_inputs


#: The registry's families at production width (``torchpatches/_harness/registry.py``: each row's ``production``).
SPECS: Dict[str, Spec] = {name: _spec(family) for name, family in registry.FAMILIES.items()}


def layers_of(spec: Spec, config: Dict[str, Any]) -> Tuple[int, ...]:
    return tuple(int(config[key]) for key in spec.layer_keys)


def with_layers(spec: Spec, config: Dict[str, Any], layers: Tuple[int, ...]) -> Dict[str, Any]:
    """``config`` with the block counts ``layers`` (one per block list)."""
    if len(layers) != len(spec.layer_keys):
        raise ValueError(f"{spec.cls_name} has {len(spec.layer_keys)} block list(s), got layers {layers}")
    out = dict(config, **dict(zip(spec.layer_keys, layers)))
    return spec.derive(out) if spec.derive else out


def tiny_config_name(name: str) -> str:
    """The harness's tiny config for a model: ``<name>-fused`` where a fused pattern added one, else ``<name>``."""
    from harness import CONFIGS

    return f"{name}-fused" if f"{name}-fused" in CONFIGS else name


def tiny_config(name: str) -> Dict[str, Any]:
    """A copy of the harness's tiny config for a model (:func:`tiny_config_name`)."""
    from harness import CONFIGS

    return dict(CONFIGS[tiny_config_name(name)][1])
