"""The tiny inputs of the registry's families (``registry.FAMILIES[name].inputs``), and the id and mask builders
their production inputs share (``production``).

The inputs are what each diffusers 0.42.1 pipeline passes its transformer (``pipelines/<model>/pipeline_*.py``,
FLUX.3's ``modular_pipelines/flux3``), at tiny shapes: the timestep's scale and dtype, the ids and masks the pipeline
builds, zeros where the pipeline passes zeros (text-to-video's condition latents, padding). Text-to-image/video,
batch 1 (the pipelines' guidance runs cond and uncond as separate calls or as a batch of 2). Each builder:
``(config, randn, device, dtype, **options) -> forward kwargs``; ``models.tiny_inputs`` documents the options.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

Randn = Callable[..., torch.Tensor]


def flux1_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
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


def flux2_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
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


def sd3_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 8, 8), encoder_hidden_states=randn(1, 8, 32),
                pooled_projections=randn(1, 32), timestep=torch.tensor([500], device=device), return_dict=False)


def qwenimage_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
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


def wan_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                dtype: torch.dtype, side: int = 8) -> Dict[str, Any]:
    """2 latent frames of ``side`` x ``side`` (8: 32 tokens with patch (1, 2, 2)). ``image_dim`` in the config
    (I2V): 4 CLIP image tokens too. The I2V processor splits the context at 512 text tokens (hard-coded in
    diffusers), so an I2V model gets 512 text tokens."""
    kwargs = dict(hidden_states=randn(1, 4, 2, side, side), timestep=torch.tensor([500], device=device),
                  encoder_hidden_states=randn(1, 512 if config.get("image_dim") else 8, 32), return_dict=False)
    if config.get("image_dim"):
        kwargs["encoder_hidden_states_image"] = randn(1, 4, config["image_dim"])
    return kwargs


def flux_like_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                      dtype: torch.dtype, ids_3d: bool = False, text_padding: int = 0) -> Dict[str, Any]:
    """Chroma and Ovis-Image: FLUX.1's inputs without pooled projections (4x4 latent grid, 8 text tokens).
    ``text_padding`` (Chroma): ChromaPipeline's ``attention_mask``, the prompt's bool mask (its last ``text_padding``
    tokens padding) followed by the image tokens' ones."""
    kwargs = flux1_inputs(dict(config, pooled_projection_dim=1, guidance_embeds=False), randn, device, dtype, ids_3d)
    del kwargs["pooled_projections"]
    if text_padding:
        mask = torch.ones(1, 8 + 16, dtype=torch.bool, device=device)
        mask[:, 8 - text_padding:8] = False
        kwargs["attention_mask"] = mask
    return kwargs


def flux3_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
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


def qwenimage21_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
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


def zimage_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
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


def krea2_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
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


def wan22_ti2v_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype,
                       side: int = 8) -> Dict[str, Any]:
    """2 latent frames of ``side`` x ``side`` (8: 32 tokens), 8 text tokens (6 valid, then zeros as the pipeline
    pads)."""
    text = randn(1, 8, config["text_dim"])
    text[:, 6:] = 0
    return dict(hidden_states=randn(1, config["in_channels"], 2, side, side),
                timestep=wan22_ti2v_timestep(2, side, side, 500.0, device), encoder_hidden_states=text,
                return_dict=False)


def hunyuanvideo15_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
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


def ltx2_inputs(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
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


def ideogram4_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
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


def kandinsky6_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                       dtype: torch.dtype) -> Dict[str, Any]:
    """As Kandinsky6TI2VAPipeline passes them (text-to-video with audio): a max-length padded prompt with its bool mask
    (None when no token is padding), CLIP's pooled embedding, the timestep t (float32), audio latents."""
    return dict(hidden_states=kandinsky6_visual(randn, 2, 4, 4, config["in_visual_dim"]),
                encoder_hidden_states=randn(1, 5, config["in_text_dim"]),
                pooled_projections=randn(1, config["in_text_dim2"]), timestep=torch.tensor([500.0], device=device),
                audio_hidden_states=randn(1, 6, config["in_audio_dim"]),
                encoder_attention_mask=torch.tensor([[True, True, True, False, False]], device=device),
                return_dict=False)


def hidream_inputs(config: Dict[str, Any], randn: Randn, device: torch.device,
                    dtype: torch.dtype) -> Dict[str, Any]:
    """As HiDreamImagePipeline passes them: square latents ``[B, C, H, W]`` (the model patchifies, no mask), the
    timestep t (float32), T5 features, every Llama layer's hidden states stacked ``[layers, B, L, D]``, pooled CLIP."""
    llama_layers = max(config["llama_layers"]) + 1
    return dict(hidden_states=randn(1, config["in_channels"], 8, 8), timesteps=torch.tensor([500.0], device=device),
                encoder_hidden_states_t5=randn(1, 6, config["caption_channels"][0]),
                encoder_hidden_states_llama3=randn(llama_layers, 1, 5, config["caption_channels"][1]),
                pooled_embeds=randn(1, config["text_emb_dim"]), return_dict=False)
