"""The production-size inputs of the registry's families (``registry.FAMILIES[name].production``): what each
diffusers 0.42.1 pipeline passes its transformer (read from ``pipelines/<model>/pipeline_*.py``), at the shapes in
the registry's docstring. Batch 1 everywhere (SD3's pipeline runs batch 2 under classifier-free guidance; the others
run cond and uncond as separate batch-1 calls). Prompts of 160 valid tokens, padded as each pipeline pads.

Each builder: ``(config, randn, device, dtype) -> forward kwargs``; ``randn(*shape)`` gives seeded tensors in the
model's dtype on its device. Read by ``benchmarks/`` through ``benchmarks/_dit_models.py``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch

from . import families

Randn = Callable[..., torch.Tensor]
_TEXT = 160  # valid prompt tokens


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


def flux1(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    return flux_inputs("flux1", config, 1024, 512, device, dtype)


def flux2(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    return flux_inputs("flux2", config, 1024, 512, device, dtype)


def _padded(randn: Randn, valid: int, total: int, width: int) -> torch.Tensor:
    """A text encoder's output padded with zeros after ``valid`` tokens, as the Wan / QwenImage pipelines pad."""
    out = randn(1, total, width)
    out[:, valid:] = 0
    return out


def wan(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # WanPipeline: latents [B, 16, (81 - 1) // 4 + 1, 480 // 8, 832 // 8] cast to the transformer's dtype; the
    # UniPC scheduler's int64 timesteps, t.expand(B); T5 embeddings padded with zeros to 512 tokens.
    return dict(hidden_states=randn(1, 16, 21, 60, 104), timestep=torch.tensor([999], device=device),
                encoder_hidden_states=_padded(randn, 128, 512, config["text_dim"]), return_dict=False)


def qwenimage(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # QwenImagePipeline: packed latents [B, 83 * 83, 64]; timestep t / 1000 in the latents' dtype; img_shapes
    # [[(1, H / 16, W / 16)]] per sample; the prompt mask (long, 1 = token) beside zero-padded embeddings.
    mask = torch.zeros(1, 256, dtype=torch.long, device=device)
    mask[:, :230] = 1
    return dict(hidden_states=randn(1, 83 * 83, config["in_channels"]),
                encoder_hidden_states=_padded(randn, 230, 256, config["joint_attention_dim"]),
                encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5], device=device, dtype=dtype),
                img_shapes=[[(1, 83, 83)]], return_dict=False)


