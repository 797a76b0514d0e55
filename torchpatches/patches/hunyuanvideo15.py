"""hunyuanvideo15: HunyuanVideo 1.5's blocks and attention processor: the adaLN-Zero glue in four kernels, q/k
RMSNorm + RoPE + concat in one, the attention mask built once per step (eager).

What goes wrong upstream
    ``HunyuanVideo15AttnProcessor2_0`` builds the ``[B, 1, S, S]`` self-attention mask from the text mask in every
    block (a pad, a ``repeat`` and an ``&`` with its own transpose): at 480p and 121 frames about 49,000 tokens, 2.4 GB
    of mask written and read several times per block, the same mask every block of the step. The block
    (``HunyuanVideo15TransformerBlock``, FLUX.1's double-stream block without the fp16 clip) then runs the gated
    residuals, the second LayerNorm and its modulation as separate eager ops per stream.

What the patch changes
    The processor runs the projections (module calls: LoRA layers and hooks keep working) and the attention call as
    diffusers does; between them ``ops.qk_norm_rope`` normalizes the four q/k streams (diffusers' RMSNorm rounding),
    rotates the image rows (the text rows get identity RoPE rows, ``_per_step.image_rows_tables``) and writes the
    joint ``[image; text]`` q, k, v in one launch. The mask comes from a per-step cache (``_per_step.square_mask``:
    built by diffusers' own lines the first time, keyed by the text-mask tensor, its version and the length; with the
    native backend, the additive mask SDPA would make of it). Under ``torch.inference_mode()`` nothing is cached
    (inference tensors carry no version counter) and each block builds its tables and mask, as diffusers does.
    The block's ``forward`` calls the adaLN norms (the ``adaln`` pattern's), attention and feed-forwards as modules and
    fuses ``x + gate * attn`` with ``norm2(x) * (1 + scale) + shift`` per stream (``ops.gate_residual_layer_norm_modulate``)
    and ``x + gate * ff`` (``ops.gate_residual``). Everything else runs diffusers' own code: ``torch.compile``,
    gradients, autocast, tensor subclasses, CPU tensors, norms that are not stock ``nn.LayerNorm`` without affine
    parameters or stock diffusers ``RMSNorm`` (q/k), extra block arguments, a replaced global (``dispatch_attention_fn``,
    ``F.pad``, ``F.layer_norm``, ``apply_rotary_emb``, ``RMSNorm.forward``).

Tolerance
    The mask is diffusers' (the same code, once). The glue and the q/k stretch round where diffusers rounds; the norm
    statistics are fp32 in another summation order: one ulp of a norm's output where that crosses a rounding
    boundary (``ops/_modulate.py``, ``ops/_qk_norm_rope.py``). A text row's zero may change sign (``x * 1 + 0``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers builds HunyuanVideo 1.5's mask once per forward and fuses its block glue for eager mode.
"""
from .._core.declare import Patch, Target
from ._fused_common import CAT, DROPOUT, FUSED_REQUIRES, LAYER_NORM, LINEAR, fused, fused_target
from ._named_parameters import named_parameters

_BODY = "torchpatches.patches._bodies.hunyuanvideo15"
_HUNYUAN = "diffusers.models.transformers.transformer_hunyuan_video15"

PATCH = Patch(
    name="hunyuanvideo15",
    summary="HunyuanVideo 1.5: attention mask once per step, block glue in four kernels (eager)",
    targets=(  # fingerprints: diffusers 0.42.1
        # named_parameters: diffusers' Attention passes image_rotary_emb only to a __call__ whose signature names it.
        Target(f"{_HUNYUAN}:HunyuanVideo15AttnProcessor2_0.__call__", named_parameters(fused(
            "hunyuanvideo15", f"{_BODY}:processor", LINEAR + DROPOUT + CAT + (
                "torch.nn.functional:pad", "diffusers.models.embeddings:apply_rotary_emb",
                "diffusers.models.normalization:RMSNorm.forward"))),
            frozenset({"63ffc6f3bff820e2"})),
        fused_target("hunyuanvideo15", f"{_HUNYUAN}:HunyuanVideo15TransformerBlock.forward", f"{_BODY}:block",
                     "6d413009884f0fcb", LAYER_NORM),
    ),
    requires=FUSED_REQUIRES,
)
