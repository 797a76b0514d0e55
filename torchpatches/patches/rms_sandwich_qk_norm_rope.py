"""rms_sandwich_qk_norm_rope: Z-Image's and Ideogram 4's attention processors: q/k RMSNorm + RoPE in one kernel (eager).

What goes wrong upstream
    Between their projections and the attention call, diffusers' ``ZSingleStreamAttnProcessor`` and
    ``Ideogram4AttnProcessor`` run two diffusers ``RMSNorm`` (five kernels each over ``[B, S, H, D]``) and rotate q
    and k: Z-Image through ``float()``, a complex64 multiply and ``type_as`` (three passes each), Ideogram 4 through
    ``q * cos + rotate_half(q) * sin`` in bf16 (five passes each, ``rotate_half`` a negation and a ``cat``). About
    sixteen to twenty passes where one read of q and k and one write suffice, in every block.

What the patch changes
    ``__call__`` runs the projections, the attention call and the output projection as diffusers does (module
    calls, so LoRA layers and hooks keep working; a stock ``nn.Linear`` / ``nn.Dropout`` called as its ``forward``
    would), and replaces the stretch in between by ``torchpatches.ops.qk_norm_rope`` with diffusers' RMSNorm
    rounding (``rounding="each"``): one launch normalizes q and k per head and rotates them. Z-Image's complex
    frequencies ``[B, S, D/2]`` become fp32 ``cos``/``sin`` tables ``[B, S, D]`` once per forward (cached per source
    tensor, ``_per_step.complex_tables``; every block gets the same tensor); Ideogram 4's bf16 ``[B, L, D]``
    tables are used as they are, with its half-split pairs and per-op rounding (``rope="half_each"``). Everything
    else runs diffusers' own ``__call__``: ``torch.compile``, norms that are not stock diffusers ``RMSNorm`` with a
    weight of the activations' dtype, tables that are not of the form above, gradients, autocast, tensor
    subclasses, CPU tensors, a replaced ``dispatch_attention_fn`` / ``_rotate_half`` or ``RMSNorm.forward``.

Tolerance
    The norm rounds where diffusers' RMSNorm rounds (its fp32 statistics in another order: one ulp where that
    crosses a rounding boundary). Z-Image: the rotation is the real form of the complex product in fp32, rounded
    once, where torch's complex multiply contracts ``a*c - b*d`` to a fused multiply-add on CUDA: one ulp of the
    output where that crosses a rounding boundary. Ideogram 4: the same roundings as diffusers (``ops/_qk_norm_rope.py``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses these processors' q/k norm and RoPE for eager mode.
"""
from .._core.declare import Patch, Target
from ._named_parameters import named_parameters
from ._fused_common import DROPOUT, FUSED_REQUIRES, LINEAR, fused, fused_target

_BODY = "torchpatches.patches._bodies.rms_sandwich_qk_norm_rope"
_ZIMAGE = "diffusers.models.transformers.transformer_z_image"
_IDEOGRAM4 = "diffusers.models.transformers.transformer_ideogram4"
#: What the fused stretch skips besides the processors' own globals (checked per call by ``fused``).
_ASSUMES = LINEAR + DROPOUT + ("diffusers.models.normalization:RMSNorm.forward",)

PATCH = Patch(
    name="rms_sandwich_qk_norm_rope",
    summary="Z-Image / Ideogram 4 attention processors: q/k RMSNorm + RoPE in one kernel (eager)",
    targets=(  # fingerprints: diffusers 0.42.1
        # named_parameters: diffusers' Attention passes freqs_cis only to a __call__ whose signature names it.
        Target(f"{_ZIMAGE}:ZSingleStreamAttnProcessor.__call__",
               named_parameters(fused("rms_sandwich_qk_norm_rope", f"{_BODY}:zimage", _ASSUMES)),
               frozenset({"ae1cc95b69cd9d57"})),
        fused_target("rms_sandwich_qk_norm_rope", f"{_IDEOGRAM4}:Ideogram4AttnProcessor.__call__",
                     f"{_BODY}:ideogram4", "50d702d555fc847c", _ASSUMES),
    ),
    verifies={"diffusers.models.normalization:RMSNorm.forward": frozenset({"25f4c6d067d464a9"})},
    requires=FUSED_REQUIRES,
)
