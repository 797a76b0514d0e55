"""zimage_qk_norm_rope: Z-Image's attention processor: q/k RMSNorm + complex RoPE in one kernel (eager).

What goes wrong upstream
    Between its projections and the attention call, diffusers' ``ZSingleStreamAttnProcessor`` runs two diffusers
    ``RMSNorm`` (five kernels each over ``[B, S, H, D]``) and rotates q and k through ``float()``, a complex64
    multiply and ``type_as`` (three passes each): about sixteen passes where one read of q and k and one write
    suffice, in every one of Z-Image's 30 blocks.

What the patch changes
    ``__call__`` runs the projections, the attention call and ``to_out`` as diffusers does (module calls, so LoRA
    layers and hooks keep working; a stock ``nn.Linear`` / ``nn.Dropout`` called as its ``forward`` would), and
    replaces the stretch in between by ``torchpatches.ops.qk_norm_rope`` with diffusers' RMSNorm rounding
    (``rounding="each"``): one launch normalizes q and k per head and rotates them. The complex frequencies
    ``[B, S, D/2]`` become fp32 ``cos``/``sin`` tables ``[B, S, D]`` once per forward (cached per source tensor,
    ``_qwenimage_tables.complex_tables``; every block gets the same tensor). Everything else runs diffusers' own
    ``__call__``: ``torch.compile``, norms that are not stock diffusers ``RMSNorm`` with a weight of the activations'
    dtype, no frequencies or frequencies that are not complex64 of the sequence's length, gradients, autocast,
    tensor subclasses, CPU tensors, a replaced ``dispatch_attention_fn`` or ``RMSNorm.forward``.

Tolerance
    The norm rounds where diffusers' RMSNorm rounds; the rotation is the real form of the complex product in fp32,
    rounded once, where torch's complex multiply contracts ``a*c - b*d`` to a fused multiply-add on CUDA: one ulp
    of the output where that crosses a rounding boundary (``ops/_qk_norm_rope.py``).

Versions
    diffusers 0.42.x (fingerprint verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses Z-Image's q/k norm and RoPE for eager mode.
"""
from .._core.declare import Patch, Target
from ._fused_common import DROPOUT, FUSED_REQUIRES, LINEAR, fused, named_parameters

_BODY = "torchpatches.patches._bodies.zimage_qk_norm_rope"
_ZIMAGE = "diffusers.models.transformers.transformer_z_image"

PATCH = Patch(
    name="zimage_qk_norm_rope",
    summary="Z-Image's attention processor: q/k RMSNorm + complex RoPE in one kernel (eager)",
    # named_parameters: diffusers' Attention passes freqs_cis only to a __call__ whose signature names it.
    targets=Target(f"{_ZIMAGE}:ZSingleStreamAttnProcessor.__call__", named_parameters(fused(
        "zimage_qk_norm_rope", f"{_BODY}:zimage", LINEAR + DROPOUT + ("diffusers.models.normalization:RMSNorm.forward",))),
        frozenset({"ae1cc95b69cd9d57"})),  # diffusers 0.42.1
    verifies={"diffusers.models.normalization:RMSNorm.forward": frozenset({"25f4c6d067d464a9"})},
    requires=FUSED_REQUIRES,
)
