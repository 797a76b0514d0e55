"""The diffusion transformers ``dit.py`` (and ``flux_cp.py``, ``flux_lora.py``) measure: production widths, random weights, and
the inputs each diffusers 0.42.1 pipeline passes its transformer (read from ``pipelines/<model>/pipeline_*.py``).
Batch 1 everywhere (SD3's pipeline runs batch 2 under classifier-free guidance; the others run cond and uncond as
separate batch-1 calls). Not a benchmark itself.

    flux1      FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128; 1024x1024 = 4096 image + 512 text tokens
    flux2      FLUX.2-dev widths (48 x 128, MLP ratio 3, text 15360, RoPE 4 x 32), 2 of 8 double + 12 of 48 single
    wan        Wan2.1-T2V-14B: 40 x 128, FFN 13824, rms_norm_across_heads, cross-attn norm, text 4096; 480x832,
               81 frames = latents 16 x 21 x 60 x 104 = 32,760 tokens (patch 1,2,2), 512 text tokens (128 valid, then
               zeros as WanPipeline pads), int64 timestep; fp32 norms/modulation tables/time embedder; 4 of 40 layers
    qwenimage  Qwen-Image: 24 x 128, joint 3584; 1328x1328 = 83 x 83 = 6,889 packed tokens, 256 text tokens with a
               mask (230 valid, the rest padding); 6 of 60 layers
    sd3        SD3.5-large: 38 x 64, joint 4096, caption 2432, pooled 2048, RMSNorm q/k, pos_embed_max_size 192;
               1024x1024 = 4096 tokens, 333 text (77 CLIP, zero-padded 2048 -> 4096 wide, + 256 T5); 6 of 38 layers
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

__all__ = ["Spec", "SPECS", "flux_inputs", "layers_of", "with_layers", "tiny_config_name", "tiny_config"]

Randn = Callable[..., torch.Tensor]


class Spec:
    """One model: its diffusers class, production config (with the default layer subset), the config keys and
    module attributes of its block lists, the full model's layer counts, and its inputs builder."""

    def __init__(self, cls_name: str, config: Dict[str, Any], layer_keys: Tuple[str, ...],
                 block_lists: Tuple[str, ...], full_layers: Tuple[int, ...],
                 inputs: Callable[[Dict[str, Any], Randn, torch.device, torch.dtype], Dict[str, Any]]) -> None:
        self.cls_name, self.config, self.layer_keys = cls_name, config, layer_keys
        self.block_lists, self.full_layers, self.inputs = block_lists, full_layers, inputs


def flux_inputs(name: str, config: Dict[str, Any], side: int, text: int, device: torch.device,
                dtype: torch.dtype) -> Dict[str, Any]:
    """As the FLUX pipelines pass them: packed latents, ids [S, 3] (FLUX.1) / [1, S, 4] (FLUX.2), timestep in [0, 1]."""
    grid = side // 16
    gen = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    axes = 3 if name == "flux1" else 4
    img_ids = torch.zeros(grid, grid, axes)
    img_ids[..., 1] = torch.arange(grid)[:, None]
    img_ids[..., 2] = torch.arange(grid)[None, :]
    txt_ids = torch.zeros(text, axes)
    if name == "flux2":
        txt_ids[:, 3] = torch.arange(text)
    out = dict(
        hidden_states=randn(1, grid * grid, config["in_channels"]),
        encoder_hidden_states=randn(1, text, config["joint_attention_dim"]),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        guidance=torch.tensor([3.5], device=device, dtype=torch.float32),
        img_ids=img_ids.reshape(-1, axes).to(device),
        txt_ids=txt_ids.to(device),
        return_dict=False,
    )
    if name == "flux2":  # Flux2Pipeline's ids: int64 (cartesian_prod of aranges), with the batch dim (the dim its
        # context-parallel plan expects)
        out["img_ids"], out["txt_ids"] = out["img_ids"][None].long(), out["txt_ids"][None].long()
    if name == "flux1":
        out["pooled_projections"] = randn(1, config["pooled_projection_dim"])
    return out


def _padded(randn: Randn, valid: int, total: int, width: int) -> torch.Tensor:
    """A text encoder's output padded with zeros after ``valid`` tokens, as the Wan / QwenImage pipelines pad."""
    out = randn(1, total, width)
    out[:, valid:] = 0
    return out


