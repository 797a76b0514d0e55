"""kandinsky6: Kandinsky 6's blocks and attention processor: each fp32 adaLN / gated-residual stretch in one kernel,
q/k RMSNorm + the 2x2-matrix RoPE in one launch (eager).

What goes wrong upstream
    ``Kandinsky6FusedTransformerDecoderBlock.forward`` (diffusers ``transformer_kandinsky6.py``) computes every
    LayerNorm + modulation as ``(norm(x.float()) * (scale.float() + 1.0) + shift.float()).to(x.dtype)``
    (``apply_scale_shift``) and every gated residual as ``(x.float() + gate.float() * out.float()).to(x.dtype)``
    (``apply_gate_sum``): about five eager kernels each, most over fp32 copies of ``[B, S, D]``. A video block has four
    of each (self-, text-, audio-cross-attention, feed-forward): at 480x864, 121 frames (50,220 tokens x 4096) about
    150 bf16-sized passes where 19 suffice. ``Kandinsky6AttnProcessor`` normalizes q and k (``torch.nn.RMSNorm``) and
    rotates them by 2x2 fp32 matrices (``apply_rotary``: an fp32 copy, a ``[B, S, H, D/2, 2, 2]`` fp32 product, a sum,
    a cast): about 18 passes per rotated tensor, four video-sized ones per block. ``torch.compile`` fuses both.

What the patch changes
    The blocks' ``forward`` (the fused video/audio block and the text encoder block) keep every module call
    (attentions, feed-forwards, modulation Linears: LoRA layers and hooks on them keep working) and run the glue
    through ``ops.modulate`` with ``rounding="once"``: the first LayerNorm + modulation
    (``layer_norm_modulate``), each gated residual with the LayerNorm + modulation after it
    (``gate_residual_layer_norm_modulate``), the last gated residual (``gate_residual``). The processor runs the
    projections and the attention call as diffusers does; between them ``ops.qk_norm_rope`` normalizes and rotates q
    and k, in one launch where they share length and table (self-attention), one each otherwise (cross-attentions:
    text, video-audio, audio-video). The matrices become interleaved ``cos = (m00, m11)``, ``sin = (-m01, m10)``
    tables once per step and table (cached per source tensor; rebuilt per block under ``torch.inference_mode()``).
    Everything else runs diffusers' own code: ``torch.compile``, gradients, autocast, tensor subclasses, CPU tensors,
    norms that are not stock (``nn.LayerNorm`` without affine parameters, ``nn.RMSNorm`` with a weight of the
    input's dtype), a block without video, a replaced global (``apply_scale_shift``, ``apply_gate_sum``,
    ``apply_rotary``, ``dispatch_attention_fn``, ``F.layer_norm``, ``F.rms_norm``, ``F.linear``). A step whose
    tensors do not fit (an attention output of another dtype) computes diffusers' expression for it.

Tolerance
    PyTorch tier: diffusers' values bit for bit (the same fp32 operations, one rounding; ``1 + scale`` and
    ``scale + 1``, ``m10 * x0 + m11 * x1`` and ``x1 * m11 + x0 * m10`` are the same fp32 sums). Triton tier: the
    fp32 LayerNorm and RMSNorm statistics in another summation order and fused multiply-adds in the rotation: one
    ulp of the output dtype where that crosses a rounding boundary (``ops/_modulate.py``, ``ops/_qk_norm_rope.py``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses Kandinsky 6's block glue and RoPE for eager mode.
"""
from .._core.declare import Patch, Target
from ._fused_common import FUSED_REQUIRES, LAYER_NORM, LINEAR, RMS_NORM, fused, fused_target
from ._named_parameters import named_parameters

_BODY = "torchpatches.patches._bodies.kandinsky6"
_K6 = "diffusers.models.transformers.transformer_kandinsky6"

PATCH = Patch(
    name="kandinsky6",
    summary="Kandinsky 6: fp32 adaLN + gated residuals in one kernel each, q/k RMSNorm + matrix RoPE in one (eager)",
    targets=(  # fingerprints: diffusers 0.42.1
        fused_target("kandinsky6", f"{_K6}:Kandinsky6FusedTransformerDecoderBlock.forward", f"{_BODY}:decoder_block",
                     "19bc84e78e490956", LAYER_NORM),
        fused_target("kandinsky6", f"{_K6}:Kandinsky6TransformerEncoderBlock.forward", f"{_BODY}:encoder_block",
                     "e4e3333d5f36c7a2", LAYER_NORM),
        # named_parameters: the processor's parameters spelled out, as diffusers' other processors (its Attention
        # passes them by keyword).
        Target(f"{_K6}:Kandinsky6AttnProcessor.__call__", named_parameters(fused(
            "kandinsky6", f"{_BODY}:processor", LINEAR + RMS_NORM)), frozenset({"6a11290edfe3605c"})),
    ),
    # The helpers the bodies compute in place of, or call as, diffusers' own.
    verifies={f"{_K6}:apply_scale_shift": frozenset({"1f6e3e4d592a10fc"}),
              f"{_K6}:apply_gate_sum": frozenset({"6d15587ced232fa9"}),
              f"{_K6}:apply_rotary": frozenset({"469417fd2bd1864a"})},
    requires=FUSED_REQUIRES,
)
