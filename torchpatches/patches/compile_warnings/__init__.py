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
    Every one is a target in ``_table.py``; the 8 sites compiled code never reaches (construction time, branches
    under ``not torch.compiler.is_compiling()``) are in ``_table.NOT_COVERED`` with the reason, and
    tests/patches/test_compile_warnings_sites.py fails when a release adds a site that is neither.
    No upstream issue or fix as of diffusers 0.42.1; sglang fixed its own FLUX copy the same way
    (PR #23648: a trace-time warning helper plus warn-once).

What the patch changes
    Each target is replaced by a copy compiled from the *same source* (its fingerprint in ``_table.py``
    proves it is the source we read) in which the global ``logger`` -- or ``deprecate`` -- resolves to a
    compile-safe stand-in held in a closure: :class:`torchpatches.compile.OnceLogger` (``warning``
    goes through ``warning_once``: emitted once per distinct message, in eager on the same logger
    with the same level and text, under compile at trace time with nothing in the graph) and
    :func:`._replacements.compile_safe_deprecate`. Each target declares the sites it removes
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
    (the tables in ``_table.py`` say which 0.40 sources were read and accepted; ``dispatch_attention_fn`` has two:
    0.42 skips an ``Enum`` call), and the rest are skipped with the reason: Z-Image's forward on 0.40/0.41
    and HiDream's on 0.40 by fingerprint, the model modules those releases do not have as "does not exist".
    Tests run on 0.42.1, 0.41.0 and 0.40.0. Before 0.40 the SD3 and Wan forwards, before 0.39 the
    FLUX.1/FLUX.2/Qwen/Hunyuan forwards and before 0.37 every target have other sources, and the
    ``@apply_lora_scale`` wrapper (the scale warning) exists only since 0.37: those releases are outside the gate.
    torch >= 2.11 (tested on 2.11, 2.13, 2.15 in CI; 2.12.1 and 2.14.1 by hand).

    When the running torch's Dynamo traces both kinds of site itself (measured once per process,
    ``_probe.py``; true with ``torch._dynamo.config.ignore_logging_functions`` set to
    ``{logging.Logger.warning, warnings.warn}``, false by default through torch 2.15.0), the patch
    reports ``skipped: torch <version> traces these sites itself``.

When to delete
    When diffusers emits these warnings through a compile-safe helper (or stops warning in forward),
    and the fingerprints stop matching: the patch then reports ``skipped``. Or when torch traces
    both kinds of site by default (the probe above then skips it).

Layout
    ``__init__`` (this banner and the declaration, read at ``import torchpatches``); ``_table.py`` (the
    targets, built at diffusers' first import: declaring 71 targets at import cost milliseconds);
    ``_replacements.py`` (the compile-safe stand-ins and how each kind of target is rebuilt);
    ``_rebind.py`` (a function recompiled from its own source with some globals rebound); ``_probe.py``
    (does the running torch trace these sites itself?).
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..._core.declare import LazyTargets, Patch, Target

__all__ = ["PATCH"]


def _targets() -> Tuple[Target, ...]:
    from ._table import targets

    return targets()


def _torch_traces_sites() -> Optional[str]:
    """Skip when the running torch compiles both kinds of site without a graph break (measured)."""
    import torch

    from ._probe import torch_traces_warning_sites

    return f"torch {torch.__version__} traces these sites itself" if torch_traces_warning_sites() else None


PATCH = Patch(
    name="compile_warnings",
    summary="diffusers' forward-time warnings (every transformer model of 0.42.x) without graph breaks",
    targets=LazyTargets("diffusers", _targets),  # built at diffusers' first import
    requires={"diffusers": ">=0.40,<0.43", "torch": ">=2.11"},
    verifies={  # code the replacements rely on but do not replace
        # the @apply_lora_scale wrapper (peft_utils.py:305-330), rebuilt for every LoRA forward in _table._LORA_FORWARDS
        "diffusers.utils.peft_utils:apply_lora_scale": frozenset({"775c02085a619be9"}),  # 0.37.0-0.42.1
        # deprecate() is called by the compile-safe stand-in in eager and reimplemented under compile
        "diffusers.utils.deprecation_utils:deprecate": frozenset({"0fe3954a5404817c"}),  # 0.37.0-0.42.1
    },
    precondition=_torch_traces_sites,
)
