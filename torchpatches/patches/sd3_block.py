"""sd3_block: SD3's ``JointTransformerBlock`` with each ``residual + gate * out`` (and the LayerNorm + modulate
after it) as one kernel (eager).

What goes wrong upstream
    ``JointTransformerBlock.forward`` (SD3 / SD3.5, ``diffusers/models/attention.py``) ends its attention
    half with ``hidden_states + gate_msa.unsqueeze(1) * attn_output`` and feeds the result straight into
    ``norm2`` and ``* (1 + scale_mlp[:, None]) + shift_mlp[:, None]``: six eager ops, each a full pass over
    ``[B, S, D]``; the feed-forward half ends with another gate + residual (two ops); the context stream does
    the same (eight more). ``torch.compile`` fuses each stretch into one kernel; eager users pay 16 launches
    per block for it.

What the patch changes
    The block's forward keeps every module call of diffusers' code (norm1, norm1_context, attention, attn2,
    feed-forwards: LoRA layers and hooks on them keep working) and replaces the tensor glue, as the
    ``gate_residual`` patch does for FLUX's blocks:

    - ``h + gate_msa * attn`` then ``norm2(h) * (1 + scale_mlp) + shift_mlp`` by
      ``ops.gate_residual_layer_norm_modulate`` (one pass, two outputs) while ``adaln`` is applied
      (else ``ops.gate_residual`` and diffusers' LayerNorm + modulate); the same for the context
      stream with ``norm2_context``;
    - ``h + gate_mlp * ff`` (both streams) by ``ops.gate_residual``;
    - the last, ``context_pre_only`` block: no context tail (diffusers returns None for it);
    - SD3.5-medium's dual-attention blocks (MMDiT-X): ``SD35AdaLayerNormZeroX`` (one LayerNorm, two
      modulations) as two ``layer_norm_modulate`` launches while ``adaln`` is applied (its SiLU a module
      call, its Linear too unless a stock ``nn.Linear``: ``_fused_common.linear``), the first gate + residual
      alone, ``attn2`` as a module call, then the second
      gate + residual fused with norm2 + modulate.

    diffusers' forward runs for: ``torch.compile``, ``torch.jit.trace``, feed-forward chunking
    (``set_chunk_feed_forward``), gradients (also forward AD and functorch transforms), autocast, a replaced
    global of the block or of ``F.layer_norm`` / ``LayerNorm.forward``, tensor subclasses, CPU tensors.

Tolerance
    The same kernels as ``gate_residual`` (FLUX), the same rounding points: gate + residual bit-identical,
    norm2 + modulate within one ulp (an fp32 LayerNorm statistic in another summation order).

Versions
    diffusers 0.42.x, fingerprint of ``JointTransformerBlock.forward`` verified on 0.42.1; torch >= 2.4.

When to delete
    When diffusers' SD3 block fuses its residual glue in eager mode (or ships such kernels).
"""
from .._core.declare import Patch
from ._fused_common import FUSED_REQUIRES, LAYER_NORM, LINEAR, fused_target

_BODY = "torchpatches.patches._bodies.sd3_block"
_ATTENTION = "diffusers.models.attention"
_NORMALIZATION = "diffusers.models.normalization"
_NORM_X = f"{_NORMALIZATION}:SD35AdaLayerNormZeroX.forward"


PATCH = Patch(
    name="sd3_block", summary="SD3 blocks: gate + residual (+ next LayerNorm/modulate) in one kernel (eager)",
    targets=(fused_target("sd3_block", f"{_ATTENTION}:JointTransformerBlock.forward", f"{_BODY}:_joint_block", "e64d8fc0e57ee1fa",
                          LAYER_NORM + LINEAR + (_NORM_X,)),),  # the fingerprints: diffusers 0.42.1
    verifies={_NORM_X: frozenset({"0d6e640065ac6bf5"})},  # rewritten by _norm1_dual
    requires=FUSED_REQUIRES)
