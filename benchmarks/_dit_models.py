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

The families torchpatches fuses nothing in yet (their tiny configs: ``torchpatches/_harness/families.py``); text
prompts of 160 valid tokens, padded as each pipeline pads:

    flux3      FLUX.3: 5 mode layers (x 3 modes) + 28 single, 24 x 128, FF 9216, text 20480; 1024x1024 = 4096 tokens,
               160 text tokens, float32 ids [S, 4] (h, w scaled 0.5); 1 of 5 mode + 6 of 28 single layers
    qwenimage21  QwenImage 2.1: 32 x 128, FF 12288, context 4096; 1024x1024 = 64 x 64 = 4,096 tokens (unpatched);
               the KV-cached step (every step after the first): 160 text tokens' keys/values from the cache, img_mask
               160 + 1,024 target slots; 6 of 32 layers
    zimage     Z-Image: 30 heads x 128 = 3840, FF 10240, caption 2560, 2 + 2 refiner layers; 1024x1024 = 64 x 64 =
               4,096 tokens, 160 caption tokens (lists, one per sample); 6 of 30 layers
    krea2      Krea 2: 48 q / 12 kv heads x 128 = 6144, FF 16384, text fusion of 12 layers x 2560; 1024x1024 = 4,096
               tokens, 517 text tokens (160 prompt, padding, 5 suffix: the pipeline pads mid-template); 4 of 28 layers
    wan22-ti2v Wan2.2-TI2V-5B: 24 x 128, FFN 14336, in/out 48, text 4096; 704x1280, 121 frames = latents 48 x 31 x 44
               x 80 = 27,280 tokens, a float32 timestep per token [1, 27280] (expand_timesteps), 512 text (128 valid,
               then zeros); 4 of 30 layers
    hunyuanvideo15  HunyuanVideo 1.5: 16 x 128, FF 8192, text 3584 + ByT5 1472 + image 1152; 480x848, 121 frames =
               31 x 30 x 53 = 49,290 tokens, 65 channels (latents, zero condition, zero mask), 1000 text tokens, 256
               ByT5 (zeros, mask zeros: no quoted text), 729 image tokens (zeros: text-to-video); 4 of 54 layers
    ltx2       LTX-2: video 32 x 128, audio 32 x 64, caption 3840, split RoPE; 704x1280, 121 frames = 16 x 22 x 40 =
               14,080 video + 126 audio tokens (24 fps), 1024 text tokens (left-padded), sigma = timestep; 4 of 48
    ideogram4  Ideogram 4: 18 x 256 = 4608, FF 12288, LLM features 53248 per token; 1024x1024 = 4,096 image tokens
               after 2048 text positions (left-padded; a [1, 1, L, L] segment mask); 6 of 34 layers
    kandinsky6 Kandinsky 6 (video + audio): 32 x 128 = 4096, FF 16384, 4 text blocks per modality; 480x864, 121 frames
               = 31 x 30 x 54 = 50,220 tokens (33 channels: latents, zero condition, zero mask), 218 audio latents,
               1024 text tokens with a bool mask, CLIP pooled 768; 4 of 60 visual blocks
    chroma     Chroma: FLUX.1-dev's blocks with pruned modulation (approximator 64 -> 5120 x 5); 1024x1024 = 4096 tokens,
               512 text (161 unmasked: the pipeline keeps one padding token); 4 of 19 double + 8 of 38 single
    hidream    HiDream-I1-Full: 20 x 128 = 2560, MoE FF (4 routed experts, 2 active, + shared); 1024x1024 = 4096
               tokens, 128 T5 + 32 Llama layers x 128 tokens, pooled 2048; 2 of 16 double + 4 of 32 single
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

__all__ = ["Spec", "SPECS", "flux_inputs", "layers_of", "with_layers", "tiny_config_name", "tiny_config"]

Randn = Callable[..., torch.Tensor]


