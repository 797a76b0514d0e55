"""torchpatches' fused ops: what the patches call, public for your own code.

Every op picks a tier per call -- a Triton kernel on CUDA where one exists, else PyTorch (RoPE also FlashInfer) --
and either computes the right answer for the layout it is given or refuses it with a ``ValueError``. ``tier=`` on a
call, or :func:`force_tier` for a block, picks one by hand.

    from torchpatches.ops import qk_norm_rope, force_tier

Importing this package imports no op: each loads on first use, so ``import torchpatches`` stays cheap.

- RoPE: :func:`apply_rope_qk`, :func:`apply_rope_qk_inplace`, :func:`apply_rope_qk_with_cache`,
  :func:`apply_rope_qk_with_cache_inplace`, :func:`describe_tiers`, :func:`last_tier`; FLUX's tables:
  :func:`rope_tables`;
- norms with RoPE: :func:`qk_norm_rope` (per-head RMSNorm + interleaved RoPE + text/image concat),
  :func:`rms_norm_rope` (RMSNorm across heads + Wan's RoPE);
- modulation: :func:`layer_norm_modulate`, :func:`gate_residual`, :func:`gate_residual_layer_norm`,
  :func:`gate_residual_layer_norm_modulate`, :func:`residual_layer_norm_modulate`; with Krea 2's zero-centered
  RMSNorm: :func:`rms_norm_modulate`, :func:`gate_residual_rms_norm_modulate`; with diffusers' RMSNorm:
  :func:`rms_norm_scale`, :func:`gate_rms_norm_residual`, :func:`gate_rms_norm_residual_scale`;
- activations: :func:`swiglu` (one input, or gate and up; the sigmoid GLU), :func:`linear_gelu_tanh`,
  :func:`gelu_tanh_into`, :func:`copy_into`;
- :func:`lora_linear` (a linear layer with LoRA adapters in its GEMM's epilogue), :func:`lse_merge` (two partial
  attention results by their log-sum-exps);
- :data:`TIERS`, :func:`force_tier`.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, List

#: public name -> the private module that defines it
_PUBLIC: Dict[str, str] = {
    **dict.fromkeys(("apply_rope_qk", "apply_rope_qk_inplace", "apply_rope_qk_with_cache",
                     "apply_rope_qk_with_cache_inplace", "describe_tiers", "last_tier"), "_rope"),
    "rope_tables": "_rope_tables",
    "qk_norm_rope": "_qk_norm_rope",
    "rms_norm_rope": "_rms_norm_rope",
    **dict.fromkeys(("layer_norm_modulate", "gate_residual", "gate_residual_layer_norm",
                     "gate_residual_layer_norm_modulate", "residual_layer_norm_modulate", "rms_norm_modulate",
                     "gate_residual_rms_norm_modulate"), "_modulate"),
    **dict.fromkeys(("rms_norm_scale", "gate_rms_norm_residual", "gate_rms_norm_residual_scale"), "_rms_modulate"),
    "swiglu": "_swiglu",
    "linear_gelu_tanh": "_linear_gelu",
    **dict.fromkeys(("gelu_tanh_into", "copy_into"), "_slices"),
    **dict.fromkeys(("lora_linear", "Adapter"), "_lora"),
    "lse_merge": "_lse_merge",
    **dict.fromkeys(("TIERS", "force_tier"), "_runtime.tiers"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_PUBLIC))
