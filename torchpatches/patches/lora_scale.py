"""lora_scale: diffusers' ``scale_lora_layers`` / ``unscale_lora_layers`` without the generator walk (eager host time).

What goes wrong upstream
    A forward decorated with ``@apply_lora_scale`` (FLUX.1, FLUX.2, SD3, QwenImage, Wan and 35 more in diffusers
    0.42.1) that is given a LoRA ``scale`` other than 1 in its attention kwargs -- how a LoRA is weighted:
    ``pipe(..., joint_attention_kwargs={"scale": 0.8})`` -- calls ``scale_lora_layers(self, scale)`` before the
    forward and ``unscale_lora_layers(self, scale)`` after it, on every step. Each walks ``model.modules()``:
    generators nested one per tree level, and an ABC ``isinstance`` per module. FLUX.1 with adapters on its 17
    projection kinds has 6,229 modules (most of them inside the LoRA layers); docs/lora.md ("``lora_scale``")
    has the host time of the two walks per step, beside the fused step they delay. No upstream issue as of
    diffusers 0.42.1.

What the patch changes
    The same walk without generators: the modules in ``modules()``' order (pre-order, each module once by the
    memo set ``named_modules`` keeps, ``None`` children skipped), ``isinstance(module, BaseTunerLayer)`` decided
    once per class (and again after any ``ABC.register``); then, in that order, each tuner layer's own
    ``scale_layer`` / ``unscale_layer`` / ``set_scale``, called as diffusers calls them. Every value and every call
    is diffusers'; only the walk's host time changes. The original runs instead under torch.compile (Dynamo
    traces diffusers' walk), when a module of the tree overrides ``modules`` or ``named_modules`` (class or
    instance), when a module's class changes how it is tested as an instance (``__class__``), and when the walk
    raises (the original then raises its own error). One difference by design: the layers are collected before
    the first one is scaled, so a ``scale_layer`` that adds modules to the tree mid-walk is not followed (peft's
    do not touch the tree).

Versions
    diffusers 0.35 - 0.42: both functions fingerprinted with tools/fingerprint_diffusers.py in 0.35.0, 0.35.2,
    0.36.0, 0.37.0, 0.38.0, 0.39.0, 0.40.0, 0.41.0, 0.42.0 and 0.42.1 (installed, tested);
    ``unscale_lora_layers`` has two sources, differing in one type hint. With peft installed (the functions import
    it; without peft the decorator never calls them). Any torch.

When to delete
    When diffusers scales LoRA layers without walking the whole module tree per forward (a list of tuner layers
    kept by the loader, or a scale passed down instead of written into every layer).
"""
from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.lora_scale"
_MODULE = "diffusers.utils.peft_utils"
#: Modules that bind the functions by name and call them per forward (``diffusers.utils`` re-exports them:
#: ``from diffusers.utils import scale_lora_layers``).
_SCALE_ALIASES = (
    "diffusers.utils:scale_lora_layers",
    "diffusers.models.transformers.transformer_motif_video:scale_lora_layers",
    "diffusers.models.transformers.transformer_nucleusmoe_image:scale_lora_layers",
)
_UNSCALE_ALIASES = tuple(alias.replace(":scale_", ":unscale_") for alias in _SCALE_ALIASES)


PATCH = Patch(
    "lora_scale",
    "diffusers scale_lora_layers / unscale_lora_layers (a LoRA scale per forward) without the generator walk",
    targets=(
        Target(f"{_MODULE}:scale_lora_layers", f"{_BODY}:_scale_replacement",
               {"fc53e9824dec8d29"}, aliases=_SCALE_ALIASES),  # diffusers 0.35.0 - 0.42.1
        # diffusers 0.37.0 - 0.42.1; 0.35.0 - 0.36.0 (``Optional[float]`` for ``float | None``)
        Target(f"{_MODULE}:unscale_lora_layers", f"{_BODY}:_unscale_replacement",
               {"1d40701326d52a00", "7019e0c8dfa78317"}, aliases=_UNSCALE_ALIASES),
    ),
    requires={"diffusers": ">=0.35,<0.43", "peft": ">=0.17"},
)
