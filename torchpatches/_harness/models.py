"""Tiny diffusers models by name (:data:`CONFIGS`, :func:`build_model`) and their inputs (:func:`tiny_inputs`).

The model registry's families (``registry.FAMILIES``, each ``<name>`` and, where a pattern fuses it,
``<name>-fused``), variants of them, HunyuanVideo, ``FeedForward`` and the models whose warning sites
``compile_warnings`` covers. A pinned
number in a test (kernels, graph breaks) belongs to a named config: change a config and the numbers measured on
it change meaning, so add a config instead. Random weights,
no download; diffusers is imported when a model is built.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple, Union

import torch

from .families import flux_like_inputs
from .registry import FAMILIES

__all__ = ["CONFIGS", "build_model", "tiny_inputs"]

Device = Union[str, torch.device]


def _family_configs() -> Dict[str, Tuple[str, Dict[str, Any]]]:
    """Each registry family's tiny config as ``<name>``, and as ``<name>-fused`` where a pattern fuses it."""
    out: Dict[str, Tuple[str, Dict[str, Any]]] = {}
    for name, family in FAMILIES.items():
        out[name] = (family.cls, dict(family.tiny))
        fused = family.fused_config()
        if fused is not None:
            out[f"{name}-fused"] = (family.cls, fused)
    return out


_FAMILY_CONFIGS = _family_configs()

#: name -> (diffusers class, constructor arguments). Random weights, no download. The registry's families
#: (``registry.FAMILIES``: ``<name>`` and ``<name>-fused``), then variants and the models only compile_warnings and
#: the doctor run.
CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    **_FAMILY_CONFIGS,
    # FLUX.1-dev at production width (11.9 B parameters; benchmarks/lora_scale.py walks it on the CPU).
    "flux1-dev": ("FluxTransformer2DModel", dict(FAMILIES["flux1"].production.config)),
    # SD3.5-medium-style MMDiT-X: block 0 with dual attention (SD35AdaLayerNormZeroX, attn2). Pinned on it: the sd3
    # fused patterns' call counts (tests/patches/test_fused_sd3.py).
    "sd3-dual": ("SD3Transformer2DModel", dict(_FAMILY_CONFIGS["sd3-fused"][1], dual_attention_layers=(0,))),
    # wan-fused with Wan2.1 I2V's image context (added_kv_proj_dim, image embedder): 8 text + 4 image tokens.
    "wan-fused-i2v": ("WanTransformer3DModel", dict(_FAMILY_CONFIGS["wan-fused"][1], image_dim=16,
                                                    added_kv_proj_dim=32)),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
    )),
    "feedforward": ("FeedForward", dict(dim=16, mult=2, activation_fn="gelu-approximate")),
    # Models whose warning sites compile_warnings covers (from its scan of all of diffusers): one
    # per kind of site, measured before/after in tests/patches/test_compile_warnings.py.
    "ovis": ("OvisImageTransformer2DModel", dict(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8),
    )),
    "auraflow": ("AuraFlowTransformer2DModel", dict(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
        out_channels=4, pos_embed_max_size=16,
    )),
    # PixArt-style Transformer2DModel: BasicTransformerBlock + Attention (attention_processor) + AttnProcessor2_0.
    "pixart": ("Transformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
        cross_attention_dim=16, sample_size=8, patch_size=2, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
        caption_channels=32, use_additional_conditions=False,
    )),
    "dreamlite": ("DreamLiteTransformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=16, out_channels=16, num_layers=1,
        norm_num_groups=4, cross_attention_dim=16,
    )),
}  # fmt: skip


def build_model(name: str, *, dtype: torch.dtype = torch.float32, device: Device = "cpu") -> torch.nn.Module:
    """The model of ``CONFIGS[name]`` with seeded random weights, created on ``device`` in ``dtype``
    directly (casting afterwards makes diffusers warn, and a large model would pass through the host)."""
    import diffusers
    from diffusers.models.attention import FeedForward

    class_name, config = CONFIGS[name]
    cls = FeedForward if class_name == "FeedForward" else getattr(diffusers, class_name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = cls(**config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def tiny_inputs(
    name: str, *, dtype: torch.dtype = torch.float32, device: Device = "cpu", **options: Any
) -> Dict[str, Any]:
    """Keyword arguments for a forward of ``build_model(name)``, seeded, with ``return_dict=False``.

    Options (each model takes those that apply to it): ``attention_kwargs`` (passed as
    ``joint_attention_kwargs`` or ``attention_kwargs``, as the model names it); for FLUX.1/FLUX.2
    ``side`` (the latent grid is side x side tokens, 4), ``text_tokens`` (8); for FLUX.1 ``ids_3d``
    (the deprecated ``[1, S, 3]`` ids); for Wan ``side`` (2 latent frames of side x side, 8); for
    ``feedforward`` any extra call argument (``scale=0.5``); for Chroma ``text_padding`` (its pipeline's
    ``attention_mask``); for QwenImage 2.1 ``kv_cache_mode`` ("cached", or "extract": the first step).
    """
    generator = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    config = CONFIGS[name][1]
    family = FAMILIES.get(name[:-len("-fused")] if name.endswith("-fused") else name)
    if family is None:
        family = next((FAMILIES[base] for base in FAMILIES if name.startswith(f"{base}-")), None)
    if family is not None:
        builder, keyword = family.inputs, family.attention_kwargs
        if name.endswith("-fused"):
            options = {**family.fused_options, **options}
    else:
        builder, keyword = _INPUTS[name], _ATTENTION_KWARGS.get(name, "attention_kwargs")
    attention_kwargs = options.pop("attention_kwargs", None)
    kwargs = builder(config, randn, torch.device(device), dtype, **options)
    if attention_kwargs is not None:
        kwargs[keyword] = dict(attention_kwargs)
    return kwargs


def _feedforward_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                        dtype: torch.dtype, **call_kwargs: Any) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, config["dim"]), **call_kwargs)


def _hunyuanvideo_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                         dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 1, 4, 4), timestep=torch.tensor([500], device=device),
                encoder_hidden_states=randn(1, 6, 16), encoder_attention_mask=torch.ones(1, 6, device=device),
                pooled_projections=randn(1, 8), guidance=torch.tensor([3500.0], device=device), return_dict=False)


def _auraflow_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                     dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 8, 8), encoder_hidden_states=randn(1, 8, 32),
                timestep=torch.tensor([500], device=device), return_dict=False)


def _pixart_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                   dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 8, 8), encoder_hidden_states=randn(1, 8, 32),
                timestep=torch.tensor([500], device=device), added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                return_dict=False)


def _dreamlite_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                      dtype: torch.dtype, return_dict: bool = True) -> Dict[str, Any]:
    """``return_dict=True`` is DreamLite's default: its forward then builds the deprecated
    ``transformer_2d.Transformer2DModelOutput``, whose ``__init__`` calls ``deprecate``."""
    return dict(hidden_states=randn(1, 16, 4, 4), encoder_hidden_states=randn(1, 8, 16), return_dict=return_dict)


#: The inputs of the models outside the registry.
_INPUTS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "hunyuanvideo": _hunyuanvideo_inputs, "feedforward": _feedforward_inputs, "ovis": flux_like_inputs,
    "auraflow": _auraflow_inputs, "pixart": _pixart_inputs, "dreamlite": _dreamlite_inputs,
}
_ATTENTION_KWARGS = {"ovis": "joint_attention_kwargs", "pixart": "cross_attention_kwargs"}
