"""Tiny configs and inputs of the diffusion transformers added after the first five (private; merged into
``models.CONFIGS``): FLUX.3, QwenImage 2.1, Z-Image, Krea 2, Wan 2.2 TI2V-5B, HunyuanVideo 1.5, LTX-2,
Ideogram 4, Kandinsky 6 and HiDream-I1. Chroma, the eleventh family, is ``models``' ``chroma``.

The inputs are what each diffusers 0.42.1 pipeline passes its transformer (``pipelines/<model>/pipeline_*.py``,
FLUX.3's ``modular_pipelines/flux3``), at tiny shapes: the timestep's scale and dtype, the ids and masks the pipeline
builds, zeros where the pipeline passes zeros (text-to-video's condition latents, padding). Text-to-image/video,
batch 1 (the pipelines' guidance runs cond and uncond as separate calls or as a batch of 2).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

Randn = Callable[..., torch.Tensor]

#: name -> (diffusers class, constructor arguments), one block of each kind per model.
FAMILY_CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "flux3": ("Flux3Transformer2DModel", dict(
        in_channels=8, cond_in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, timestep_channels=32, mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4))),
    "qwenimage21": ("QwenImage21Transformer2DModel", dict(
        patch_size=1, in_channels=8, out_channels=8, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        context_in_dim=16, mlp_ratio=2, axes_dims_rope=(4, 6, 6))),
    # head dim = sum(axes_dims) (Z-Image's RoPE covers the whole head)
    "zimage": ("ZImageTransformer2DModel", dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32])),
    # GQA as in production (q heads / kv heads = 2 here, 4 there)
    "krea2": ("Krea2Transformer2DModel", dict(
        in_channels=8, num_layers=1, attention_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=32, num_text_layers=3, text_num_attention_heads=2,
        text_num_key_value_heads=2, text_intermediate_size=32, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6))),
    # Wan2.2-TI2V-5B's block options (q/k RMSNorm across heads, affine cross-attention norm)
    "wan22-ti2v": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        rope_max_seq_len=32)),
    # in_channels = 2 latent + 2 condition-latent + 1 mask channels, as the pipeline concatenates them
    "hunyuanvideo15": ("HunyuanVideo15Transformer3DModel", dict(
        in_channels=5, out_channels=2, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_refiner_layers=1,
        mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=8, rope_axes_dim=(4, 6, 6))),
    # the LTX-2.x checkpoints' split RoPE; LTX-2.3's gated attention and cross-attention modulation on. Cross dims
    # must equal each stream's width, and the audio heads the video heads (cross_attn_rope uses the video count).
    "ltx2": ("LTX2VideoTransformer3DModel", dict(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=1, caption_channels=16, rope_type="split", gated_attn=True,
        cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True)),
    # sum(mrope_section) = head dim / 2
    "ideogram4": ("Ideogram4Transformer2DModel", dict(
        in_channels=8, num_layers=1, attention_head_dim=16, num_attention_heads=2, intermediate_size=32, adaln_dim=16,
        llm_features_dim=24, mrope_section=(4, 2, 2))),
    # the released checkpoints' options (ca_rope, cross_gates, fix_modulation, text_token_padding); in_visual_dim
    # 4: the latents' channels (the pipeline adds as many condition channels and a mask: 9 in all)
    "kandinsky6": ("Kandinsky6Transformer3DModel", dict(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, patch_size=(1, 2, 2),
        model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1, axes_dims=(4, 6, 6), in_audio_dim=4,
        out_audio_dim=4, ca_rope=True, cross_gates=True, fix_modulation=True, text_token_padding=True)),
    # MoE feed-forward (4 routed experts, 2 active) as in production; llama_layers: the Llama layer each block reads
    "hidream": ("HiDreamImageTransformer2DModel", dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[8, 8], text_emb_dim=8, num_routed_experts=4, num_activated_experts=2,
        axes_dims_rope=(4, 6, 6), max_resolution=(16, 16), llama_layers=[0, 1])),
}  # fmt: skip
#: The fused families' ``<name>-fused`` configs: two main blocks (Z-Image: one modulated noise refiner and one
#: unmodulated context refiner besides). Pinned on them: the rms_sandwich_block / rms_sandwich_qk_norm_rope op call counts
#: (tests/patches/test_fused_rms_sandwich.py; Wan 2.2 TI2V's: test_fused_wan.py) and every model-level fused test
#: (tests/patches/_fused_models.MODELS).
FAMILY_CONFIGS.update({
    "zimage-fused": (FAMILY_CONFIGS["zimage"][0], dict(FAMILY_CONFIGS["zimage"][1], n_layers=2)),
    "ideogram4-fused": (FAMILY_CONFIGS["ideogram4"][0], dict(FAMILY_CONFIGS["ideogram4"][1], num_layers=2)),
    "wan22-ti2v-fused": (FAMILY_CONFIGS["wan22-ti2v"][0], dict(FAMILY_CONFIGS["wan22-ti2v"][1], num_layers=2)),
    "hunyuanvideo15-fused": (FAMILY_CONFIGS["hunyuanvideo15"][0], dict(FAMILY_CONFIGS["hunyuanvideo15"][1],
                                                                      num_layers=2)),
})


def _flux3_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
                  side: int = 4, text_tokens: int = 8) -> Dict[str, Any]:
    """As FLUX.3's modular text-to-image blocks pass them: float32 ids ``[S, 4]`` (t, h, w, l; h and w scaled by the
    image RoPE scale 0.5), text ids along l, timestep t / 1000 in the latents' dtype."""
    zero, grid = torch.arange(1), torch.arange(side)
    img_ids = torch.cartesian_prod(zero, grid, grid, zero).float()
    img_ids[:, 1:3] *= 0.5
    return dict(hidden_states=randn(1, side * side, config["in_channels"]),
                encoder_hidden_states=randn(1, text_tokens, config["joint_attention_dim"]),
                timestep=torch.tensor([0.5], device=device, dtype=dtype), img_ids=img_ids.to(device),
                txt_ids=torch.cartesian_prod(zero, zero, zero, torch.arange(text_tokens)).float().to(device),
                return_dict=False)


