"""compile_warnings' targets: every forward-time warning site of diffusers' transformer models.

Built when diffusers is first imported (:class:`torchpatches._core.declare.LazyTargets`), not at
``import torchpatches``. The patch's banner is in ``__init__.py``.
"""
from __future__ import annotations

from typing import FrozenSet, Optional, Tuple, Union

from ..._core.declare import Site, Target
from ._replacements import dispatch_attention, lora_forward, rebind_deprecate, rebind_logger

__all__ = ["targets", "NOT_COVERED"]

_TRANSFORMERS = "diffusers.models.transformers"

#: The graph breaks each target's replacement removes (the doctor maps a user's breaks through these).
_LORA_SCALE = Site(
    "logger.warning", "`scale` in the attention kwargs without the PEFT backend",
    function="diffusers.utils.peft_utils:apply_lora_scale",
)

#: Modules that bind ``dispatch_attention_fn`` by name at import (``from ..attention_dispatch import
#: dispatch_attention_fn``) in diffusers 0.42.1, found with an AST scan of the installed package (0.40.0 and
#: 0.41.0 have a subset of these modules and no other).
_DISPATCH_ALIASES = tuple(
    f"diffusers.{module}:dispatch_attention_fn"
    for module in (
        "models.autoencoders.autoencoder_kl_kvae_audio", "models.autoencoders.autoencoder_kl_minimax_h3",
        "models.autoencoders.autoencoder_kl_minimax_h3_audio", "models.autoencoders.autoencoder_mmaudio",
        "models.autoencoders.autoencoder_rfd4_proteina", "models.autoencoders.autoencoder_same",
        "models.autoencoders.ltx2_diffusion_decoder", "models.condition_embedders.condition_embedder_anima",
        "models.controlnets.controlnet_z_image", "models.unets.unet_dreamlite", "pipelines.ltx2.duration_head",
        *(
            f"models.transformers.{name}"
            for name in (
                "ace_step_transformer", "minimax_music3_rvq_depth_decoder", "transformer_anyflow",
                "transformer_anyflow_far", "transformer_bria", "transformer_bria_fibo", "transformer_bria_fibo2",
                "transformer_chronoedit", "transformer_cosmos", "transformer_cosmos3", "transformer_ernie_image",
                "transformer_flux", "transformer_flux2", "transformer_flux3", "transformer_glm_image",
                "transformer_helios", "transformer_hunyuan_video", "transformer_hunyuan_video15",
                "transformer_hunyuanimage", "transformer_ideogram4", "transformer_joyimage",
                "transformer_joyimage_edit_plus", "transformer_kandinsky", "transformer_kandinsky6",
                "transformer_kandinsky6_sr", "transformer_krea2", "transformer_longcat_audio_dit",
                "transformer_longcat_image", "transformer_ltx", "transformer_ltx2", "transformer_minimax_h3",
                "transformer_minimax_music3", "transformer_motif_video", "transformer_nucleusmoe_image",
                "transformer_ovis_image", "transformer_prx", "transformer_qwenimage", "transformer_qwenimage21",
                "transformer_rfd4_proteina", "transformer_sana_video", "transformer_sana_wm",
                "transformer_sana_wm_refiner", "transformer_skyreels_v2", "transformer_stable_audio3",
                "transformer_wan", "transformer_wan_animate", "transformer_wan_animate_2", "transformer_z_image",
            )
        ),
    )
)


def _module(name: str) -> str:
    return name if name.startswith("diffusers.") else f"{_TRANSFORMERS}.{name}"


# The tables below list every forward-time warning site of diffusers 0.42.1's transformer models that
# compiled code reaches: tools/warning_sites.py finds them (an AST scan from every model's forward, through
# blocks, attention modules and processors), tests/patches/test_compile_warnings_sites.py checks that each is
# declared here or in NOT_COVERED. A fingerprint is that of diffusers 0.42.1's source, which 0.40.0 and 0.41.0
# share unless a tuple also names theirs (read side by side with 0.42.1's: they differ only in annotations or
# in code far from the warning site). On 0.40.0/0.41.0 the rest are skipped: by fingerprint where the source
# differs at a site or has no site yet (HiDream 0.40 has two more `deprecate()` calls; Z-Image has no
# `@apply_lora_scale` before 0.42), as "does not exist" where the model module is newer than the release
# (FLUX.3, RFD4-Proteina, SANA-WM refiner; QwenImage 2.1 on 0.40). `tools/fingerprint_diffusers.py` lists them.
Fingerprints = Union[str, Tuple[str, ...]]
_UNEXPECTED = "attention kwargs the processor does not take ('... are not expected by ...')"
_SCALE_IGNORED = "`scale` in `cross_attention_kwargs` (deprecated, ignored)"
_MIXED_SIZES = "a batch of differently sized images (`img_shapes` / `video_fhw`)"
_IDS_3D = "3-D `img_ids`/`txt_ids` (deprecated form)"
_EXTRA_ARGS = "extra positional arguments or `scale=` (deprecated)"
_LOG, _DEPRECATE = "logger.warning", "deprecate"

