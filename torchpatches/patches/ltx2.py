"""ltx2: LTX-2's dual-modality blocks and attention processor: the block glue (weightless RMSNorm + table modulation,
gated residuals) in one kernel per residual, q/k RMSNorm across heads + the split RoPE in one launch, no signature
inspection per attention call (eager).

What goes wrong upstream
    ``LTX2VideoTransformerBlock.forward`` (diffusers ``transformer_ltx2.py``) forms its modulation vectors per call
    (``scale_shift_table + temb``) and runs each weightless ``RMSNorm`` as about five eager kernels over ``[B, S, D]``
    (two of them fp32), each modulation ``norm * (1 + scale) + shift`` and each gated residual as separate ops: per
    video stream and block five norms, five modulations (the cross-modal norm's output is modulated twice) and five
    residuals, about 50 passes over ``[B, 14080, 4096]`` at 704x1280, 121 frames, where ``torch.compile`` makes a
    dozen. ``LTX2AudioVideoAttnProcessor`` normalizes q and k across heads (``torch.nn.RMSNorm``) and rotates them by
    ``apply_split_rotary_emb`` (a reshape copy, fp32 copies, two ``addcmul_``, a cast back: about eight passes per
    rotated tensor); ``LTX2Attention.forward`` calls ``inspect.signature`` on its processor at every call (six per
    block).

What the patch changes
    The block's ``forward`` calls every attention and feed-forward as diffusers does, in its order (LoRA layers and
    hooks on them keep working); in between it runs ``ops.modulate``'s weightless-RMSNorm form, the vectors summed from
    ``temb`` and the tables inside the kernels: norm1 + modulation in one kernel; each residual (gated or plain) with
    the norm + modulation that follows it (norm2; the cross-modal norm with the audio-to-video modulation, a second
    kernel for the video-to-audio one; norm3) in one; the feed-forward's gated residual in one. LTX-2.0's unmodulated
    norm2 is the same kernel with a zero scale and a negative-zero shift (``n * 1 + (-0.0)`` is ``n`` exactly). A
    stock ``LTX2Attention`` (no hooks) gets its processor call as its ``forward`` makes it, without the signature
    inspection (no extra keyword arguments: nothing to filter). The processor runs the projections, the mask, the
    attention call, LTX-2.3's per-head gate and the output as diffusers does; between them ``ops.rms_norm_rope``
    (``rope="split"``) normalizes q and k and rotates them, with k's own tables in the cross-modal attentions, in one
    launch; the text cross-attentions' mask is prepared (``prepare_attention_mask``: repeated per head) once per
    step and head count instead of per call (cached per mask tensor, as ``_per_step``'s). Everything else runs
    diffusers' own code: ``torch.compile``, gradients, autocast, tensor subclasses, CPU tensors,
    ``LTX2PerturbedAttnProcessor`` (spatio-temporal guidance; its blocks' glue still fuses), norms that are not stock
    (weightless diffusers ``RMSNorm`` in the block, ``torch.nn.RMSNorm`` with a weight of the input's dtype in the
    attention), tables or ``temb`` of another dtype or shape, the interleaved RoPE, a replaced global
    (``apply_split_rotary_emb``, ``dispatch_attention_fn``, ``RMSNorm.forward``, ``LTX2Attention.forward``,
    ``F.rms_norm``, ``F.linear``). A residual whose branch does not fit (an attention output of another dtype) is
    diffusers' expression; the norm after it is still one kernel where the stream keeps its dtype and shape.

Tolerance
    PyTorch tier: diffusers' values bit for bit (its own expressions; ``table + temb`` and ``temb + table``, ``gate *
    y`` and ``y * gate`` are the same sums and products). Triton tier: the fp32 RMSNorm statistics in another
    summation order: one ulp of a norm's output where that crosses a rounding boundary (``ops/_modulate.py``,
    ``ops/_rms_norm_rope.py``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses LTX-2's block glue and q/k stretch for eager mode.
"""
from .._core.declare import Patch, Target
from ._fused_common import DROPOUT, FUSED_REQUIRES, LINEAR, RMS_NORM, fused, fused_target
from ._named_parameters import named_parameters

_BODY = "torchpatches.patches._bodies.ltx2"
_LTX2 = "diffusers.models.transformers.transformer_ltx2"
_RMS = "diffusers.models.normalization:RMSNorm.forward"

PATCH = Patch(
    name="ltx2",
    summary="LTX-2: weightless RMSNorm + modulation with each residual in one kernel, q/k norm + split RoPE in one",
    targets=(  # fingerprints: diffusers 0.42.1
        # LTX2Attention.forward: the block calls a stock attention's processor as that forward does (compile_warnings
        # replaces the forward itself; its replacement stands for diffusers' here).
        fused_target("ltx2", f"{_LTX2}:LTX2VideoTransformerBlock.forward", f"{_BODY}:block", "dd764490abd818e1",
                     (_RMS, f"{_LTX2}:LTX2Attention.forward", f"{_LTX2}:LTX2VideoTransformerBlock.get_mod_params")),
        # named_parameters: diffusers' attention passes a processor only the keyword arguments its signature names.
        Target(f"{_LTX2}:LTX2AudioVideoAttnProcessor.__call__",
               named_parameters(fused("ltx2", f"{_BODY}:processor", LINEAR + RMS_NORM + DROPOUT + (
                   "diffusers.models.attention:AttentionModuleMixin.prepare_attention_mask",))),
               frozenset({"c9aac3cbef11d6dc"})),
    ),
    # What the fused stretches compute in diffusers' place (diffusers 0.42.1): another source skips the patch.
    verifies={_RMS: frozenset({"25f4c6d067d464a9"}),
              f"{_LTX2}:apply_split_rotary_emb": frozenset({"101de9c72dfea98a"}),
              f"{_LTX2}:LTX2VideoTransformerBlock.get_mod_params": frozenset({"f28bd56485da4e1d"})},
    requires=FUSED_REQUIRES,
)