def _qwenimage21_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
                        kv_cache_mode: str = "cached", side: int = 4, text_tokens: int = 5) -> Dict[str, Any]:
    """As QwenImage21Pipeline passes them (text-to-image): latents flattened unpatched ``[B, S, C]``, ``img_mask``
    the prompt's image-pad mask (none in a text prompt) plus one slot per 2x2 target latents, the prompt mask (long).
    ``kv_cache_mode`` "cached" (every step after the first): the text's keys and values come from a cache, here
    random (post-RoPE ``[B, text, heads, head_dim]`` per block, what the first step's "extract" stores)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    cache = QwenImage21KVCache(config["num_layers"])
    if kv_cache_mode == "cached":
        for layer in cache.layer_caches:
            layer.store(randn(1, text_tokens, heads, head_dim), randn(1, text_tokens, heads, head_dim))
    slots = side * side // 4
    img_mask = torch.cat([torch.zeros(1, text_tokens, dtype=torch.bool), torch.ones(1, slots, dtype=torch.bool)], 1)
    return dict(hidden_states=randn(1, side * side, config["in_channels"]),
                encoder_hidden_states=randn(1, text_tokens, config["context_in_dim"]),
                encoder_hidden_states_mask=torch.ones(1, text_tokens, dtype=torch.long, device=device),
                timestep=torch.tensor([0.5], device=device, dtype=dtype), img_shapes=[[(1, side, side)]],
                img_mask=img_mask.to(device), kv_cache=cache, kv_cache_mode=kv_cache_mode, return_dict=False)


def _zimage_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
                   side: int = 8, text_tokens: int = 7) -> Dict[str, Any]:
    """As ZImagePipeline passes them: one ``[C, 1, H, W]`` latent and the prompt's valid caption features ``[L, D]``
    per sample (lists), timestep (1000 - t) / 1000 (float32, the scheduler's)."""
    return dict(x=[randn(config["in_channels"], 1, side, side)], t=torch.tensor([0.5], device=device),
                cap_feats=[randn(text_tokens, config["cap_feat_dim"])], return_dict=False)


def krea2_position_ids(text_tokens: int, grid: int) -> torch.Tensor:
    """Krea2Pipeline.prepare_position_ids: ``[text + grid^2, 3]``, text at the origin, image ``(0, h, w)``."""
    image = torch.zeros(grid, grid, 3)
    image[..., 1] = torch.arange(grid)[:, None]
    image[..., 2] = torch.arange(grid)[None, :]
    return torch.cat([torch.zeros(text_tokens, 3), image.reshape(-1, 3)])


def _krea2_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
                  side: int = 4) -> Dict[str, Any]:
    """As Krea2Pipeline passes them: packed latents, per-token features of ``num_text_layers`` text-encoder layers
    ``[B, L, layers, D]``, a bool mask padded in the middle (``[prompt | PAD | suffix]``), timestep t / 1000."""
    mask = torch.tensor([[True, True, True, False, True]], device=device)
    return dict(hidden_states=randn(1, side * side, config["in_channels"]),
                encoder_hidden_states=randn(1, 5, config["num_text_layers"], config["text_hidden_dim"]),
                timestep=torch.tensor([0.5], device=device, dtype=dtype),
                position_ids=krea2_position_ids(5, side).to(device), encoder_attention_mask=mask, return_dict=False)


