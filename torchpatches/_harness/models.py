"""Tiny diffusers models by name (:data:`CONFIGS`, :func:`build_model`) and their inputs (:func:`tiny_inputs`).

FLUX.1, FLUX.2, SD3, QwenImage, Wan, HunyuanVideo, ``FeedForward``, the models whose warning sites
``compile_warnings`` covers, and (from ``families``) the families torchpatches fuses nothing in yet. A pinned
number in a test (kernels, graph breaks) belongs to a named config: change a config and the numbers measured on
it change meaning, so add a config instead. Random weights,
no download; diffusers is imported when a model is built.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Tuple, Union

import torch

from .families import FAMILY_CONFIGS, FAMILY_INPUTS

__all__ = ["CONFIGS", "build_model", "tiny_inputs"]

Device = Union[str, torch.device]


#: Shared by a tiny config and its variants below (each variant: the base with what differs).
_FLUX1 = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
              axes_dims_rope=(4, 4, 8))
_FLUX2 = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
              axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
_SD3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
            pos_embed_max_size=8)
_QWENIMAGE = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
_WAN_FUSED = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                  text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)

#: name -> (diffusers class, constructor arguments). Random weights, no download.
CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    # 1 double + 1 single block. Pinned on it: compile_warnings' graph breaks, inductor_realize's
    # flux_tiny counts (18 kernels, 84 nests, 45 buffers, 619,316 bytes on torch 2.11).
    "flux1": ("FluxTransformer2DModel", _FLUX1),
    # FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128 (11.9 B parameters; benchmarks/flux.py).
    "flux1-dev": ("FluxTransformer2DModel", dict(
        _FLUX1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))),
    "flux2": ("Flux2Transformer2DModel", _FLUX2),
    # 1 double + 2 single blocks, so a single block also gets its inputs as two slices of one tensor
    # (the eager fusion patches' zero-copy concat). Pinned on them: the fused-op call counts and the
    # tiny compile kernel counts of tests/patches/test_fused_patches.py.
    "flux1-fused": ("FluxTransformer2DModel", dict(_FLUX1, in_channels=16, num_single_layers=2,
                                                   pooled_projection_dim=16, guidance_embeds=True,
                                                   axes_dims_rope=(4, 6, 6))),
    "flux2-fused": ("Flux2Transformer2DModel", dict(_FLUX2, in_channels=16, num_single_layers=2,
                                                    timestep_guidance_channels=16, mlp_ratio=3.0,
                                                    guidance_embeds=True)),
    "sd3": ("SD3Transformer2DModel", _SD3),
    # SD3.5-style (qk_norm="rms_norm"): 2 blocks, the last context_pre_only (AdaLayerNormContinuous, no
    # to_add_out). Pinned on it: the sd3 fused patterns' call counts (tests/patches/test_fused_sd3.py).
    "sd3-fused": ("SD3Transformer2DModel", dict(_SD3, num_layers=2, qk_norm="rms_norm")),
    # SD3.5-medium-style MMDiT-X: block 0 with dual attention (SD35AdaLayerNormZeroX, attn2).
    "sd3-dual": ("SD3Transformer2DModel", dict(_SD3, num_layers=2, qk_norm="rms_norm", dual_attention_layers=(0,))),
    "qwenimage": ("QwenImageTransformer2DModel", _QWENIMAGE),
    # 2 double-stream blocks (the second gets the first's outputs), head dim 16, inputs with a padded
    # text mask. Pinned on it: the qwenimage_* fused-op call counts and tiny compile kernel counts
    # (tests/patches/test_fused_qwenimage.py).
    "qwenimage-fused": ("QwenImageTransformer2DModel", dict(_QWENIMAGE, num_layers=2)),
    "wan": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )),
    # Wan2.1 T2V's block options (q/k RMSNorm across heads, affine cross-attention norm), 2 blocks, 4 heads x 8;
    # 2 x 4 x 4 latent patches = 32 tokens, 8 text tokens. Pinned on it: the Wan fused-op call counts and tiny
    # compile kernel counts of tests/patches/test_fused_wan.py.
    "wan-fused": ("WanTransformer3DModel", _WAN_FUSED),
    # wan-fused with Wan2.1 I2V's image context (added_kv_proj_dim, image embedder): 8 text + 4 image tokens.
    "wan-fused-i2v": ("WanTransformer3DModel", dict(_WAN_FUSED, image_dim=16, added_kv_proj_dim=32)),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
    )),
    "feedforward": ("FeedForward", dict(dim=16, mult=2, activation_fn="gelu-approximate")),
    # Models whose warning sites compile_warnings covers (from its scan of all of diffusers): one
    # per kind of site, measured before/after in tests/patches/test_compile_warnings.py.
    "chroma": ("ChromaTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8), approximator_num_channels=8,
        approximator_hidden_dim=32, approximator_layers=1,
    )),
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
    **FAMILY_CONFIGS,
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
    builder = _INPUTS.get(name) or _INPUTS[name.split("-")[0]]
    attention_kwargs = options.pop("attention_kwargs", None)
    kwargs = builder(config, randn, torch.device(device), dtype, **options)
    if attention_kwargs is not None:
        kwargs[_ATTENTION_KWARGS.get(name.split("-")[0], "attention_kwargs")] = dict(attention_kwargs)
    return kwargs


def _flux1_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                  dtype: torch.dtype, ids_3d: bool = False, side: int = 4, text_tokens: int = 8) -> Dict[str, Any]:
    """As FluxPipeline passes them: packed latents, ids ``[S, 3]`` of the latent grid, timestep in [0, 1]."""
    rows = torch.arange(float(side))
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), rows, rows, indexing="ij"), -1).reshape(-1, 3).to(device)
    txt_ids = torch.zeros(text_tokens, 3, device=device)
    kwargs = dict(
        hidden_states=randn(1, side * side, config["in_channels"]),
        encoder_hidden_states=randn(1, text_tokens, config["joint_attention_dim"]),
        pooled_projections=randn(1, config["pooled_projection_dim"]),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=img_ids[None] if ids_3d else img_ids,
        txt_ids=txt_ids[None] if ids_3d else txt_ids,
        return_dict=False,
    )
    if config["guidance_embeds"]:
        kwargs["guidance"] = torch.tensor([3.5], device=device)
    return kwargs


def _flux2_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                  dtype: torch.dtype, side: int = 4, text_tokens: int = 8) -> Dict[str, Any]:
    """As Flux2Pipeline passes them: int64 ids ``[1, S, 4]`` (t, h, w, l; ``cartesian_prod`` of ``arange``s) of the
    latent grid and of the text."""
    zero, grid = torch.arange(1), torch.arange(side)
    kwargs = dict(
        hidden_states=randn(1, side * side, config["in_channels"]),
        encoder_hidden_states=randn(1, text_tokens, config["joint_attention_dim"]),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=torch.cartesian_prod(zero, grid, grid, zero)[None].to(device),
        txt_ids=torch.cartesian_prod(zero, zero, zero, torch.arange(text_tokens))[None].to(device),
        return_dict=False,
    )
    if config["guidance_embeds"]:
        kwargs["guidance"] = torch.tensor([3.5], device=device)
    return kwargs


def _sd3_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 8, 8), encoder_hidden_states=randn(1, 8, 32),
                pooled_projections=randn(1, 32), timestep=torch.tensor([500], device=device), return_dict=False)


def _qwenimage_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                      dtype: torch.dtype, mixed_sizes: bool = False, text_padding: int = 0, side: int = 4,
                      text_tokens: int = 8) -> Dict[str, Any]:
    """``mixed_sizes``: a batch of two images of different sizes (4x4 and 2x8 latent patches), which
    QwenImage's RoPE does not support and warns about (using the first image's size for both).
    ``text_padding``: the last text tokens masked out (0 in ``encoder_hidden_states_mask``). ``side`` x ``side``
    latent patches and ``text_tokens`` text tokens otherwise (odd counts: shards of unequal size under context
    parallelism)."""
    batch = 2 if mixed_sizes else 1
    shapes = [[(1, 4, 4)], [(1, 2, 8)]] if mixed_sizes else [[(1, side, side)]]
    mask = torch.ones(batch, text_tokens, dtype=torch.long, device=device)
    mask[:, text_tokens - text_padding:] = 0
    return dict(hidden_states=randn(batch, 16 if mixed_sizes else side * side, 16),
                encoder_hidden_states=randn(batch, text_tokens, 32), encoder_hidden_states_mask=mask,
                timestep=torch.full((batch,), 0.5, device=device, dtype=dtype), img_shapes=shapes,
                return_dict=False)


def _wan_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                dtype: torch.dtype, side: int = 8) -> Dict[str, Any]:
    """2 latent frames of ``side`` x ``side`` (8: 32 tokens with patch (1, 2, 2)). ``image_dim`` in the config
    (I2V): 4 CLIP image tokens too. The I2V processor splits the context at 512 text tokens (hard-coded in
    diffusers), so an I2V model gets 512 text tokens."""
    kwargs = dict(hidden_states=randn(1, 4, 2, side, side), timestep=torch.tensor([500], device=device),
                  encoder_hidden_states=randn(1, 512 if config.get("image_dim") else 8, 32), return_dict=False)
    if config.get("image_dim"):
        kwargs["encoder_hidden_states_image"] = randn(1, 4, config["image_dim"])
    return kwargs


def _hunyuanvideo_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                         dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 1, 4, 4), timestep=torch.tensor([500], device=device),
                encoder_hidden_states=randn(1, 6, 16), encoder_attention_mask=torch.ones(1, 6, device=device),
                pooled_projections=randn(1, 8), guidance=torch.tensor([3500.0], device=device), return_dict=False)


def _feedforward_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                        dtype: torch.dtype, **call_kwargs: Any) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, config["dim"]), **call_kwargs)


def _flux_like_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                      dtype: torch.dtype, ids_3d: bool = False, text_padding: int = 0) -> Dict[str, Any]:
    """Chroma and Ovis-Image: FLUX.1's inputs without pooled projections (4x4 latent grid, 8 text tokens).
    ``text_padding`` (Chroma): ChromaPipeline's ``attention_mask``, the prompt's bool mask (its last ``text_padding``
    tokens padding) followed by the image tokens' ones."""
    kwargs = _flux1_inputs(dict(config, pooled_projection_dim=1, guidance_embeds=False), randn, device, dtype, ids_3d)
    del kwargs["pooled_projections"]
    if text_padding:
        mask = torch.ones(1, 8 + 16, dtype=torch.bool, device=device)
        mask[:, 8 - text_padding:8] = False
        kwargs["attention_mask"] = mask
    return kwargs


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


_INPUTS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "flux1": _flux1_inputs, "flux2": _flux2_inputs, "sd3": _sd3_inputs, "qwenimage": _qwenimage_inputs,
    "wan": _wan_inputs, "hunyuanvideo": _hunyuanvideo_inputs, "feedforward": _feedforward_inputs,
    "chroma": _flux_like_inputs, "ovis": _flux_like_inputs, "auraflow": _auraflow_inputs, "pixart": _pixart_inputs,
    "dreamlite": _dreamlite_inputs,
    "qwenimage-fused": functools.partial(_qwenimage_inputs, text_padding=2),
    **FAMILY_INPUTS,
}
_ATTENTION_KWARGS = {
    "flux1": "joint_attention_kwargs", "flux2": "joint_attention_kwargs", "sd3": "joint_attention_kwargs",
    "chroma": "joint_attention_kwargs", "ovis": "joint_attention_kwargs", "pixart": "cross_attention_kwargs",
    "zimage": "joint_attention_kwargs",
}
