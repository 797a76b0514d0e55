"""compile_warnings: diffusers' warnings in forward, emitted at trace time instead of breaking the graph.

What goes wrong upstream
    Dynamo cannot trace ``logging.Logger`` methods or ``warnings.warn``; a call in a compiled forward
    splits the graph there and ``fullgraph=True`` fails. In diffusers 0.42.1 (measured on tiny
    configs, torch 2.11 and 2.13 agree; table in docs/graph_breaks.md):
    - FLUX.1 ``FluxTransformer2DModel.forward`` with 3-D ``img_ids``/``txt_ids`` (deprecated form):
      ``logger.warning`` at transformer_flux.py:737 and :743 -> 3 graphs, 2 breaks. +2.9% step time
      at FLUX.1-dev size on one H200 (134.0 vs 130.2 ms).
    - ``joint_attention_kwargs`` with a key the processor does not take: ``logger.warning`` in
      ``FluxAttention.forward`` (transformer_flux.py:351), ``Flux2Attention.forward`` (:565) and
      ``Flux2ParallelSelfAttention.forward`` (:800), once per attention layer.
    - ``joint_attention_kwargs={"scale": s}`` / ``attention_kwargs`` without PEFT: ``logger.warning`` in
      the ``@apply_lora_scale`` wrapper (peft_utils.py:313) of FLUX.1, FLUX.2, SD3, QwenImage, Wan and
      HunyuanVideo. ``torch._dynamo.explain`` reports 0 breaks here (the break happens before its first
      graph), yet ``fullgraph=True`` fails.
    - ``deprecate(...)`` -> ``warnings.warn`` (deprecation_utils.py:98) in ``FeedForward.forward``
      (attention.py:1739) when it is given extra arguments.
    - ``DIFFUSERS_ATTN_CHECKS=1`` on torch 2.11 and 2.12: compilation aborts with a bare ``AssertionError``
      in Dynamo (variables/base.py) on ``set(kwargs) - set(...)`` (attention_dispatch.py:442); the
      ``logger.warning`` after it (:444) would break the graph when kwargs are really removed.
    The same kinds of site exist across diffusers: tools/warning_sites.py scans every transformer model's
    forward (through its blocks, attention modules, processors and decorators) and finds 77 sites in 71
    functions of 0.42.1 -- 40 ``@apply_lora_scale`` forwards, 17 "not expected by" attention forwards
    (15 transformer files and ``Attention``), 3-D ids in Chroma and Ovis-Image, differently sized images
    in the QwenImage and NucleusMoE RoPE modules, an inline scale warning in MotifVideo, ``scale`` in
    ``cross_attention_kwargs`` (Transformer2DModel/PixArt, BasicTransformerBlock, DreamLite), ``deprecate()``
    in GEGLU, AttnProcessor(2_0) and the deprecated ``transformer_2d.Transformer2DModelOutput`` that
    DreamLite builds on its default ``return_dict=True``.
    Every one is a target below; the 8 sites compiled code never reaches (construction time, branches
    under ``not torch.compiler.is_compiling()``) are in ``NOT_COVERED`` with the reason, and
    tests/patches/test_compile_warnings_sites.py fails when a release adds a site that is neither.
    No upstream issue or fix as of diffusers 0.42.1; sglang fixed its own FLUX copy the same way
    (PR #23648: a trace-time warning helper plus warn-once).

What the patch changes
    Each target is replaced by a copy compiled from the *same source* (the fingerprint below proves
    it is the source we read) in which the global ``logger`` -- or ``deprecate`` -- resolves to a
    compile-safe stand-in held in a closure: :class:`torchpatches.compile.OnceLogger` (``warning``
    goes through ``warning_once``: emitted once per distinct message, in eager on the same logger
    with the same level and text, under compile at trace time with nothing in the graph) and
    :func:`torchpatches._warning_sites.compile_safe_deprecate`. Each target declares the sites it removes
    (:class:`torchpatches.Site`), which is how ``torchpatches doctor`` maps a graph break to this patch.
    Every other global is read live
    from the diffusers module, so the copies see other patches (``rope``) and monkeypatches.
    One copy also has one line edited: ``dispatch_attention_fn`` computes ``removed_kwargs`` with a
    set comprehension (the same set) instead of ``set(kwargs) - set(...)``, which makes the
    ``DIFFUSERS_ATTN_CHECKS=1`` path compile on torch 2.11 and 2.12; it is rebound in the 59 modules that
    import it by name.

    Why copies of functions rather than swapping each module's ``logger``: a swapped module logger
    would change every warning in the module (loaders, config code), and the registry can only
    verify (fingerprint) code, not a Logger object. A copy changes only the sites we read.

    Behaviour change in eager: these warnings are emitted once per distinct text (like
    ``transformers``' ``warning_once``), not on every call.

Versions
    diffusers >= 0.40, < 0.43. Every target is fingerprinted on 0.42.1 (``tools/fingerprint_diffusers.py``);
    on 0.40.0 and 0.41.0 the targets that exist there apply where their source is one of the fingerprints
    (the tables below say which 0.40 sources were read and accepted; ``dispatch_attention_fn`` has two:
    0.42 skips an ``Enum`` call), and the rest are skipped with the reason: Z-Image's forward on 0.40/0.41
    and HiDream's on 0.40 by fingerprint, the model modules those releases do not have as "does not exist".
    Tests run on 0.42.1, 0.41.0 and 0.40.0. Before 0.40 the SD3 and Wan forwards, before 0.39 the
    FLUX.1/FLUX.2/Qwen/Hunyuan forwards and before 0.37 every target have other sources, and the
    ``@apply_lora_scale`` wrapper (the scale warning) exists only since 0.37: those releases are outside the gate.
    torch >= 2.11 (tested on 2.11, 2.13, 2.15 in CI; 2.12.1 and 2.14.1 by hand).

    When the running torch's Dynamo traces both kinds of site itself (measured once per process,
    ``_dynamo_warning_sites``; true with ``torch._dynamo.config.ignore_logging_functions`` set to
    ``{logging.Logger.warning, warnings.warn}``, false by default through torch 2.15.0), the patch
    reports ``skipped: torch <version> traces these sites itself``.

When to delete
    When diffusers emits these warnings through a compile-safe helper (or stops warning in forward),
    and the fingerprints stop matching: the patch then reports ``skipped``. Or when torch traces
    both kinds of site by default (the probe above then skips it).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, FrozenSet, Optional, Tuple, Union

from .._declare import Patch, Site, Target

__all__ = ["PATCH"]

_TRANSFORMERS = "diffusers.models.transformers"

#: The graph breaks each target's replacement removes (the doctor maps a user's breaks through these).
_LORA_SCALE = Site(
    "logger.warning", "`scale` in the attention kwargs without the PEFT backend",
    function="diffusers.utils.peft_utils:apply_lora_scale",
)


def _module_logger(module_name: str) -> Any:
    from .._warning_sites import once_logger_for

    return once_logger_for(sys.modules[module_name].logger)


def _rebind_logger(module_name: str) -> Callable[[Any], Any]:
    """A make_replacement: the original function with its module's ``logger`` made compile-safe."""

    def make(original: Any) -> Any:
        from .._warning_sites import rebind_globals

        return rebind_globals(original, {"logger": _module_logger(module_name)})

    return make