class Spec:
    """One model: its diffusers class, production config (with the default layer subset), the config keys and
    module attributes of its block lists, the full model's layer counts, and its inputs builder. ``derive``: the
    config entries that follow the layer counts (HiDream's ``llama_layers``, one per block), applied to the default
    config and by :func:`with_layers`."""

    def __init__(self, cls_name: str, config: Dict[str, Any], layer_keys: Tuple[str, ...],
                 block_lists: Tuple[str, ...], full_layers: Tuple[int, ...],
                 inputs: Callable[[Dict[str, Any], Randn, torch.device, torch.dtype], Dict[str, Any]],
                 derive: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None) -> None:
        self.cls_name, self.config, self.layer_keys = cls_name, derive(config) if derive else config, layer_keys
        self.block_lists, self.full_layers, self.inputs, self.derive = block_lists, full_layers, inputs, derive


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


# ---- the families torchpatches fuses nothing in yet (pipelines' inputs: torchpatches/_harness/families.py) ----------

_TEXT = 160  # valid prompt tokens


def _flux3(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # FLUX.3's modular blocks: packed latents [B, 64 * 64, 128]; float32 ids (t, h, w, l), h and w scaled by 0.5;
    # text ids along l; timestep t / 1000 in the latents' dtype.
    from harness import families

    return families.FAMILY_INPUTS["flux3"](config, randn, device, dtype, side=64, text_tokens=_TEXT)


def _qwenimage21(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # QwenImage21Pipeline, a step after the first: the text's keys/values come from the cache (random here)
    from harness import families

    return families.FAMILY_INPUTS["qwenimage21"](config, randn, device, dtype, side=64, text_tokens=_TEXT)


def _zimage(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # ZImagePipeline: latents [16, 1, 128, 128] per sample, the valid caption features, (1000 - t) / 1000 in float32
    from harness import families

    return families.FAMILY_INPUTS["zimage"](config, randn, device, dtype, side=128, text_tokens=_TEXT)


def _krea2(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # Krea2Pipeline: packed latents [B, 64 * 64, 64]; 12 text-encoder layers per token [B, 517, 12, 2560], the mask
    # [prompt | PAD | suffix] (512 padded prompt tokens, 5 suffix); position ids [517 + 4096, 3]; t / 1000.
    from harness import families

    text = 512 + 5
    mask = torch.zeros(1, text, dtype=torch.bool, device=device)
    mask[:, :_TEXT] = mask[:, 512:] = True
    return dict(hidden_states=randn(1, 64 * 64, config["in_channels"]),
                encoder_hidden_states=randn(1, text, config["num_text_layers"], config["text_hidden_dim"]),
                timestep=torch.tensor([0.5], device=device, dtype=dtype),
                position_ids=families.krea2_position_ids(text, 64).to(device), encoder_attention_mask=mask,
                return_dict=False)


def _wan22_ti2v(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # WanPipeline (expand_timesteps): latents [B, 48, (121 - 1) // 4 + 1, 704 // 16, 1280 // 16]; one float32
    # timestep per token; T5 embeddings padded with zeros to 512 tokens.
    from harness import families

    return dict(hidden_states=randn(1, 48, 31, 44, 80),
                timestep=families.wan22_ti2v_timestep(31, 44, 80, 999.0, device),
                encoder_hidden_states=_padded(randn, 128, 512, config["text_dim"]), return_dict=False)


def _hunyuanvideo15(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
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


def _ltx2(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
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


def _ideogram4(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # Ideogram4Pipeline: [zeros over 2048 text positions, latents 64 * 64 x 128]; the prompt's features left-padded,
    # zeros elsewhere; MRoPE ids, segment ids and indicator of the packed layout; 1 - t / 1000 in the model's dtype.
    from harness import families

    position_ids, segment_ids, indicator = families.ideogram4_ids([_TEXT], 64, 64, 2048)
    latents = randn(1, 64 * 64, config["in_channels"])
    return dict(hidden_states=torch.cat([latents.new_zeros(1, 2048, config["in_channels"]), latents], dim=1),
                timestep=torch.tensor([0.5], device=device, dtype=dtype),
                encoder_hidden_states=families.ideogram4_features(randn, _TEXT, 2048, 64 * 64,
                                                                  config["llm_features_dim"]),
                position_ids=position_ids.to(device), segment_ids=segment_ids.to(device),
                indicator=indicator.to(device), return_dict=False)


def _kandinsky6(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # Kandinsky6TI2VAPipeline (text-to-video with audio): BTHWC [latents 16 | zero condition 16 | zero mask 1] x 31 x
    # 60 x 108; Qwen prompt padded to 1024 with its bool mask; CLIP pooled; float32 t; audio latents
    # ceil(121 / 24 * 44100 / 1024) = 218 x 20.
    from harness import families

    mask = torch.zeros(1, 1024, dtype=torch.bool, device=device)
    mask[:, :_TEXT] = True
    return dict(hidden_states=families.kandinsky6_visual(randn, 31, 60, 108, config["in_visual_dim"]),
                encoder_hidden_states=_padded(randn, _TEXT, 1024, config["in_text_dim"]),
                pooled_projections=randn(1, config["in_text_dim2"]), timestep=torch.tensor([999.0], device=device),
                audio_hidden_states=randn(1, 218, config["in_audio_dim"]), encoder_attention_mask=mask,
                return_dict=False)


def _chroma(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # ChromaPipeline: FLUX.1's packed latents and ids; T5 padded to 512 with one padding token left unmasked; the
    # attention mask [text mask | image ones] (bool); timestep t / 1000 in the latents' dtype.
    out = flux_inputs("flux1", dict(config, pooled_projection_dim=1), 1024, 512, device, dtype)
    for key in ("pooled_projections", "guidance"):
        del out[key]
    mask = torch.ones(1, 512 + 64 * 64, dtype=torch.bool, device=device)
    mask[:, _TEXT + 1:512] = False
    out["attention_mask"] = mask
    return out


def _hidream_llama_layers(config: Dict[str, Any]) -> Dict[str, Any]:
    """One Llama layer per block (the model projects one feature set per block): HiDream-I1's 0..31, then the last
    for the remaining blocks (not checked against the released config.json; with random features only the count
    matters), the first ones for a subset."""
    blocks = config["num_layers"] + config["num_single_layers"]
    return dict(config, llama_layers=(list(range(32)) + [31] * 16)[:blocks])


def _hidream(config: Dict[str, Any], randn: Randn, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    # HiDreamImagePipeline: latents [B, 16, 128, 128] (square: the model patchifies, no mask); float32 t; T5 [B, 128,
    # 4096]; the 32 Llama-3.1 layers' hidden states stacked [32, B, 128, 4096]; pooled CLIP-L + CLIP-G (2048).
    return dict(hidden_states=randn(1, 16, 128, 128), timesteps=torch.tensor([999.0], device=device),
                encoder_hidden_states_t5=randn(1, 128, config["caption_channels"][0]),
                encoder_hidden_states_llama3=randn(32, 1, 128, config["caption_channels"][1]),
                pooled_embeds=randn(1, config["text_emb_dim"]), return_dict=False)


_FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")
#: Wan2.1-T2V-14B at 4 of its 40 layers (the base of Wan 2.2 TI2V-5B's config below).
_WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=4, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

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
    "wan": Spec("WanTransformer3DModel", _WAN_14B, ("num_layers",), ("blocks",), (40,), _wan),
    "qwenimage": Spec("QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=6, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56)),
        ("num_layers",), ("transformer_blocks",), (60,), _qwenimage),
    "sd3": Spec("SD3Transformer2DModel", dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=64, num_attention_heads=38,
        joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=192, qk_norm="rms_norm", dual_attention_layers=()),
        ("num_layers",), ("transformer_blocks",), (38,), _sd3),
    "flux3": Spec("Flux3Transformer2DModel", dict(
        in_channels=128, cond_in_channels=128, num_layers=1, num_single_layers=6, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=20480, timestep_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32)), ("num_layers", "num_single_layers"),
        ("txt_mode_blocks", "single_transformer_blocks"), (5, 28), _flux3),
    "qwenimage21": Spec("QwenImage21Transformer2DModel", dict(
        patch_size=1, in_channels=64, out_channels=64, num_layers=6, attention_head_dim=128, num_attention_heads=32,
        context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), causal_condition=True),
        ("num_layers",), ("transformer_blocks",), (32,), _qwenimage21),
    "zimage": Spec("ZImageTransformer2DModel", dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=6, n_refiner_layers=2,
        n_heads=30, n_kv_heads=30, cap_feat_dim=2560, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512]),
        ("n_layers",), ("layers",), (30,), _zimage),
    "krea2": Spec("Krea2Transformer2DModel", dict(
        in_channels=64, num_layers=4, attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12,
        intermediate_size=16384, timestep_embed_dim=256, text_hidden_dim=2560, num_text_layers=12,
        text_num_attention_heads=20, text_num_key_value_heads=20, text_intermediate_size=6912,
        num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48)),
        ("num_layers",), ("transformer_blocks",), (28,), _krea2),
    # Wan 2.2 TI2V-5B: Wan 2.1 14B's block with 24 heads, FFN 14336 and a 48-channel VAE.
    "wan22-ti2v": Spec("WanTransformer3DModel", dict(_WAN_14B, num_attention_heads=24, in_channels=48,
                                                     out_channels=48, ffn_dim=14336),
                       ("num_layers",), ("blocks",), (30,), _wan22_ti2v),
    "hunyuanvideo15": Spec("HunyuanVideo15Transformer3DModel", dict(
        in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=4,
        num_refiner_layers=2, mlp_ratio=4.0, text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
        rope_axes_dim=(16, 56, 56)), ("num_layers",), ("transformer_blocks",), (54,), _hunyuanvideo15),
    "ltx2": Spec("LTX2VideoTransformer3DModel", dict(
        in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
        audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32, audio_attention_head_dim=64,
        audio_cross_attention_dim=2048, num_layers=4, caption_channels=3840, rope_type="split"),
        ("num_layers",), ("transformer_blocks",), (48,), _ltx2),
    "ideogram4": Spec("Ideogram4Transformer2DModel", dict(
        in_channels=128, num_layers=6, attention_head_dim=256, num_attention_heads=18, intermediate_size=12288,
        adaln_dim=512, llm_features_dim=53248, rope_theta=5000000, mrope_section=(24, 20, 20)),
        ("num_layers",), ("layers",), (34,), _ideogram4),
    "kandinsky6": Spec("Kandinsky6Transformer3DModel", dict(
        in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=1024, patch_size=(1, 2, 2),
        model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=4, axes_dims=(32, 48, 48),
        in_audio_dim=20, out_audio_dim=20, ca_rope=True, cross_gates=True, fix_modulation=True,
        text_token_padding=True), ("num_visual_blocks",), ("visual_transformer_blocks",), (60,), _kandinsky6),
    "chroma": Spec("ChromaTransformer2DModel", dict(
        patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56), approximator_num_channels=64,
        approximator_hidden_dim=5120, approximator_layers=5), ("num_layers", "num_single_layers"), _FLUX_BLOCKS,
        (19, 38), _chroma),
    "hidream": Spec("HiDreamImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=128,
        num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(64, 32, 32), max_resolution=(128, 128)),
        ("num_layers", "num_single_layers"), ("double_stream_blocks", "single_stream_blocks"), (16, 32), _hidream,
        _hidream_llama_layers),
}


def layers_of(spec: Spec, config: Dict[str, Any]) -> Tuple[int, ...]:
    return tuple(int(config[key]) for key in spec.layer_keys)


def with_layers(spec: Spec, config: Dict[str, Any], layers: Tuple[int, ...]) -> Dict[str, Any]:
    """``config`` with the block counts ``layers`` (one per block list)."""
    if len(layers) != len(spec.layer_keys):
        raise ValueError(f"{spec.cls_name} has {len(spec.layer_keys)} block list(s), got layers {layers}")
    out = dict(config, **dict(zip(spec.layer_keys, layers)))
    return spec.derive(out) if spec.derive else out


def tiny_config_name(name: str) -> str:
    """The harness's tiny config for a model: ``<name>-fused`` where a fused pattern added one, else ``<name>``."""
    from harness import CONFIGS

    return f"{name}-fused" if f"{name}-fused" in CONFIGS else name


def tiny_config(name: str) -> Dict[str, Any]:
    """A copy of the harness's tiny config for a model (:func:`tiny_config_name`)."""
    from harness import CONFIGS

    return dict(CONFIGS[tiny_config_name(name)][1])
