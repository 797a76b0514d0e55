"""Which diffusers ``RMSNorm`` modules a fused op may compute in diffusers' place (``rounding="each"``).

diffusers' own ``normalization.RMSNorm`` (not ``torch.nn.RMSNorm``: ``_fused_common.plain_rms_norm``) rounds
``x * rstd`` to the weight's dtype before multiplying by the weight; the ops' "each" rounding is that, for a weight
of the activations' dtype and no bias, on its non-NPU path. Used by the SD3, QwenImage, Z-Image / Ideogram 4 and
HunyuanVideo 1.5 patterns. :func:`norms_fit` is the remembered check itself, with any predicate (FLUX's and
Kandinsky 6's ``torch.nn.RMSNorm``, FLUX.3's fp32 chain).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

import torch

from ._fused_common import declined, remembered, stock

__all__ = ["plain_diffusers_rms_norm", "diffusers_rms_norms_fit", "norms_fit"]

_NORMALIZATION = "diffusers.models.normalization"


def plain_diffusers_rms_norm(norm: Any, x: torch.Tensor) -> bool:
    """A stock diffusers ``RMSNorm(D)`` (D: x's last dim) with a plain weight of x's dtype and device, no bias, a
    number for eps, and diffusers not on its torch_npu path."""
    normalization = sys.modules[_NORMALIZATION]  # loaded with every module that builds these norms
    if not stock(norm, normalization.RMSNorm):
        return False
    d, params = norm.__dict__, norm._parameters
    weight = params.get("weight")
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.shape == x.shape[-1:]
            and tuple(d.get("dim", ())) == (x.shape[-1],) and weight.dtype == x.dtype and weight.device == x.device
            and params.get("bias") is None and d.get("bias") is None and type(d.get("eps")) in (int, float)
            and not normalization.is_torch_npu_available())


def norms_fit(module: Any, x: torch.Tensor, names: Tuple[str, ...], predicate: Callable[[Any, torch.Tensor], bool],
              reason: Optional[str] = None) -> bool:
    """``predicate(norm, x)`` holds for each submodule ``names`` of ``module``: decided once per module instance and
    x's dtype, device and width while they are the same objects in the same state (``remembered``: one predicate per
    module and ``names``, the verdict's key holds none); ``reason`` told to the observer where it does not."""
    def check() -> bool:
        modules = module._modules
        return all(predicate(modules.get(name), x) for name in names)

    if remembered(module, (x.dtype, x.device, x.shape[-1]), check, names):
        return True
    if reason is not None:
        declined(reason)
    return False


def diffusers_rms_norms_fit(module: Any, x: torch.Tensor, names: Tuple[str, ...]) -> bool:
    """The submodules ``names`` of ``module`` are :func:`plain_diffusers_rms_norm` for x (:func:`norms_fit`)."""
    return norms_fit(module, x, names, plain_diffusers_rms_norm,
                     "a norm is not a stock diffusers RMSNorm with a weight of the input's dtype and no bias")
