"""Which peft LoRA layers the ``lora`` pattern serves, and the calls ``lora`` and ``gelu_gemm`` make for them.

A peft ``lora.Linear`` is served when its forward would take peft's stock branch with every skipped module
call a no-op to skip: exactly peft's ``Linear`` (no subclass), adapters enabled and not merged, no
``fan_in_fan_out``, a stock ``nn.Linear`` base layer, and for every active adapter of this layer: plain LoRA
(no ``lora_variant``: DoRA, aLoRA, arrow...; no ``lora_bias``), stock bias-free ``nn.Linear`` A and B, a
dropout that is ``nn.Identity`` or an ``nn.Dropout`` in eval mode, weights of ``x``'s dtype and device (so
peft's input cast is a no-op), a scaling that is a number or a 0-d tensor. The per-call conditions every
fused path has (:func:`~._fused_common.fusable`: CUDA, or a forced tier on the CPU; no autocast; no grad
wanted through ``x`` or any parameter of the layer) come first. Anything else: ``FALLBACK`` (peft's code).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from .._core.lazy import lazy_module
from ._fused_common import FALLBACK, fusable, pattern_on, stock

__all__ = ["LAYER", "lora_linear", "lora_gelu"]

#: peft's LoRA layer module (the ``lora`` pattern's target lives there).
LAYER = "peft.tuners.lora.layer"

_PARAMETER_TYPES = (torch.nn.Parameter, torch.Tensor)


def _fits(t: Any, dtype: torch.dtype, device: torch.device) -> bool:
    return type(t) in _PARAMETER_TYPES and t.dtype == dtype and t.device == device


def _identity_dropout(dropout: Any) -> bool:
    """peft's dropout is the identity: ``nn.Identity``, or ``nn.Dropout`` outside training (any ``p``)."""
    if stock(dropout, torch.nn.Identity):
        return True
    return stock(dropout, torch.nn.Dropout) and not dropout.training


def _plain_scaling(scaling: Any, x: torch.Tensor) -> bool:
    """A number, or a 0-d float tensor on the CPU or on ``x``'s device (peft's hotswap preparation)."""
    if type(scaling) in (int, float):
        return True
    return (
        type(scaling) is torch.Tensor
        and scaling.dim() == 0
        and scaling.dtype.is_floating_point
        and not scaling.requires_grad
        and (scaling.device.type == "cpu" or scaling.device == x.device)
    )


def _stock_adapter(layer: Any, modules: dict, name: str, x: torch.Tensor) -> Optional[tuple]:
    """(A, B, scaling) of adapter ``name``, or None. ``modules`` is ``layer._modules``: the ModuleDicts and
    the parameters are read from their dicts (``Module.__getattr__`` costs a microsecond a lookup, per layer
    and step)."""
    if name in layer.lora_variant or layer.lora_bias.get(name, False):
        return None
    a, b = modules["lora_A"]._modules[name], modules["lora_B"]._modules[name]
    if not (stock(a, torch.nn.Linear) and stock(b, torch.nn.Linear)):
        return None
    a_params, b_params = a._parameters, b._parameters
    if a_params.get("bias") is not None or b_params.get("bias") is not None:
        return None
    wa, wb = a_params["weight"], b_params["weight"]
    dtype, device = x.dtype, x.device
    dropout = modules["lora_dropout"]._modules[name]
    if not (_fits(wa, dtype, device) and _fits(wb, dtype, device) and _identity_dropout(dropout)):
        return None
    scaling = layer.scaling[name]
    return (wa, wb, scaling) if _plain_scaling(scaling, x) else None


def _weights_if_served(layer: Any, x: Any) -> Optional[tuple]:
    """(base weight, base bias, active adapters as ``(A, B, scaling)`` in peft's order), or None: peft's code runs."""
    peft_layer = sys.modules.get(LAYER)
    if peft_layer is None or type(layer) is not peft_layer.Linear:
        return None
    if layer.disable_adapters or layer.merged or layer.fan_in_fan_out or not fusable(x, (layer,)):
        return None
    modules = layer._modules
    base = modules["base_layer"]
    if not stock(base, torch.nn.Linear):
        return None
    params = base._parameters
    weight, bias = params["weight"], params.get("bias")
    dtype, device = x.dtype, x.device
    if not (_fits(weight, dtype, device) and (bias is None or _fits(bias, dtype, device))
            and x.dim() >= 1 and x.shape[-1] == weight.shape[1]):
        return None
    adapters = []
    lora_a = modules["lora_A"]._modules
    for name in layer.active_adapters:
        if name not in lora_a:  # as peft: an active adapter this layer does not have
            continue
        adapter = _stock_adapter(layer, modules, name, x)
        if adapter is None:
            return None
        adapters.append(adapter)
    return weight, bias, adapters


#: ``torchpatches.ops.lora``, imported with the first served call.
_lora_ops = lazy_module("torchpatches.ops._lora")


# Both calls take ops.lora's epilogue tier without its checks: _weights_if_served has checked every tensor (plain,
# of x's dtype and device, no gradient wanted: fusable covers x and every parameter of the layer, _plain_scaling
# the scalings), and the fused method has stepped aside for tracing and transforms (host time: ~500 LoRA layers
# per FLUX.1 step).


def lora_linear(layer: Any, x: Any) -> Any:
    """peft's ``Linear.forward(x)`` through the GEMM-epilogue op, or ``FALLBACK``."""
    served = _weights_if_served(layer, x)
    if served is None:
        return FALLBACK
    weight, bias, adapters = served
    return _lora_ops().prechecked(x, weight, bias, adapters)


def lora_gelu(proj: Any, x: Any) -> Any:
    """``gelu(proj(x), approximate="tanh")`` for a LoRA-wrapped projection of diffusers' ``GELU`` (``gelu_gemm``),
    the GELU in the last adapter's GEMM epilogue; ``FALLBACK`` unless ``lora`` is applied and serves ``proj``
    with nothing hooked on it (the fused path skips its module call)."""
    peft_layer = sys.modules.get(LAYER)
    if peft_layer is None or not stock(proj, peft_layer.Linear) or not pattern_on("lora"):
        return FALLBACK
    served = _weights_if_served(proj, x)
    if served is None:
        return FALLBACK
    weight, bias, adapters = served
    return _lora_ops().prechecked(x, weight, bias, adapters, gelu=True)