#: ``@apply_lora_scale`` forwards (their wrapper warns about ``scale`` without PEFT): (module, class,
#: fingerprint of wrapper + forward, what the forward's own ``logger`` warns about or None).
_LORA_FORWARDS: Tuple[Tuple[str, str, Fingerprints, Optional[str]], ...] = (
    ("ace_step_transformer", "AceStepTransformer1DModel", "bf507fdbd6a45746", None),
    ("auraflow_transformer_2d", "AuraFlowTransformer2DModel", "0cc55264b361860e", None),
    ("cogvideox_transformer_3d", "CogVideoXTransformer3DModel", "bae10d5d34075350", None),
    ("consisid_transformer_3d", "ConsisIDTransformer3DModel", "c73efa7dd823ada0", None),
    ("sana_transformer", "SanaTransformer2DModel", "19f8298b1583860c", None),
    ("transformer_anyflow", "AnyFlowTransformer3DModel", "590c5592d2418f25", None),
    ("transformer_anyflow_far", "AnyFlowFARTransformer3DModel", "9f360ca9c3d525d4", None),
    ("transformer_bria", "BriaTransformer2DModel", "4d3b22327482b6f5", None),
    ("transformer_bria_fibo", "BriaFiboTransformer2DModel", "4221587ca9280685", None),
    ("transformer_chroma", "ChromaTransformer2DModel", "10619001a488e92a", _IDS_3D),
    ("transformer_chronoedit", "ChronoEditTransformer3DModel", "f3745a1886bf90bd", None),
    ("transformer_cogview4", "CogView4Transformer2DModel", "f37a63b3e97b48be", None),
    ("transformer_flux2", "Flux2Transformer2DModel", "cbc1f47e20a2c806", None),
    ("transformer_flux3", "Flux3Transformer2DModel", "eb9f81d0aa454c3c", None),
    ("transformer_flux", "FluxTransformer2DModel", "1a7391906fba711b", _IDS_3D),
    ("transformer_helios", "HeliosTransformer3DModel", "f175632efdb26241", None),
    ("transformer_hidream_image", "HiDreamImageTransformer2DModel", "6c1fe1e5efb72294", None),
    ("transformer_hunyuan_video15", "HunyuanVideo15Transformer3DModel", "1fc1811383ec9587", None),
    ("transformer_hunyuan_video", "HunyuanVideoTransformer3DModel", "afe0aaa4cdd988b3", None),
    ("transformer_hunyuan_video_framepack", "HunyuanVideoFramepackTransformer3DModel", "8dd9a4c67d90e227", None),
    ("transformer_hunyuanimage", "HunyuanImageTransformer2DModel", "80621a0815e45e54", None),
    ("transformer_ideogram4", "Ideogram4Transformer2DModel", "3af808a17896c5d1", None),
    ("transformer_krea2", "Krea2Transformer2DModel", "9b25f943923544c4", None),
    ("transformer_ltx2", "LTX2VideoTransformer3DModel", ("7d1d6389aa8f084b", "49d49ef3983b5fc1"), None),  # 0.40: no keyframes mask
    ("transformer_ltx", "LTXVideoTransformer3DModel", "a33780b96f431548", None),
    ("transformer_lumina2", "Lumina2Transformer2DModel", "20abc948bbed471a", None),
    ("transformer_minimax_h3", "MiniMaxH3Transformer3DModel", "0e2893af52f85868", None),
    ("transformer_mochi", "MochiTransformer3DModel", "6c75f4f98ea62d5d", None),
    ("transformer_ovis_image", "OvisImageTransformer2DModel", "b4f18f0b38a904f9", _IDS_3D),
    ("transformer_qwenimage21", "QwenImage21Transformer2DModel", "2b0c75f3ef0d3bf6", None),
    ("transformer_qwenimage", "QwenImageTransformer2DModel", "4f954edbab4b5b54", None),
    ("transformer_rfd4_proteina", "RFD4ProteinaTransformer", "7b0fe8b7f8f1f3e2", None),
    ("transformer_sana_video", "SanaVideoTransformer3DModel", "3be4b6c918c4af1c", None),
    ("transformer_sana_wm_refiner", "SanaWMLTX2RefinerTransformer3DModel", "c9463101de786cf4", None),
    ("transformer_sd3", "SD3Transformer2DModel", "d3bb78d8d615204e", None),
    ("transformer_skyreels_v2", "SkyReelsV2Transformer3DModel", "ae7d2225d2765543", None),
    ("transformer_wan", "WanTransformer3DModel", "8eb2cf7cb3c02083", None),
    ("transformer_wan_animate", "WanAnimateTransformer3DModel", "95bc400c19de3803", None),
    ("transformer_wan_vace", "WanVACETransformer3DModel", "dc361b75e703ac30", None),
    ("transformer_z_image", "ZImageTransformer2DModel", "c06c6945e543572f", None),
)

