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
    No upstream issue or fix as of diffusers 0.42.1; sglang fixed its own FLUX copy the same way
    (PR #23648: a trace-time warning helper plus warn-once).

What the patch changes
    Each target is replaced by a copy compiled from the *same source* (the fingerprint below proves
    it is the source we read) in which the global ``logger`` -- or ``deprecate`` -- resolves to a
    compile-safe stand-in held in a closure: :class:`torchpatches.compile.OnceLogger` (``warning``
    goes through ``warning_once``: emitted once per distinct message, in eager on the same logger
    with the same level and text, under compile at trace time with nothing in the graph) and
    :func:`torchpatches._warning_sites.compile_safe_deprecate`. Every other global is read live
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
    diffusers >= 0.40, < 0.43: every target's source in 0.40.0, 0.41.0, 0.42.0 and 0.42.1 is one of
    the fingerprints below (``dispatch_attention_fn`` has two: 0.42 skips an ``Enum`` call); tests run
    on 0.42.1 and 0.41.0. Before 0.40 the SD3 and Wan forwards, before 0.39 the FLUX.1/FLUX.2/Qwen/
    Hunyuan forwards and before 0.37 every target have other sources, and the ``@apply_lora_scale``
    wrapper (the scale warning) exists only since 0.37: those releases are outside the gate.
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
from typing import Any, Callable, Optional

from .._declare import Patch, Site, Target

__all__ = ["PATCH"]

_TRANSFORMERS = "diffusers.models.transformers"

#: The graph breaks each target's replacement removes (the doctor maps a user's breaks through these).
_UNEXPECTED_KWARGS = Site("logger.warning", "attention kwargs the processor does not take ('... are not expected by')")
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


def _feed_forward(original: Any) -> Any:
    from .._warning_sites import compile_safe_deprecate, rebind_globals

    deprecation_utils = sys.modules["diffusers.utils.deprecation_utils"]
    return rebind_globals(original, {"deprecate": compile_safe_deprecate(deprecation_utils.deprecate)})


def _torch_traces_sites() -> Optional[str]:
    """Skip when the running torch compiles both kinds of site without a graph break (measured)."""
    import torch

    from ._dynamo_warning_sites import torch_traces_warning_sites

    return f"torch {torch.__version__} traces these sites itself" if torch_traces_warning_sites() else None


PATCH = Patch(
    name="compile_warnings",
    summary="diffusers' forward-time warnings (FLUX.1/.2, SD3, QwenImage, Wan, HunyuanVideo) without graph breaks",
    targets=(
        Target(
            f"{_TRANSFORMERS}.transformer_flux:FluxAttention.forward",
            make_replacement=_rebind_logger(f"{_TRANSFORMERS}.transformer_flux"),
            fingerprints=frozenset({"d12ce2e9a0852e06"}),  # diffusers 0.37.0-0.42.1
            sites=(_UNEXPECTED_KWARGS,),
        ),
        Target(
            f"{_TRANSFORMERS}.transformer_flux:FluxTransformer2DModel.forward",
            make_replacement=_lora_forward(f"{_TRANSFORMERS}.transformer_flux"),
            fingerprints=frozenset({"1a7391906fba711b"}),  # diffusers 0.39.0-0.42.1 (@apply_lora_scale wrapper + forward)
            sites=(Site("logger.warning", "3-D `img_ids`/`txt_ids` (deprecated form)"), _LORA_SCALE),
        ),
        Target(
            f"{_TRANSFORMERS}.transformer_flux2:Flux2Attention.forward",
            make_replacement=_rebind_logger(f"{_TRANSFORMERS}.transformer_flux2"),
            fingerprints=frozenset({"7c05eda1d782aa24"}),  # diffusers 0.37.0-0.42.1
            sites=(_UNEXPECTED_KWARGS,),
        ),
        Target(
            f"{_TRANSFORMERS}.transformer_flux2:Flux2ParallelSelfAttention.forward",
            make_replacement=_rebind_logger(f"{_TRANSFORMERS}.transformer_flux2"),
            fingerprints=frozenset({"7d9744609d245c93"}),  # diffusers 0.37.0-0.42.1
            sites=(_UNEXPECTED_KWARGS,),
        ),
        Target(
            f"{_TRANSFORMERS}.transformer_flux2:Flux2Transformer2DModel.forward",
            make_replacement=_lora_forward(None),
            fingerprints=frozenset({"cbc1f47e20a2c806"}),  # diffusers 0.39.0-0.42.1 (wrapper + forward)
            sites=(_LORA_SCALE,),
        ),
        Target(
            f"{_TRANSFORMERS}.transformer_sd3:SD3Transformer2DModel.forward",
            make_replacement=_lora_forward(None),
            fingerprints=frozenset({"d3bb78d8d615204e"}),  # diffusers 0.40.0-0.42.1 (wrapper + forward)
            sites=(_LORA_SCALE,),
        ),
        Target(
            f"{_TRANSFORMERS}.transformer_qwenimage:QwenImageTransformer2DModel.forward",
            make_replacement=_lora_forward(None),
            fingerprints=frozenset({"4f954edbab4b5b54"}),  # diffusers 0.39.0-0.42.1 (wrapper + forward)
            sites=(_LORA_SCALE,),
        ),
        Target(
            f"{_TRANSFORMERS}.transformer_wan:WanTransformer3DModel.forward",
            make_replacement=_lora_forward(None),
            fingerprints=frozenset({"8eb2cf7cb3c02083"}),  # diffusers 0.40.0-0.42.1 (wrapper + forward)
            sites=(_LORA_SCALE,),
        ),
        Target(
            f"{_TRANSFORMERS}.transformer_hunyuan_video:HunyuanVideoTransformer3DModel.forward",
            make_replacement=_lora_forward(None),
            fingerprints=frozenset({"afe0aaa4cdd988b3"}),  # diffusers 0.39.0-0.42.1 (wrapper + forward)
            sites=(_LORA_SCALE,),
        ),
        Target(
            "diffusers.models.attention_processor:Attention.forward",
            make_replacement=_rebind_logger("diffusers.models.attention_processor"),
            fingerprints=frozenset({"d3822449559212cb"}),  # diffusers 0.37.0-0.42.1
            sites=(_UNEXPECTED_KWARGS,),
        ),
        Target(
            "diffusers.models.attention_dispatch:dispatch_attention_fn",
            make_replacement=_dispatch_attention,
            fingerprints=frozenset({
                "cd20137f05eb6b2b",  # diffusers 0.42.0, 0.42.1
                "39d8d5983a78d41b",  # diffusers 0.38.0-0.41.0: `AttentionBackendName(backend)` unconditionally
            }),
            sites=(Site("logger.warning", "DIFFUSERS_ATTN_CHECKS=1 with arguments the backend does not take"),),
            aliases=_DISPATCH_ALIASES,
        ),
        Target(
            "diffusers.models.attention:FeedForward.forward",
            make_replacement=_feed_forward,
            fingerprints=frozenset({"2534be46672c7017"}),  # diffusers 0.35.0-0.42.1
            sites=(Site("deprecate", "extra arguments (`scale=`) to FeedForward"),),
        ),
    ),
    requires={"diffusers": ">=0.40,<0.43", "torch": ">=2.11"},
    verifies={  # code the replacements rely on but do not replace
        # the @apply_lora_scale wrapper (peft_utils.py:305-330), rebuilt for every LoRA forward above
        "diffusers.utils.peft_utils:apply_lora_scale": frozenset({"775c02085a619be9"}),  # 0.37.0-0.42.1
        # deprecate() is called by the compile-safe stand-in in eager and reimplemented under compile
        "diffusers.utils.deprecation_utils:deprecate": frozenset({"0fe3954a5404817c"}),  # 0.37.0-0.42.1
    },
    precondition=_torch_traces_sites,
)
