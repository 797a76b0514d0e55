"""qwenimage_block: QwenImage's double-stream block with LayerNorm + modulate and the gated residuals fused (eager).

What goes wrong upstream
    ``QwenImageTransformerBlock.forward`` (``transformer_qwenimage.py``) writes its adaLN glue inline:
    per stream ``LayerNorm`` + ``x * (1 + scale) + shift`` (four eager ops) twice, and
    ``h + gate * out`` (two ops) twice, plus fp16 clips: 24 launches per block and a dozen full passes
    over the ``[B, S, D]`` activations of each stream. ``torch.compile`` fuses them; eager users pay
    them in every one of the 60 blocks. No upstream issue or fix as of diffusers 0.42.1.

What the patch changes
    The block keeps every module call of diffusers' code (``img_mod`` / ``txt_mod``, the attention,
    the MLPs: LoRA layers and hooks on them keep working) and replaces the tensor glue by
    ``torchpatches.ops.modulate``: per stream ``layer_norm_modulate`` (norm1 + modulate, one pass),
    ``gate_residual_layer_norm_modulate`` (the attention's gated residual and norm2 + modulate, one pass,
    two outputs) and ``gate_residual`` (the MLP's gated residual with diffusers' fp16 clip): 3 launches
    per stream. Every call it does not cover runs diffusers' forward: ``torch.compile``,
    ``torch.jit.trace``, forward AD and functorch transforms, gradients, autocast, the edit models'
    ``zero_cond_t`` / ``modulate_index`` (per-token modulation of the reference image), norms that are
    not stock affine-free ``nn.LayerNorm`` or are hooked, a replaced global of the block or of
    ``F.layer_norm`` / ``LayerNorm.forward``, tensor subclasses, CPU tensors.

Tolerance
    Bit-identical to diffusers with the PyTorch tier (CPU); the fused LayerNorm as in the ``adaln`` patch
    (one ulp where the fp32 statistics differ in their last bit), the gate + residual bit-identical.

Versions
    diffusers 0.42.x (fingerprint verified on 0.42.1; 0.42.0's source of the target is the same); torch >= 2.4.

When to delete
    When diffusers fuses the block glue for eager mode.
"""
from .._core.declare import Patch
from ._fused_common import FUSED_REQUIRES, LAYER_NORM, fused_target

_BODY = "torchpatches.patches._bodies.qwenimage_block"
_QWEN = "diffusers.models.transformers.transformer_qwenimage"


PATCH = Patch(
    name="qwenimage_block",
    summary="QwenImage blocks: LayerNorm + modulate, gate + residual (+ the next LayerNorm + modulate) fused (eager)",
    targets=(fused_target("qwenimage_block", f"{_QWEN}:QwenImageTransformerBlock.forward", f"{_BODY}:_block", "c14d21c1ab218e72",
                          LAYER_NORM),),  # the fingerprint: diffusers 0.42.0, 0.42.1
    requires=FUSED_REQUIRES)