def sd3(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # StableDiffusion3Pipeline: latents [B, 16, 128, 128]; FlowMatchEuler's float timesteps (sigma * 1000),
    # t.expand(B); 77 CLIP tokens (768 + 1280 wide, zero-padded to T5's 4096) then 256 T5 tokens; pooled 2048.
    text = randn(1, 77 + 256, config["joint_attention_dim"])
    text[:, :77, 2048:] = 0
    return dict(hidden_states=randn(1, 16, 128, 128), timestep=torch.tensor([500.0], device=device),
                encoder_hidden_states=text, pooled_projections=randn(1, config["pooled_projection_dim"]),
                return_dict=False)


def flux3(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # FLUX.3's modular blocks: packed latents [B, 64 * 64, 128]; float32 ids (t, h, w, l), h and w scaled by 0.5;
    # text ids along l; timestep t / 1000 in the latents' dtype.
    return families.flux3_inputs(config, randn, device, dtype, side=64, text_tokens=_TEXT)


def qwenimage21(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # QwenImage21Pipeline, a step after the first: the text's keys/values come from the cache (random here)
    return families.qwenimage21_inputs(config, randn, device, dtype, side=64, text_tokens=_TEXT)


def zimage(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # ZImagePipeline: latents [16, 1, 128, 128] per sample, the valid caption features, (1000 - t) / 1000 in float32
    return families.zimage_inputs(config, randn, device, dtype, side=128, text_tokens=_TEXT)


def krea2(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # Krea2Pipeline: packed latents [B, 64 * 64, 64]; 12 text-encoder layers per token [B, 517, 12, 2560], the mask
    # [prompt | PAD | suffix] (512 padded prompt tokens, 5 suffix); position ids [517 + 4096, 3]; t / 1000.
    text = 512 + 5
    mask = torch.zeros(1, text, dtype=torch.bool, device=device)
    mask[:, :_TEXT] = mask[:, 512:] = True
    return dict(hidden_states=randn(1, 64 * 64, config["in_channels"]),
                encoder_hidden_states=randn(1, text, config["num_text_layers"], config["text_hidden_dim"]),
                timestep=torch.tensor([0.5], device=device, dtype=dtype),
                position_ids=families.krea2_position_ids(text, 64).to(device), encoder_attention_mask=mask,
                return_dict=False)


def wan22_ti2v(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # WanPipeline (expand_timesteps): latents [B, 48, (121 - 1) // 4 + 1, 704 // 16, 1280 // 16]; one float32
    # timestep per token; T5 embeddings padded with zeros to 512 tokens.
    return dict(hidden_states=randn(1, 48, 31, 44, 80),
                timestep=families.wan22_ti2v_timestep(31, 44, 80, 999.0, device),
                encoder_hidden_states=_padded(randn, 128, 512, config["text_dim"]), return_dict=False)


def hunyuanvideo15(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # HunyuanVideo15Pipeline (text-to-video): [latents 32 | zero condition 32 | zero mask 1] x 31 x 30 x 53; the float
    # timestep in the latents' dtype; Qwen prompt padded to 1000 (long mask); ByT5 zeros with a zero mask (no quoted
    # text); 729 zero image tokens.
    latents = randn(1, 32, 31, 30, 53)
    mask = torch.zeros(1, 1000, dtype=torch.long, device=device)
    mask[:, :_TEXT] = 1
    return dict(hidden_states=torch.cat([latents, torch.zeros_like(latents), torch.zeros_like(latents[:, :1])], 1),
                timestep=torch.tensor([999.0], device=device, dtype=dtype),
                encoder_hidden_states=_padded(randn, _TEXT, 1000, config["text_embed_dim"]),
                encoder_attention_mask=mask,
                encoder_hidden_states_2=torch.zeros(1, 256, config["text_embed_2_dim"], device=device, dtype=dtype),
                encoder_attention_mask_2=torch.zeros(1, 256, dtype=torch.long, device=device),
                image_embeds=torch.zeros(1, 729, config["image_embed_dim"], device=device, dtype=dtype),
                return_dict=False)


def ltx2(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # LTX2Pipeline: packed latents [B, 16 * 22 * 40, 128] (VAE 8 x 32 x 32); audio latents [B, round(121 / 24 * 25),
    # 128]; the connectors' video and audio embeddings (1024 tokens) with the prompt's left-padded mask; the float32
    # timestep t, sigma = t; the latent grid and 24 fps (the transformer builds the coordinates as the pipeline does).
    mask = torch.zeros(1, 1024, dtype=torch.long, device=device)
    mask[:, -_TEXT:] = 1
    timestep = torch.tensor([999.0], device=device)
    return dict(hidden_states=randn(1, 16 * 22 * 40, config["in_channels"]),
                audio_hidden_states=randn(1, 126, config["audio_in_channels"]),
                encoder_hidden_states=randn(1, 1024, config["caption_channels"]),
                audio_encoder_hidden_states=randn(1, 1024, config["caption_channels"]), timestep=timestep,
                sigma=timestep, encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=16,
                height=22, width=40, fps=24.0, audio_num_frames=126, use_cross_timestep=True, return_dict=False)


def ideogram4(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # Ideogram4Pipeline: [zeros over 2048 text positions, latents 64 * 64 x 128]; the prompt's features left-padded,
    # zeros elsewhere; MRoPE ids, segment ids and indicator of the packed layout; 1 - t / 1000 in the model's dtype.
    position_ids, segment_ids, indicator = families.ideogram4_ids([_TEXT], 64, 64, 2048)
    latents = randn(1, 64 * 64, config["in_channels"])
    return dict(hidden_states=torch.cat([latents.new_zeros(1, 2048, config["in_channels"]), latents], dim=1),
                timestep=torch.tensor([0.5], device=device, dtype=dtype),
                encoder_hidden_states=families.ideogram4_features(randn, _TEXT, 2048, 64 * 64,
                                                                  config["llm_features_dim"]),
                position_ids=position_ids.to(device), segment_ids=segment_ids.to(device),
                indicator=indicator.to(device), return_dict=False)


def kandinsky6(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # Kandinsky6TI2VAPipeline (text-to-video with audio): BTHWC [latents 16 | zero condition 16 | zero mask 1] x 31 x
    # 60 x 108; Qwen prompt padded to 1024 with its bool mask; CLIP pooled; float32 t; audio latents
    # ceil(121 / 24 * 44100 / 1024) = 218 x 20.
    mask = torch.zeros(1, 1024, dtype=torch.bool, device=device)
    mask[:, :_TEXT] = True
    return dict(hidden_states=families.kandinsky6_visual(randn, 31, 60, 108, config["in_visual_dim"]),
                encoder_hidden_states=_padded(randn, _TEXT, 1024, config["in_text_dim"]),
                pooled_projections=randn(1, config["in_text_dim2"]), timestep=torch.tensor([999.0], device=device),
                audio_hidden_states=randn(1, 218, config["in_audio_dim"]), encoder_attention_mask=mask,
                return_dict=False)


def chroma(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # ChromaPipeline: FLUX.1's packed latents and ids; T5 padded to 512 with one padding token left unmasked; the
    # attention mask [text mask | image ones] (bool); timestep t / 1000 in the latents' dtype.
    out = flux_inputs("flux1", dict(config, pooled_projection_dim=1), 1024, 512, device, dtype)
    for key in ("pooled_projections", "guidance"):
        del out[key]
    mask = torch.ones(1, 512 + 64 * 64, dtype=torch.bool, device=device)
    mask[:, _TEXT + 1:512] = False
    out["attention_mask"] = mask
    return out


def hidream_llama_layers(config: Dict[str, Any]) -> Dict[str, Any]:
    """One Llama layer per block (the model projects one feature set per block): HiDream-I1's 0..31, then the last
    for the remaining blocks (not checked against the released config.json; with random features only the count
    matters), the first ones for a subset."""
    blocks = config["num_layers"] + config["num_single_layers"]
    return dict(config, llama_layers=(list(range(32)) + [31] * 16)[:blocks])


def hidream(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # HiDreamImagePipeline: latents [B, 16, 128, 128] (square: the model patchifies, no mask); float32 t; T5 [B, 128,
    # 4096]; the 32 Llama-3.1 layers' hidden states stacked [32, B, 128, 4096]; pooled CLIP-L + CLIP-G (2048).
    return dict(hidden_states=randn(1, 16, 128, 128), timesteps=torch.tensor([999.0], device=device),
                encoder_hidden_states_t5=randn(1, 128, config["caption_channels"][0]),
                encoder_hidden_states_llama3=randn(32, 1, 128, config["caption_channels"][1]),
                pooled_embeds=randn(1, config["text_emb_dim"]), return_dict=False)
