"""The model registry: one row per diffusers family, read by the tests, the benchmarks and the harness alike.

A row holds what the project knows about a family as data: its diffusers class; the tiny config the CPU tests build
and what its fused-pattern tests' ``<name>-fused`` config changes; the tiny and production inputs (as its pipeline
passes them: ``families``, ``production``); the production config with the block subset the benchmarks run; the
fused op calls of a tiny forward; what ``torchpatches.coverage`` reports for it (which patterns target which of its
modules); its usual LoRA targets.

Read by ``models.CONFIGS`` (the tiny configs), ``benchmarks/_dit_models.py`` (the production specs),
``tests/patches/_fused_models.py`` (the fused families and patterns) and the table-driven tests
(``tests/patches/test_fused_families.py``, ``tests/test_families.py``). A family gains fusion by gaining a pattern,
and here a ``fused`` config, its ``calls`` and its coverage.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple


from . import families as tiny
from . import production as prod

__all__ = ["Family", "Production", "FAMILIES", "FUSED_PATTERNS"]

Inputs = Callable[..., Dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Production:
    """A family at production width: ``about`` (model, shape, tokens, the block subset run), the config with the
    default block subset, the config keys and module attributes of its block lists, the full model's block counts,
    the inputs builder (``(config, randn, device, dtype) -> kwargs``) and ``derive``: config entries that follow the
    block counts (HiDream's ``llama_layers``), applied to ``config`` here and by ``_dit_models.with_layers``."""

    about: str
    config: Dict[str, Any]
    layer_keys: Tuple[str, ...]
    block_lists: Tuple[str, ...]
    full_layers: Tuple[int, ...]
    inputs: Inputs
    derive: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None

    def __post_init__(self) -> None:
        if self.derive is not None:
            object.__setattr__(self, "config", self.derive(self.config))


@dataclasses.dataclass(frozen=True)
class Family:
    """One diffusers family.

    - ``fused``: what the ``<name>-fused`` tiny config changes in ``tiny`` (None: no pattern fuses it yet);
      ``fused_options``: the ``tiny_inputs`` options its fused tests use;
    - ``calls``: the fused op calls of one ``<name>-fused`` forward with every pattern on and a tier forced
      (``tests/patches/conftest.py``'s counter);
    - ``untargeted``: its own classes no pattern targets; ``targeted``: the ``(pattern, class)`` pairs coverage
      reports on the tiny config (None: not pinned);
    - ``lora``: peft targets on ``<name>-fused`` and the fused op calls a LoRA-loaded forward still makes;
    - ``attention_kwargs``: the forward's name for them."""

    cls: str
    tiny: Dict[str, Any]
    inputs: Inputs
    production: Production
    fused: Optional[Dict[str, Any]] = None
    fused_options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    calls: Dict[str, int] = dataclasses.field(default_factory=dict)
    untargeted: Tuple[str, ...] = ()
    targeted: Optional[FrozenSet[Tuple[str, str]]] = None
    lora: Optional[Tuple[Tuple[str, ...], Dict[str, int]]] = None
    attention_kwargs: str = "attention_kwargs"

    def fused_config(self) -> Optional[Dict[str, Any]]:
        return None if self.fused is None else dict(self.tiny, **self.fused)


_FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")
_FLUX1 = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
              axes_dims_rope=(4, 4, 8))
#: Wan2.1-T2V-14B at 4 of its 40 layers (the base of Wan 2.2 TI2V-5B's config below).
_WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=4, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
#: Wan2.1 T2V's block options (q/k RMSNorm across heads, affine cross-attention norm), 2 blocks, 4 heads x 8.
_WAN_FUSED = dict(num_attention_heads=4, text_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6)
#: Two main blocks: what every newer family's ``-fused`` config changes.
_TWO = dict(num_layers=2)