def wan22_ti2v_timestep(frames: int, height: int, width: int, t: float, device: torch.device) -> torch.Tensor:
    """WanPipeline with ``expand_timesteps`` (Wan 2.2 TI2V): ``(mask[0][0][:, ::2, ::2] * t).flatten()[None]``, one
    float32 timestep per token (the mask is all ones in text-to-video)."""
    mask = torch.ones(frames, height, width, device=device)
    return (mask[:, ::2, ::2] * t).flatten()[None]


def _wan22_ti2v_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
                       side: int = 8) -> Dict[str, Any]:
    """2 latent frames of ``side`` x ``side`` (8: 32 tokens), 8 text tokens (6 valid, then zeros as the pipeline
    pads)."""
    text = randn(1, 8, config["text_dim"])
    text[:, 6:] = 0
    return dict(hidden_states=randn(1, config["in_channels"], 2, side, side),
                timestep=wan22_ti2v_timestep(2, side, side, 500.0, device), encoder_hidden_states=text,
                return_dict=False)


def _hunyuanvideo15_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                           dtype: torch.dtype) -> Dict[str, Any]:
    """As HunyuanVideo15Pipeline passes them (text-to-video): ``[latents, zero condition latents, zero mask]`` on the
    channels, the float timestep in the latents' dtype, a padded prompt (long mask), ByT5 glyph features all zeros
    with a zero mask (no quoted text), zero image embeddings."""
    latents = randn(1, config["out_channels"], 2, 4, 4)
    hidden = torch.cat([latents, torch.zeros_like(latents), torch.zeros_like(latents[:, :1])], dim=1)
    return dict(hidden_states=hidden, timestep=torch.tensor([500.0], device=device, dtype=dtype),
                encoder_hidden_states=randn(1, 5, config["text_embed_dim"]),
                encoder_attention_mask=torch.tensor([[1, 1, 1, 0, 0]], device=device),
                encoder_hidden_states_2=torch.zeros(1, 3, config["text_embed_2_dim"], device=device, dtype=dtype),
                encoder_attention_mask_2=torch.zeros(1, 3, dtype=torch.long, device=device),
                image_embeds=torch.zeros(1, 2, config["image_embed_dim"], device=device, dtype=dtype),
                return_dict=False)


def _ltx2_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    """As LTX2Pipeline passes them: packed video ``[B, F*H*W, C]`` and audio ``[B, frames, C]`` latents, the
    connectors' video and audio prompt embeddings with the prompt's left-padded mask, ``sigma`` = the timestep
    (t, float32), the latent grid and 24 fps; the coordinates are the transformer's own (the pipeline precomputes
    the same with ``transformer.rope``)."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]], device=device)
    timestep = torch.tensor([500.0], device=device)
    return dict(hidden_states=randn(1, 2 * 4 * 4, config["in_channels"]),
                audio_hidden_states=randn(1, 5, config["audio_in_channels"]),
                encoder_hidden_states=randn(1, 6, config["caption_channels"]),
                audio_encoder_hidden_states=randn(1, 6, config["caption_channels"]), timestep=timestep, sigma=timestep,
                encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=2, height=4, width=4,
                fps=24.0, audio_num_frames=5, use_cross_timestep=True, return_dict=False)


def ideogram4_ids(text_lengths: List[int], grid_h: int, grid_w: int,
                  max_text_tokens: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ideogram4Pipeline._prepare_ids: the packed ``[left-pad][text][image]`` layout's MRoPE ``position_ids``,
    ``segment_ids`` (-1 pad, 1 text and image) and ``indicator`` (0 pad, 3 text, 2 image)."""
    image = torch.cartesian_prod(torch.arange(1), torch.arange(grid_h), torch.arange(grid_w)) + 65536
    total = max_text_tokens + grid_h * grid_w
    position_ids = torch.zeros(len(text_lengths), total, 3, dtype=torch.long)
    segment_ids = torch.full((len(text_lengths), total), -1, dtype=torch.long)
    indicator = torch.zeros(len(text_lengths), total, dtype=torch.long)
    for b, num_text in enumerate(text_lengths):
        offset = max_text_tokens - num_text
        position_ids[b, offset:offset + num_text] = torch.arange(num_text)[:, None]
        position_ids[b, max_text_tokens:] = image
        indicator[b, offset:max_text_tokens], indicator[b, max_text_tokens:] = 3, 2
        segment_ids[b, offset:] = 1
    return position_ids, segment_ids, indicator