def _wan(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # WanPipeline: latents [B, 16, (81 - 1) // 4 + 1, 480 // 8, 832 // 8] cast to the transformer's dtype; the
    # UniPC scheduler's int64 timesteps, t.expand(B); T5 embeddings padded with zeros to 512 tokens.
    return dict(hidden_states=randn(1, 16, 21, 60, 104), timestep=torch.tensor([999], device=device),
                encoder_hidden_states=_padded(randn, 128, 512, config["text_dim"]), return_dict=False)


def _qwenimage(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # QwenImagePipeline: packed latents [B, 83 * 83, 64]; timestep t / 1000 in the latents' dtype; img_shapes
    # [[(1, H / 16, W / 16)]] per sample; the prompt mask (long, 1 = token) beside zero-padded embeddings.
    mask = torch.zeros(1, 256, dtype=torch.long, device=device)
    mask[:, :230] = 1
    return dict(hidden_states=randn(1, 83 * 83, config["in_channels"]),
                encoder_hidden_states=_padded(randn, 230, 256, config["joint_attention_dim"]),
                encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5], device=device, dtype=dtype),
                img_shapes=[[(1, 83, 83)]], return_dict=False)


def _sd3(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # StableDiffusion3Pipeline: latents [B, 16, 128, 128]; FlowMatchEuler's float timesteps (sigma * 1000),
    # t.expand(B); 77 CLIP tokens (768 + 1280 wide, zero-padded to T5's 4096) then 256 T5 tokens; pooled 2048.
    text = randn(1, 77 + 256, config["joint_attention_dim"])
    text[:, :77, 2048:] = 0
    return dict(hidden_states=randn(1, 16, 128, 128), timestep=torch.tensor([500.0], device=device),
                encoder_hidden_states=text, pooled_projections=randn(1, config["pooled_projection_dim"]),
                return_dict=False)


_FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")

SPECS: Dict[str, Spec] = {
    "flux1": Spec("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56)), ("num_layers", "num_single_layers"), _FLUX_BLOCKS, (19, 38),
        lambda config, randn, device, dtype: flux_inputs("flux1", config, 1024, 512, device, dtype)),
    "flux2": Spec("Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=128, num_layers=2, num_single_layers=12, attention_head_dim=128,
        num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True),
        ("num_layers", "num_single_layers"), _FLUX_BLOCKS, (8, 48),
        lambda config, randn, device, dtype: flux_inputs("flux2", config, 1024, 512, device, dtype)),
    "wan": Spec("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=4, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024), ("num_layers",), ("blocks",), (40,),
        _wan),
    "qwenimage": Spec("QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=6, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56)),
        ("num_layers",), ("transformer_blocks",), (60,), _qwenimage),
    "sd3": Spec("SD3Transformer2DModel", dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=64, num_attention_heads=38,
        joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=192, qk_norm="rms_norm", dual_attention_layers=()),
        ("num_layers",), ("transformer_blocks",), (38,), _sd3),
}


def layers_of(spec: Spec, config: Dict[str, Any]) -> Tuple[int, ...]:
    return tuple(int(config[key]) for key in spec.layer_keys)


def with_layers(spec: Spec, config: Dict[str, Any], layers: Tuple[int, ...]) -> Dict[str, Any]:
    """``config`` with the block counts ``layers`` (one per block list)."""
    if len(layers) != len(spec.layer_keys):
        raise ValueError(f"{spec.cls_name} has {len(spec.layer_keys)} block list(s), got layers {layers}")
    return dict(config, **dict(zip(spec.layer_keys, layers)))


def tiny_config_name(name: str) -> str:
    """The harness's tiny config for a model: ``<name>-fused`` where a fused pattern added one, else ``<name>``."""
    from harness import CONFIGS

    return f"{name}-fused" if f"{name}-fused" in CONFIGS else name


def tiny_config(name: str) -> Dict[str, Any]:
    """A copy of the harness's tiny config for a model (:func:`tiny_config_name`)."""
    from harness import CONFIGS

    return dict(CONFIGS[tiny_config_name(name)][1])