#: Functions whose own call breaks the graph: (module, qualname, call, fingerprint, when). A ``logger.warning``
#: site gets its module's ``logger`` made compile-safe, a ``deprecate`` site a compile-safe ``deprecate()``.
_OWN_SITES: Tuple[Tuple[str, str, str, Fingerprints, str], ...] = (
    ("diffusers.models.attention", "BasicTransformerBlock.forward", _LOG, "9cfc6111a7fd5580", _SCALE_IGNORED),
    ("diffusers.models.attention_processor", "Attention.forward", _LOG, "d3822449559212cb", _UNEXPECTED),
    ("transformer_2d", "Transformer2DModel.forward", _LOG, ("7a3829f24ddbfdf3", "2008d01bcd13d317"), _SCALE_IGNORED),  # 0.40: no annotation
    ("transformer_2d_dreamlite", "BasicTransformerBlockDreamLite.forward", _LOG, "0e9a4641f8cc0075", _SCALE_IGNORED),
    ("transformer_2d_dreamlite", "DreamLiteTransformer2DModel.forward", _LOG, ("3c78e93d6dbfd296", "3fc2caca8d3dbd96"), _SCALE_IGNORED),  # 0.40: no annotation
    ("transformer_bria", "BriaAttention.forward", _LOG, "492c7eeb65bc6a4e", _UNEXPECTED),
    ("transformer_bria_fibo", "BriaFiboAttention.forward", _LOG, "d12ce2e9a0852e06", _UNEXPECTED),
    ("transformer_ernie_image", "ErnieImageAttention.forward", _LOG, "9c90a5d96b592148", _UNEXPECTED),
    ("transformer_flux2", "Flux2Attention.forward", _LOG, "7c05eda1d782aa24", _UNEXPECTED),
    ("transformer_flux2", "Flux2ParallelSelfAttention.forward", _LOG, "7d9744609d245c93", _UNEXPECTED),
    ("transformer_flux", "FluxAttention.forward", _LOG, "d12ce2e9a0852e06", _UNEXPECTED),
    ("transformer_ideogram4", "Ideogram4Attention.forward", _LOG, "9e82e6282931f899", _UNEXPECTED),
    ("transformer_joyimage", "JoyImageAttention.forward", _LOG, "1c9c639e98522c44", _UNEXPECTED),
    ("transformer_kandinsky", "Kandinsky5Attention.forward", _LOG, "8f52656e6317b9d2", _UNEXPECTED),
    ("transformer_krea2", "Krea2Attention.forward", _LOG, "9e82e6282931f899", _UNEXPECTED),
    ("transformer_longcat_image", "LongCatImageAttention.forward", _LOG, "d12ce2e9a0852e06", _UNEXPECTED),
    ("transformer_ltx2", "LTX2Attention.forward", _LOG, "f6a037079b264fd9", _UNEXPECTED),
    ("transformer_ltx", "LTXAttention.forward", _LOG, "1ea4c82063363893", _UNEXPECTED),
    ("transformer_motif_video", "MotifVideoAttention.forward", _LOG, "7c05eda1d782aa24", _UNEXPECTED),
    ("transformer_motif_video", "MotifVideoTransformer3DModel.forward", _LOG, "07fa6be52ee7dad3", "`scale` in the attention kwargs without the PEFT backend"),
    ("transformer_nucleusmoe_image", "NucleusMoEEmbedRope.forward", _LOG, "d002802563c8a936", _MIXED_SIZES),
    ("transformer_ovis_image", "OvisImageAttention.forward", _LOG, "d12ce2e9a0852e06", _UNEXPECTED),
    ("transformer_qwenimage", "QwenEmbedLayer3DRope.forward", _LOG, "e96e9709468af4d1", _MIXED_SIZES),
    ("transformer_qwenimage", "QwenEmbedRope.forward", _LOG, "b6d20a31bf7341f3", _MIXED_SIZES),
    ("transformer_sana_wm_refiner", "SanaWMLTX2Attention.forward", _LOG, "f6a037079b264fd9", _UNEXPECTED),
    ("diffusers.models.activations", "GEGLU.forward", _DEPRECATE, ("dc945fffaaaf023e", "4a2cbfac97b29e60"), _EXTRA_ARGS),  # 0.40: no annotation
    ("diffusers.models.attention", "FeedForward.forward", _DEPRECATE, "2534be46672c7017", _EXTRA_ARGS),
    ("diffusers.models.attention_processor", "AttnProcessor.__call__", _DEPRECATE, "372459933681be64", _EXTRA_ARGS),
    ("diffusers.models.attention_processor", "AttnProcessor2_0.__call__", _DEPRECATE, "d5a292e89ccd77a2", _EXTRA_ARGS),
    ("transformer_2d", "Transformer2DModelOutput.__init__", _DEPRECATE, "31f248c266ad4d7a", "`return_dict=True` in DreamLite (it builds the deprecated `transformer_2d.Transformer2DModelOutput`)"),
)