def _lora_forward(module_name: Optional[str]) -> Callable[[Any], Any]:
    """A make_replacement for an ``@apply_lora_scale`` forward: the wrapper's scale warning, and
    (with ``module_name``) the forward's own ``logger`` sites."""

    def make(original: Any) -> Any:
        from .._warning_sites import lora_wrapper_replacement

        inner = {"logger": _module_logger(module_name)} if module_name else None
        return lora_wrapper_replacement(original, _module_logger("diffusers.utils.peft_utils"), inner)

    return make


#: DIFFUSERS_ATTN_CHECKS=1: Dynamo 2.11 and 2.12 fail (a bare AssertionError, not a graph break) on this
#: set difference; the comprehension is the same set and traces on 2.11 through 2.15.
_ATTN_CHECKS_EDIT = (
    "removed_kwargs = set(kwargs) - set(_AttentionBackendRegistry._supported_arg_names[backend_name])",
    "removed_kwargs = {k for k in kwargs if k not in _AttentionBackendRegistry._supported_arg_names[backend_name]}",
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


def _dispatch_attention(original: Any) -> Any:
    from .._warning_sites import rebind_globals

    logger = _module_logger("diffusers.models.attention_dispatch")
    return rebind_globals(original, {"logger": logger}, edits=(_ATTN_CHECKS_EDIT,))


def _rebind_deprecate(original: Any) -> Any:
    """A make_replacement: the original function with ``deprecate`` made compile-safe."""
    from .._warning_sites import compile_safe_deprecate, rebind_globals

    deprecation_utils = sys.modules["diffusers.utils.deprecation_utils"]
    return rebind_globals(original, {"deprecate": compile_safe_deprecate(deprecation_utils.deprecate)})


def _torch_traces_sites() -> Optional[str]:
    """Skip when the running torch compiles both kinds of site without a graph break (measured)."""
    import torch

    from ._dynamo_warning_sites import torch_traces_warning_sites

    return f"torch {torch.__version__} traces these sites itself" if torch_traces_warning_sites() else None


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

#: Functions whose own ``logger.warning`` breaks the graph: (module, qualname, fingerprint, when).
_LOGGER_SITES: Tuple[Tuple[str, str, Fingerprints, str], ...] = (
    ("diffusers.models.attention", "BasicTransformerBlock.forward", "9cfc6111a7fd5580", _SCALE_IGNORED),
    ("diffusers.models.attention_processor", "Attention.forward", "d3822449559212cb", _UNEXPECTED),
    ("transformer_2d", "Transformer2DModel.forward", ("7a3829f24ddbfdf3", "2008d01bcd13d317"), _SCALE_IGNORED),  # 0.40: no annotation
    ("transformer_2d_dreamlite", "BasicTransformerBlockDreamLite.forward", "0e9a4641f8cc0075", _SCALE_IGNORED),
    ("transformer_2d_dreamlite", "DreamLiteTransformer2DModel.forward", ("3c78e93d6dbfd296", "3fc2caca8d3dbd96"), _SCALE_IGNORED),  # 0.40: no annotation
    ("transformer_bria", "BriaAttention.forward", "492c7eeb65bc6a4e", _UNEXPECTED),
    ("transformer_bria_fibo", "BriaFiboAttention.forward", "d12ce2e9a0852e06", _UNEXPECTED),
    ("transformer_ernie_image", "ErnieImageAttention.forward", "9c90a5d96b592148", _UNEXPECTED),
    ("transformer_flux2", "Flux2Attention.forward", "7c05eda1d782aa24", _UNEXPECTED),
    ("transformer_flux2", "Flux2ParallelSelfAttention.forward", "7d9744609d245c93", _UNEXPECTED),
    ("transformer_flux", "FluxAttention.forward", "d12ce2e9a0852e06", _UNEXPECTED),
    ("transformer_ideogram4", "Ideogram4Attention.forward", "9e82e6282931f899", _UNEXPECTED),
    ("transformer_joyimage", "JoyImageAttention.forward", "1c9c639e98522c44", _UNEXPECTED),
    ("transformer_kandinsky", "Kandinsky5Attention.forward", "8f52656e6317b9d2", _UNEXPECTED),
    ("transformer_krea2", "Krea2Attention.forward", "9e82e6282931f899", _UNEXPECTED),
    ("transformer_longcat_image", "LongCatImageAttention.forward", "d12ce2e9a0852e06", _UNEXPECTED),
    ("transformer_ltx2", "LTX2Attention.forward", "f6a037079b264fd9", _UNEXPECTED),
    ("transformer_ltx", "LTXAttention.forward", "1ea4c82063363893", _UNEXPECTED),
    ("transformer_motif_video", "MotifVideoAttention.forward", "7c05eda1d782aa24", _UNEXPECTED),
    ("transformer_motif_video", "MotifVideoTransformer3DModel.forward", "07fa6be52ee7dad3", "`scale` in the attention kwargs without the PEFT backend"),
    ("transformer_nucleusmoe_image", "NucleusMoEEmbedRope.forward", "d002802563c8a936", _MIXED_SIZES),
    ("transformer_ovis_image", "OvisImageAttention.forward", "d12ce2e9a0852e06", _UNEXPECTED),
    ("transformer_qwenimage", "QwenEmbedLayer3DRope.forward", "e96e9709468af4d1", _MIXED_SIZES),
    ("transformer_qwenimage", "QwenEmbedRope.forward", "b6d20a31bf7341f3", _MIXED_SIZES),
    ("transformer_sana_wm_refiner", "SanaWMLTX2Attention.forward", "f6a037079b264fd9", _UNEXPECTED),
)

#: Functions calling ``deprecate(...)`` in forward: (module, qualname, fingerprint, when).
_DEPRECATE_SITES: Tuple[Tuple[str, str, Fingerprints, str], ...] = (
    ("diffusers.models.activations", "GEGLU.forward", ("dc945fffaaaf023e", "4a2cbfac97b29e60"), _EXTRA_ARGS),  # 0.40: no annotation
    ("diffusers.models.attention", "FeedForward.forward", "2534be46672c7017", _EXTRA_ARGS),
    ("diffusers.models.attention_processor", "AttnProcessor.__call__", "372459933681be64", _EXTRA_ARGS),
    ("diffusers.models.attention_processor", "AttnProcessor2_0.__call__", "d5a292e89ccd77a2", _EXTRA_ARGS),
    ("transformer_2d", "Transformer2DModelOutput.__init__", "31f248c266ad4d7a", "`return_dict=True` in DreamLite (it builds the deprecated `transformer_2d.Transformer2DModelOutput`)"),
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


def _targets() -> Tuple[Target, ...]:
    targets = []
    for module, cls, fingerprint, own_warning in _LORA_FORWARDS:
        sites = (_LORA_SCALE, Site("logger.warning", own_warning)) if own_warning else (_LORA_SCALE,)
        targets.append(Target(
            f"{_module(module)}:{cls}.forward",
            make_replacement=_lora_forward(_module(module) if own_warning else None),
            fingerprints=_fingerprints(fingerprint),
            sites=sites,
        ))
    for module, qualname, fingerprint, when in _LOGGER_SITES:
        targets.append(Target(
            f"{_module(module)}:{qualname}",
            make_replacement=_rebind_logger(_module(module)),
            fingerprints=_fingerprints(fingerprint),
            sites=(Site("logger.warning", when),),
        ))
    for module, qualname, fingerprint, when in _DEPRECATE_SITES:
        targets.append(Target(
            f"{_module(module)}:{qualname}",
            make_replacement=_rebind_deprecate,
            fingerprints=_fingerprints(fingerprint),
            sites=(Site("deprecate", when),),
        ))
    targets.append(Target(
        "diffusers.models.attention_dispatch:dispatch_attention_fn",
        make_replacement=_dispatch_attention,
        fingerprints=frozenset({
            "cd20137f05eb6b2b",  # diffusers 0.42.0, 0.42.1
            "39d8d5983a78d41b",  # diffusers 0.38.0-0.41.0: `AttentionBackendName(backend)` unconditionally
        }),
        aliases=_DISPATCH_ALIASES,
        sites=(Site("logger.warning", "DIFFUSERS_ATTN_CHECKS=1 with arguments the backend does not take"),),
    ))
    return tuple(targets)


PATCH = Patch(
    name="compile_warnings",
    summary="diffusers' forward-time warnings (every transformer model of 0.42.x) without graph breaks",
    targets=_targets(),
    requires={"diffusers": ">=0.40,<0.43", "torch": ">=2.11"},
    verifies={  # code the replacements rely on but do not replace
        # the @apply_lora_scale wrapper (peft_utils.py:305-330), rebuilt for every LoRA forward in _LORA_FORWARDS
        "diffusers.utils.peft_utils:apply_lora_scale": frozenset({"775c02085a619be9"}),  # 0.37.0-0.42.1
        # deprecate() is called by the compile-safe stand-in in eager and reimplemented under compile
        "diffusers.utils.deprecation_utils:deprecate": frozenset({"0fe3954a5404817c"}),  # 0.37.0-0.42.1
    },
    precondition=_torch_traces_sites,
)
