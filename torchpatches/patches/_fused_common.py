"""Checks shared by the eager fusion patches (adaln, qk_norm_rope, gate_residual, gelu_gemm, swiglu).

A fused path replaces some of diffusers' module calls and tensor ops with one kernel. It may only do
that where skipping those calls changes nothing a user can observe, so every replacement first asks:

- not compiling (Inductor fuses diffusers' own code; the patches step aside under torch.compile);
- the tensors are plain ``torch.Tensor`` (no DTensor or other subclass), one floating dtype, and on a
  device the fused tier serves (CUDA; on CPU only while a test forces a tier, see ``ops/_fused_tiers``);
- no gradient is wanted (the kernels have no backward);
- each module whose ``forward`` the fused path does *not* call is exactly the stock class with no
  hooks (``register_forward_hook``/``_pre_hook``, accelerate's and diffusers' hooks, which replace the
  instance's ``forward``, and global module hooks), so LoRA/PEFT wrappers, offloading hooks and layerwise
  casting keep running diffusers' own code.

``pattern_on(name)`` tells a replacement whether a sibling pattern is applied right now (e.g. the block
patch fuses the inline LayerNorm + modulate only while ``adaln`` is on), by looking at the sibling's own
target: a replaced function carries ``__torchpatches_pattern__``. No state lives here.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = [
    "FLOAT_DTYPES",
    "plain_module",
    "plain_layer_norm",
    "plain_rms_norm",
    "no_global_hooks",
    "device_served",
    "tensors_fit",
    "grad_free",
    "pattern_on",
    "make_method",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Where to look to see whether a pattern is applied: (module, class, attribute) of its targets.
_PROBES = {
    "adaln": (
        ("diffusers.models.normalization", "AdaLayerNormZero", "forward"),
        ("diffusers.models.normalization", "AdaLayerNormZeroSingle", "forward"),
        ("diffusers.models.normalization", "AdaLayerNormContinuous", "forward"),
    ),
    "swiglu": (("diffusers.models.transformers.transformer_flux2", "Flux2SwiGLU", "forward"),),
}


def pattern_on(name: str) -> bool:
    """True while the named fusion pattern is applied (at least one of its targets is replaced)."""
    for module_name, class_name, attribute in _PROBES[name]:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        fn = vars(cls).get(attribute) if cls is not None else None
        if getattr(fn, "__torchpatches_pattern__", None) == name:
            return True
    return False


def no_global_hooks() -> bool:
    """No module-global forward hooks (they would expect every module call to happen)."""
    m = torch.nn.modules.module
    return not (m._global_forward_hooks or m._global_forward_pre_hooks)


def plain_module(module: Any, cls: type) -> bool:
    """``module`` is exactly ``cls`` and nothing observes or wraps its forward."""
    return (
        type(module) is cls
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__  # accelerate and diffusers hooks replace the bound forward
    )


def plain_layer_norm(norm: Any, width: int) -> bool:
    """A stock ``nn.LayerNorm(width)`` without affine parameters, nothing hooked."""
    return (
        plain_module(norm, torch.nn.LayerNorm)
        and norm.weight is None
        and norm.bias is None
        and tuple(norm.normalized_shape) == (width,)
    )


def plain_rms_norm(norm: Any, x: torch.Tensor) -> bool:
    """A stock ``torch.nn.RMSNorm(head_dim)`` with a weight of x's dtype (torch's fused one-rounding path)."""
    return (
        plain_module(norm, torch.nn.RMSNorm)
        and norm.eps is not None
        and tuple(norm.normalized_shape) == (x.shape[-1],)
        and isinstance(norm.weight, torch.Tensor)
        and type(norm.weight) in (torch.Tensor, torch.nn.Parameter)
        and norm.weight.dtype == x.dtype
        and norm.weight.device == x.device
    )


def tensors_fit(*tensors: Optional[torch.Tensor], dtype: torch.dtype, device: torch.device) -> bool:
    """Every tensor given is a plain ``torch.Tensor`` of ``dtype`` on ``device`` (None entries are skipped)."""
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or t.dtype != dtype or t.device != device:
            return False
    return True


def device_served(x: torch.Tensor) -> bool:
    """The fused tiers serve this tensor: a plain float tensor on CUDA, or any device while a test forces a tier."""
    from ..ops._fused_tiers import forced_tier  # lazily: the ops register torch.library ops when imported

    return (
        type(x) is torch.Tensor
        and x.dtype in FLOAT_DTYPES
        and (x.device.type == "cuda" or forced_tier() is not None)
    )


def grad_free(modules: Iterable[torch.nn.Module], *tensors: Optional[torch.Tensor]) -> bool:
    """No autograd graph would be built: grad mode off, or no input and no parameter requires grad."""
    if not torch.is_grad_enabled():
        return True
    if any(t is not None and t.requires_grad for t in tensors):
        return False
    return not any(p.requires_grad for module in modules for p in module.parameters())


def make_method(original: Callable[..., Any], pattern: str, fused: Callable[..., Any]) -> Callable[..., Any]:
    """Finish a replacement: the original's name and docstring, markers for revert/probes, no ``__wrapped__``."""
    functools.update_wrapper(fused, original, assigned=("__name__", "__qualname__", "__doc__"), updated=())
    del fused.__wrapped__  # inspect.unwrap / fingerprint must see the replacement itself
    fused.__torchpatches_original__ = original  # type: ignore[attr-defined]
    fused.__torchpatches_pattern__ = pattern  # type: ignore[attr-defined]
    return fused