#: Warning sites in transformer modules that compiled code never reaches, so they break no graph:
#: (module, qualname, call, why). The site test requires every site it finds to be patched or listed here.
NOT_COVERED: Tuple[Tuple[str, str, str, str], ...] = (
    ("transformer_2d", "Transformer2DModel.__init__", "deprecate", "construction time (`norm_type` combination)"),
    ("transformer_sana_wm", "SanaWMTransformer3DModel.__init__", "logger.info", "construction time"),
    ("transformer_wan", "WanAttnProcessor2_0.__new__", "deprecate",
     "construction time: the deprecated processor name builds a `WanAttnProcessor` before anything is compiled"),
    ("transformer_chronoedit", "WanAttnProcessor2_0.__new__", "deprecate", "construction time (as Wan's)"),
    ("transformer_skyreels_v2", "SkyReelsV2AttnProcessor2_0.__new__", "deprecate", "construction time (as Wan's)"),
    ("transformer_ltx", "LTXVideoAttentionProcessor2_0.__new__", "deprecate", "construction time (as Wan's)"),
    ("transformer_kandinsky6_sr", "_warn_uncompiled_flex_attention", "logger.warning",
     "called only under `if not torch.compiler.is_compiling()`: Dynamo never traces it"),
    ("transformer_qwenimage21", "QwenImage21FlexAttnProcessor.__call__", "logger.warning",
     "under `if ... not torch.compiler.is_compiling()`: Dynamo never traces it"),
)


def _fingerprints(value: Fingerprints) -> FrozenSet[str]:
    return frozenset({value} if isinstance(value, str) else value)


def targets() -> Tuple[Target, ...]:
    targets = []
    for module, cls, fingerprint, own_warning in _LORA_FORWARDS:
        sites = (_LORA_SCALE, Site("logger.warning", own_warning)) if own_warning else (_LORA_SCALE,)
        targets.append(Target(
            f"{_module(module)}:{cls}.forward",
            make_replacement=lora_forward(_module(module) if own_warning else None),
            fingerprints=_fingerprints(fingerprint),
            sites=sites,
        ))
    for module, qualname, call, fingerprint, when in _OWN_SITES:
        targets.append(Target(
            f"{_module(module)}:{qualname}",
            make_replacement=rebind_logger(_module(module)) if call == _LOG else rebind_deprecate,
            fingerprints=_fingerprints(fingerprint),
            sites=(Site(call, when),),
        ))
    targets.append(Target(
        "diffusers.models.attention_dispatch:dispatch_attention_fn",
        make_replacement=dispatch_attention,
        fingerprints=frozenset({
            "cd20137f05eb6b2b",  # diffusers 0.42.0, 0.42.1
            "39d8d5983a78d41b",  # diffusers 0.38.0-0.41.0: `AttentionBackendName(backend)` unconditionally
        }),
        aliases=_DISPATCH_ALIASES,
        sites=(Site("logger.warning", "DIFFUSERS_ATTN_CHECKS=1 with arguments the backend does not take"),),
    ))
    return tuple(targets)