FAMILIES: Dict[str, Family] = {
    # Pinned on flux1's tiny config (1 double + 1 single block): compile_warnings' graph breaks, inductor_realize's
    # flux_tiny counts (18 kernels, 84 nests, 45 buffers, 619,316 bytes on torch 2.11). flux1-fused: 1 double + 2
    # single blocks, so a single block also gets its inputs as two slices of one tensor (the zero-copy concat).
    "flux1": Family(
        "FluxTransformer2DModel", _FLUX1, tiny.flux1_inputs, Production(
            "FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128; 1024x1024 = 4096 image + 512 text tokens",
            dict(_FLUX1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56)),
            ("num_layers", "num_single_layers"), _FLUX_BLOCKS, (19, 38), prod.flux1),
        fused=dict(in_channels=16, num_single_layers=2, pooled_projection_dim=16, guidance_embeds=True,
                   axes_dims_rope=(4, 6, 6)),
        calls={"modulate": 11, "qk_norm_rope": 3, "slices": 4},
        untargeted=("CombinedTimestepTextProjEmbeddings", "FluxAttention"), targeted=frozenset({
            ("adaln", "AdaLayerNormContinuous"), ("adaln", "AdaLayerNormZero"), ("adaln", "AdaLayerNormZeroSingle"),
            ("gate_residual", "FluxSingleTransformerBlock"), ("gate_residual", "FluxTransformerBlock"),
            ("gelu_gemm", "GELU"), ("qk_norm_rope", "FluxAttnProcessor"), ("rope_tables", "FluxPosEmbed")}),
        attention_kwargs="joint_attention_kwargs"),
    "flux2": Family(
        "Flux2Transformer2DModel", dict(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False), tiny.flux2_inputs, Production(
            "FLUX.2-dev widths (48 x 128, MLP ratio 3, text 15360, RoPE 4 x 32), 2 of 8 double + 12 of 48 single",
            dict(patch_size=1, in_channels=128, num_layers=2, num_single_layers=12, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True),
            ("num_layers", "num_single_layers"), _FLUX_BLOCKS, (8, 48), prod.flux2),
        fused=dict(in_channels=16, num_single_layers=2, timestep_guidance_channels=16, mlp_ratio=3.0,
                   guidance_embeds=True),
        calls={"modulate": 11, "qk_norm_rope": 3, "swiglu": 4, "slices": 2},
        untargeted=("Flux2Modulation", "Flux2FeedForward"), targeted=frozenset({
            ("adaln", "AdaLayerNormContinuous"), ("gate_residual", "Flux2SingleTransformerBlock"),
            ("gate_residual", "Flux2TransformerBlock"), ("qk_norm_rope", "Flux2AttnProcessor"),
            ("qk_norm_rope", "Flux2ParallelSelfAttnProcessor"), ("rope_tables", "Flux2PosEmbed"),
            ("swiglu", "Flux2SwiGLU")}),
        attention_kwargs="joint_attention_kwargs"),
    # sd3-fused, SD3.5-style (qk_norm="rms_norm"): 2 blocks, the last context_pre_only (AdaLayerNormContinuous, no
    # to_add_out).
    "sd3": Family(
        "SD3Transformer2DModel", dict(
            sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
            pos_embed_max_size=8), tiny.sd3_inputs, Production(
            "SD3.5-large: 38 x 64, joint 4096, caption 2432, pooled 2048, RMSNorm q/k, pos_embed_max_size 192; "
            "1024x1024 = 4096 tokens, 333 text (77 CLIP, zero-padded 2048 -> 4096 wide, + 256 T5); 6 of 38 layers",
            dict(sample_size=128, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=64,
                 num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                 pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
                 dual_attention_layers=()),
            ("num_layers",), ("transformer_blocks",), (38,), prod.sd3),
        fused=dict(num_layers=2, qk_norm="rms_norm"), calls={"modulate": 11, "qk_norm_rope": 2},
        untargeted=("PatchEmbed",), targeted=frozenset({
            ("adaln", "AdaLayerNormContinuous"), ("adaln", "AdaLayerNormZero"), ("gelu_gemm", "GELU"),
            ("sd3_block", "JointTransformerBlock"), ("sd3_qk_norm", "JointAttnProcessor2_0")}),
        lora=(("to_q", "to_k", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out", "ff.net.0.proj",
               "ff_context.net.2", "norm1.linear", "norm1_context.linear"), {"qk_norm_rope": 2, "modulate": 11}),
        attention_kwargs="joint_attention_kwargs"),
    # wan-fused: 2 x 4 x 4 latent patches = 32 tokens, 8 text tokens.
    "wan": Family(
        "WanTransformer3DModel", dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32), tiny.wan_inputs,
        Production(
            "Wan2.1-T2V-14B: 40 x 128, FFN 13824, rms_norm_across_heads, cross-attn norm, text 4096; 480x832, 81 "
            "frames = latents 16 x 21 x 60 x 104 = 32,760 tokens (patch 1,2,2), 512 text tokens (128 valid, then "
            "zeros as WanPipeline pads), int64 timestep; fp32 norms/modulation tables/time embedder; 4 of 40 layers",
            _WAN_14B, ("num_layers",), ("blocks",), (40,), prod.wan),
        fused=_WAN_FUSED, calls={"modulate": 8, "rms_norm_rope": 4},
        untargeted=("WanRotaryPosEmbed", "WanTimeTextImageEmbedding"), targeted=frozenset({
            ("gelu_gemm", "GELU"), ("wan_block", "WanTransformerBlock"), ("wan_qk_norm_rope", "WanAttnProcessor")}),
        lora=(("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
              {"modulate": 8, "rms_norm_rope": 4})),
    # qwenimage-fused: 2 double-stream blocks (the second gets the first's outputs), the last 2 text tokens masked.
    "qwenimage": Family(
        "QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)), tiny.qwenimage_inputs,
        Production(
            "Qwen-Image: 24 x 128, joint 3584; 1328x1328 = 83 x 83 = 6,889 packed tokens, 256 text tokens with a "
            "mask (230 valid, the rest padding); 6 of 60 layers",
            dict(patch_size=2, in_channels=64, out_channels=16, num_layers=6, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                 axes_dims_rope=(16, 56, 56)),
            ("num_layers",), ("transformer_blocks",), (60,), prod.qwenimage),
        fused=_TWO, fused_options=dict(text_padding=2),
        calls={"modulate": 13, "qk_norm_rope": 2},
        untargeted=("QwenEmbedRope", "QwenTimestepProjEmbeddings"), targeted=frozenset({
            ("adaln", "AdaLayerNormContinuous"), ("gelu_gemm", "GELU"),
            ("qwenimage_block", "QwenImageTransformerBlock"),
            ("qwenimage_qk_norm_rope", "QwenDoubleStreamAttnProcessor2_0")}),
        lora=(("to_q", "to_k", "add_v_proj", "to_out.0", "to_add_out", "img_mod.1", "txt_mod.1",
               "img_mlp.net.0.proj", "txt_mlp.net.2"), {"modulate": 13, "qk_norm_rope": 2})),
    "flux3": Family(
        "Flux3Transformer2DModel", dict(
            in_channels=8, cond_in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, timestep_channels=32, mlp_ratio=2.0,
            axes_dims_rope=(4, 4, 4, 4)), tiny.flux3_inputs, Production(
            "FLUX.3: 5 mode layers (x 3 modes) + 28 single, 24 x 128, FF 9216, text 20480; 1024x1024 = 4096 tokens, "
            "160 text tokens, float32 ids [S, 4] (h, w scaled 0.5); 1 of 5 mode + 6 of 28 single layers",
            dict(in_channels=128, cond_in_channels=128, num_layers=1, num_single_layers=6, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=20480, timestep_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32)), ("num_layers", "num_single_layers"),
            ("txt_mode_blocks", "single_transformer_blocks"), (5, 28), prod.flux3),
        # per mode block (2 text + 2 image): LayerNorm + modulate, the gated residual of the branch sum; per single
        # block (2): both per stream; norm_out once. One qk_norm_rope and one swiglu per attention / FF call.
        fused=dict(num_layers=2, num_single_layers=2), calls={"modulate": 17, "qk_norm_rope": 6, "swiglu": 6},
        untargeted=("Flux3Modulation", "Flux3PosEmbed"), targeted=frozenset({
            ("flux3", "Flux3ModeTransformerBlock"), ("flux3", "Flux3SingleTransformerBlock"),
            ("flux3", "Flux3AttnProcessor"), ("flux3", "Flux3SwiGLU"), ("flux3", "Flux3AdaLayerNorm")}),
        lora=(("to_q", "to_k", "to_out.0", "linear_in", "linear_out", "early_stream_modulations.image.linear",
               "norm_out.linear"), {"modulate": 17, "qk_norm_rope": 6, "swiglu": 6})),
    "qwenimage21": Family(
        "QwenImage21Transformer2DModel", dict(
            patch_size=1, in_channels=8, out_channels=8, num_layers=1, attention_head_dim=16, num_attention_heads=2,
            context_in_dim=16, mlp_ratio=2, axes_dims_rope=(4, 6, 6)), tiny.qwenimage21_inputs, Production(
            "QwenImage 2.1: 32 x 128, FF 12288, context 4096; 1024x1024 = 64 x 64 = 4,096 tokens (unpatched); the "
            "KV-cached step (every step after the first): 160 text tokens' keys/values from the cache, img_mask 160 "
            "+ 1,024 target slots; all 32 layers",
            dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                 num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56),
                 causal_condition=True), ("num_layers",), ("transformer_blocks",), (32,), prod.qwenimage21),
        # the KV-cached step (the tiny inputs' default): per block 3 modulate, 1 swiglu, 1 qk_norm_rope; the final
        # norm 1 modulate
        fused=_TWO, calls={"modulate": 7, "swiglu": 2, "qk_norm_rope": 2},
        untargeted=("QwenImage21TextProjection", "QwenImage21TimestepProjEmbeddings"), targeted=frozenset({
            ("qwenimage21", "QwenImage21TransformerBlock"), ("qwenimage21", "QwenImage21AttnProcessor"),
            ("qwenimage21", "QwenImage21AdaLayerNormContinuous")}),
        lora=(("to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out",
               "modulation.1", "norm_out.linear"), {"modulate": 7, "swiglu": 2, "qk_norm_rope": 2})),
    # head dim = sum(axes_dims) (Z-Image's RoPE covers the whole head). zimage-fused: two main blocks, one modulated
    # noise refiner and one unmodulated context refiner besides.
    "zimage": Family(
        "ZImageTransformer2DModel", dict(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=1, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32]),
        tiny.zimage_inputs, Production(
            "Z-Image: 30 heads x 128 = 3840, FF 10240, caption 2560, 2 + 2 refiner layers; 1024x1024 = 64 x 64 = "
            "4,096 tokens, 160 caption tokens (lists, one per sample); 6 of 30 layers",
            dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=6,
                 n_refiner_layers=2, n_heads=30, n_kv_heads=30, cap_feat_dim=2560, axes_dims=[32, 48, 48],
                 axes_lens=[1024, 512, 512]), ("n_layers",), ("layers",), (30,), prod.zimage),
        fused=dict(n_layers=2), calls={"rms_modulate": 9, "swiglu": 3, "qk_norm_rope": 4},
        untargeted=("FinalLayer", "TimestepEmbedder"), targeted=frozenset({
            ("rms_sandwich_block", "ZImageTransformerBlock"),
            ("rms_sandwich_qk_norm_rope", "ZSingleStreamAttnProcessor")}),
        attention_kwargs="joint_attention_kwargs"),
    # GQA as in production (q heads / kv heads = 2 here, 4 there)
    "krea2": Family(
        "Krea2Transformer2DModel", dict(
            in_channels=8, num_layers=1, attention_head_dim=16, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=32, num_text_layers=3,
            text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=32,
            num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6)),
        tiny.krea2_inputs, Production(
            "Krea 2: 48 q / 12 kv heads x 128 = 6144, FF 16384, text fusion of 12 layers x 2560; 1024x1024 = 4,096 "
            "tokens, 517 text tokens (160 prompt, padding, 5 suffix: the pipeline pads mid-template); 4 of 28 layers",
            dict(in_channels=64, num_layers=4, attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12,
                 intermediate_size=16384, timestep_embed_dim=256, text_hidden_dim=2560, num_text_layers=12,
                 text_num_attention_heads=20, text_num_key_value_heads=20, text_intermediate_size=6912,
                 num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48)),
            ("num_layers",), ("transformer_blocks",), (28,), prod.krea2),
        # per main block 3 modulate + 1 swiglu (the SwiGLU); per attention call (2 blocks, 2 text-fusion blocks) one
        # qk_norm_rope and one swiglu (the sigmoid output gate)
        fused=_TWO, calls={"modulate": 6, "qk_norm_rope": 4, "swiglu": 6},
        untargeted=("Krea2TextFusionBlock", "Krea2FinalLayer"), targeted=frozenset({
            ("krea2", "Krea2TransformerBlock"), ("krea2", "Krea2AttnProcessor")}),
        lora=(("to_q", "to_k", "to_v", "to_gate", "to_out.0", "ff.gate", "ff.up", "ff.down"),
              {"modulate": 6, "qk_norm_rope": 4, "swiglu": 6})),
    # Wan2.2-TI2V-5B's block options (q/k RMSNorm across heads, affine cross-attention norm). Wan 2.2's class is
    # Wan 2.1's: the Wan patterns target it (their per-token timestep form is their business).
    "wan22-ti2v": Family(
        "WanTransformer3DModel", dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32), tiny.wan22_ti2v_inputs,
        Production(
            "Wan2.2-TI2V-5B: 24 x 128, FFN 14336, in/out 48, text 4096; 704x1280, 121 frames = latents 48 x 31 x 44 "
            "x 80 = 27,280 tokens, a float32 timestep per token [1, 27280] (expand_timesteps), 512 text (128 valid, "
            "then zeros); 4 of 30 layers",
            dict(_WAN_14B, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336),
            ("num_layers",), ("blocks",), (30,), prod.wan22_ti2v),
        fused=_TWO, calls={"modulate": 8, "rms_norm_rope": 4}, untargeted=("WanTimeTextImageEmbedding",),
        targeted=frozenset({("wan_block", "WanTransformerBlock"), ("wan_qk_norm_rope", "WanAttnProcessor"),
                            ("gelu_gemm", "GELU")})),
    # in_channels = 2 latent + 2 condition-latent + 1 mask channels, as the pipeline concatenates them
    "hunyuanvideo15": Family(
        "HunyuanVideo15Transformer3DModel", dict(
            in_channels=5, out_channels=2, num_attention_heads=2, attention_head_dim=16, num_layers=1,
            num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=8,
            rope_axes_dim=(4, 6, 6)), tiny.hunyuanvideo15_inputs, Production(
            "HunyuanVideo 1.5: 16 x 128, FF 8192, text 3584 + ByT5 1472 + image 1152; 480x848, 121 frames = 31 x 30 "
            "x 53 = 49,290 tokens, 65 channels (latents, zero condition, zero mask), 1000 text tokens, 256 ByT5 "
            "(zeros, mask zeros: no quoted text), 729 image tokens (zeros: text-to-video); 4 of 54 layers",
            dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=4,
                 num_refiner_layers=2, mlp_ratio=4.0, text_embed_dim=3584, text_embed_2_dim=1472,
                 image_embed_dim=1152, rope_axes_dim=(16, 56, 56)),
            ("num_layers",), ("transformer_blocks",), (54,), prod.hunyuanvideo15),
        fused=_TWO, calls={"modulate": 13, "qk_norm_rope": 2},
        untargeted=("HunyuanVideo15IndividualTokenRefinerBlock",), targeted=frozenset({
            ("hunyuanvideo15", "HunyuanVideo15TransformerBlock"),
            ("hunyuanvideo15", "HunyuanVideo15AttnProcessor2_0"), ("adaln", "AdaLayerNormZero"),
            ("adaln", "AdaLayerNormContinuous"), ("gelu_gemm", "GELU")})),
    # the LTX-2.x checkpoints' split RoPE; LTX-2.3's gated attention and cross-attention modulation on. Cross dims
    # must equal each stream's width, and the audio heads the video heads (cross_attn_rope uses the video count).
    "ltx2": Family(
        "LTX2VideoTransformer3DModel", dict(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=4,
            audio_cross_attention_dim=8, num_layers=1, caption_channels=16, rope_type="split", gated_attn=True,
            cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True), tiny.ltx2_inputs,
        Production(
            "LTX-2: video 32 x 128, audio 32 x 64, caption 3840, split RoPE; 704x1280, 121 frames = 16 x 22 x 40 = "
            "14,080 video + 126 audio tokens (24 fps), 1024 text tokens (left-padded), sigma = timestep; 4 of 48",
            dict(in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128,
                 cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128,
                 audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
                 num_layers=4, caption_channels=3840, rope_type="split"),
            ("num_layers",), ("transformer_blocks",), (48,), prod.ltx2),
        # per block and stream (video, audio) 6 modulate (norm1; the self-attention residual + norm2; the text
        # residual + the cross-modal norm with each of its 2 modulations; the cross-modal residual + norm3; the
        # feed-forward residual); per attention (6 a block) one rms_norm_rope
        fused=_TWO, calls={"modulate": 24, "rms_norm_rope": 12},
        untargeted=("LTX2AdaLayerNormSingle", "LTX2AudioVideoRotaryPosEmbed"),
        targeted=frozenset({("gelu_gemm", "GELU"), ("ltx2", "LTX2VideoTransformerBlock"),
                            ("ltx2", "LTX2AudioVideoAttnProcessor")}),
        lora=(("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
              {"modulate": 24, "rms_norm_rope": 12})),
    # sum(mrope_section) = head dim / 2
    "ideogram4": Family(
        "Ideogram4Transformer2DModel", dict(
            in_channels=8, num_layers=1, attention_head_dim=16, num_attention_heads=2, intermediate_size=32,
            adaln_dim=16, llm_features_dim=24, mrope_section=(4, 2, 2)), tiny.ideogram4_inputs, Production(
            "Ideogram 4: 18 x 256 = 4608, FF 12288, LLM features 53248 per token; 1024x1024 = 4,096 image tokens "
            "after 2048 text positions (left-padded; a [1, 1, L, L] segment mask); 6 of 34 layers",
            dict(in_channels=128, num_layers=6, attention_head_dim=256, num_attention_heads=18,
                 intermediate_size=12288, adaln_dim=512, llm_features_dim=53248, rope_theta=5000000,
                 mrope_section=(24, 20, 20)), ("num_layers",), ("layers",), (34,), prod.ideogram4),
        fused=_TWO, calls={"rms_modulate": 6, "swiglu": 2, "qk_norm_rope": 2},
        untargeted=("Ideogram4MRoPE", "Ideogram4FinalLayer"),
        targeted=frozenset({("rms_sandwich_block", "Ideogram4TransformerBlock"),
                            ("rms_sandwich_qk_norm_rope", "Ideogram4AttnProcessor")})),
    # the released checkpoints' options (ca_rope, cross_gates, fix_modulation, text_token_padding); in_visual_dim 4:
    # the latents' channels (the pipeline adds as many condition channels and a mask: 9 in all)
    "kandinsky6": Family(
        "Kandinsky6Transformer3DModel", dict(
            in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, patch_size=(1, 2, 2),
            model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1, axes_dims=(4, 6, 6), in_audio_dim=4,
            out_audio_dim=4, ca_rope=True, cross_gates=True, fix_modulation=True, text_token_padding=True),
        tiny.kandinsky6_inputs, Production(
            "Kandinsky 6 (video + audio): 32 x 128 = 4096, FF 16384, 4 text blocks per modality; 480x864, 121 frames "
            "= 31 x 30 x 54 = 50,220 tokens (33 channels: latents, zero condition, zero mask), 218 audio latents, "
            "1024 text tokens with a bool mask, CLIP pooled 768; 4 of 60 visual blocks",
            dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=1024,
                 patch_size=(1, 2, 2), model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=4,
                 axes_dims=(32, 48, 48), in_audio_dim=20, out_audio_dim=20, ca_rope=True, cross_gates=True,
                 fix_modulation=True, text_token_padding=True),
            ("num_visual_blocks",), ("visual_transformer_blocks",), (60,), prod.kandinsky6),
        # 2 video/audio blocks, 1 text block per modality. Per text block 3 modulate, 1 qk_norm_rope; per video/audio
        # block 5 modulate and 1 + 2 + 2 qk_norm_rope per stream (self, text cross, cross-modal: q and k each)
        fused=dict(num_visual_blocks=2), calls={"modulate": 26, "qk_norm_rope": 22},
        targeted=frozenset({
            ("kandinsky6", "Kandinsky6FusedTransformerDecoderBlock"),
            ("kandinsky6", "Kandinsky6TransformerEncoderBlock"), ("kandinsky6", "Kandinsky6AttnProcessor"),
            ("gelu_gemm", "GELU")}),
        lora=(("to_query", "to_key", "to_value", "feed_forward.net.0.proj", "feed_forward.net.2",
               "visual_modulation.out_layer", "va_modulation.out_layer"), {"modulate": 26, "qk_norm_rope": 22})),
    # Chroma: FLUX.1's blocks with pruned modulation and a text mask (gate_residual), FLUX.1's processor and position
    # embedder. chroma-fused: 2 double + 2 single blocks, the prompt's last 2 tokens masked out.
    "chroma": Family(
        "ChromaTransformer2DModel", dict(
            patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8), approximator_num_channels=8,
            approximator_hidden_dim=32, approximator_layers=1), tiny.flux_like_inputs, Production(
            "Chroma: FLUX.1-dev's blocks with pruned modulation (approximator 64 -> 5120 x 5); 1024x1024 = 4096 "
            "tokens, 512 text (161 unmasked: the pipeline keeps one padding token); 4 of 19 double + 8 of 38 single",
            dict(patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
                 approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5),
            ("num_layers", "num_single_layers"), _FLUX_BLOCKS, (19, 38), prod.chroma),
        fused=dict(num_layers=2, num_single_layers=2), fused_options=dict(text_padding=2),
        calls={"modulate": 16, "qk_norm_rope": 4, "slices": 4},
        untargeted=("ChromaApproximator", "ChromaAdaLayerNormContinuousPruned"), targeted=frozenset({
            ("gate_residual", "ChromaTransformerBlock"), ("gate_residual", "ChromaSingleTransformerBlock"),
            ("qk_norm_rope", "FluxAttnProcessor"), ("rope_tables", "FluxPosEmbed"), ("gelu_gemm", "GELU")}),
        attention_kwargs="joint_attention_kwargs"),
    # MoE feed-forward (4 routed experts, 2 active) as in production; llama_layers: the Llama layer each block reads
    "hidream": Family(
        "HiDreamImageTransformer2DModel", dict(
            patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, caption_channels=[8, 8], text_emb_dim=8, num_routed_experts=4,
            num_activated_experts=2, axes_dims_rope=(4, 6, 6), max_resolution=(16, 16), llama_layers=[0, 1]),
        tiny.hidream_inputs, Production(
            "HiDream-I1-Full: 20 x 128 = 2560, MoE FF (4 routed experts, 2 active, + shared); 1024x1024 = 4096 "
            "tokens, 128 T5 + 32 Llama layers x 128 tokens, pooled 2048; 2 of 16 double + 4 of 32 single",
            dict(patch_size=2, in_channels=16, out_channels=16, num_layers=2, num_single_layers=4,
                 attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048,
                 num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(64, 32, 32),
                 max_resolution=(128, 128)), ("num_layers", "num_single_layers"),
            ("double_stream_blocks", "single_stream_blocks"), (16, 32), prod.hidream, prod.hidream_llama_layers),
        untargeted=("HiDreamImageTransformerBlock", "HiDreamImageSingleTransformerBlock", "MOEFeedForwardSwiGLU",
                    "HiDreamAttnProcessor"), targeted=frozenset()),
}  # fmt: skip

#: Every eager fusion pattern that targets a module of some family, in the registry's order.
FUSED_PATTERNS: Tuple[str, ...] = tuple(dict.fromkeys(
    pattern for family in FAMILIES.values() for pattern, _ in sorted(family.targeted or ())))


def _check() -> None:
    """A row that contradicts itself fails at import, not in the test that happens to read it."""
    for name, family in FAMILIES.items():
        if (family.fused is None) != (not family.calls):
            raise ValueError(f"registry row {name!r}: a fused config goes with its fused op calls")
        if family.fused is not None and family.targeted is None:
            raise ValueError(f"registry row {name!r}: a fused family pins what coverage reports")


_check()