def ideogram4_features(randn: Randn, valid: int, max_text_tokens: int, image_tokens: int, width: int) -> torch.Tensor:
    """The prompt's features left-padded to ``max_text_tokens``, zeros over padding and image positions."""
    text = randn(1, valid, width)
    features = text.new_zeros(1, max_text_tokens + image_tokens, width)
    features[:, max_text_tokens - valid:max_text_tokens] = text
    return features


def _ideogram4_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                      dtype: torch.dtype) -> Dict[str, Any]:
    """As Ideogram4Pipeline passes them: ``[zeros over the text region, latents]``, 3 text tokens left-padded to 4, a
    2x4 latent grid, timestep 1 - t / 1000 in the model's dtype."""
    position_ids, segment_ids, indicator = ideogram4_ids([3], 2, 4, 4)
    latents = randn(1, 8, config["in_channels"])
    hidden = torch.cat([latents.new_zeros(1, 4, config["in_channels"]), latents], dim=1)
    return dict(hidden_states=hidden, timestep=torch.tensor([0.5], device=device, dtype=dtype),
                encoder_hidden_states=ideogram4_features(randn, 3, 4, 8, config["llm_features_dim"]),
                position_ids=position_ids.to(device), segment_ids=segment_ids.to(device),
                indicator=indicator.to(device), return_dict=False)


def kandinsky6_visual(randn: Randn, frames: int, height: int, width: int, channels: int) -> torch.Tensor:
    """Kandinsky6TI2VAPipeline's ``[latents | zero condition latents | zero mask]`` (BTHWC) for text-to-video."""
    latents = randn(1, frames, height, width, channels)
    return torch.cat([latents, torch.zeros_like(latents), torch.zeros_like(latents[..., :1])], dim=-1)


def _kandinsky6_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                       dtype: torch.dtype) -> Dict[str, Any]:
    """As Kandinsky6TI2VAPipeline passes them (text-to-video with audio): a max-length padded prompt with its bool mask
    (None when no token is padding), CLIP's pooled embedding, the timestep t (float32), audio latents."""
    return dict(hidden_states=kandinsky6_visual(randn, 2, 4, 4, config["in_visual_dim"]),
                encoder_hidden_states=randn(1, 5, config["in_text_dim"]),
                pooled_projections=randn(1, config["in_text_dim2"]), timestep=torch.tensor([500.0], device=device),
                audio_hidden_states=randn(1, 6, config["in_audio_dim"]),
                encoder_attention_mask=torch.tensor([[True, True, True, False, False]], device=device),
                return_dict=False)


def _hidream_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                    dtype: torch.dtype) -> Dict[str, Any]:
    """As HiDreamImagePipeline passes them: square latents ``[B, C, H, W]`` (the model patchifies, no mask), the
    timestep t (float32), T5 features, every Llama layer's hidden states stacked ``[layers, B, L, D]``, pooled CLIP."""
    llama_layers = max(config["llama_layers"]) + 1
    return dict(hidden_states=randn(1, config["in_channels"], 8, 8), timesteps=torch.tensor([500.0], device=device),
                encoder_hidden_states_t5=randn(1, 6, config["caption_channels"][0]),
                encoder_hidden_states_llama3=randn(llama_layers, 1, 5, config["caption_channels"][1]),
                pooled_embeds=randn(1, config["text_emb_dim"]), return_dict=False)


FAMILY_INPUTS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "flux3": _flux3_inputs, "qwenimage21": _qwenimage21_inputs, "zimage": _zimage_inputs, "krea2": _krea2_inputs,
    "wan22-ti2v": _wan22_ti2v_inputs, "hunyuanvideo15": _hunyuanvideo15_inputs, "ltx2": _ltx2_inputs,
    "ideogram4": _ideogram4_inputs, "kandinsky6": _kandinsky6_inputs, "hidream": _hidream_inputs,
    "wan22-ti2v-fused": _wan22_ti2v_inputs, "hunyuanvideo15-fused": _hunyuanvideo15_inputs,
}
