"""wan_block: Wan 2.x transformer blocks with their fp32 adaLN / gate / residual / norm glue as four kernels (eager).

What goes wrong upstream
    ``WanTransformerBlock.forward`` (diffusers ``transformer_wan.py``) computes its modulation in fp32 and
    rounds once (``.type_as``): ``(norm1(x.float()) * (1 + scale) + shift).type_as(x)``, the gated
    residuals ``(x.float() + out * gate).type_as(x)``, the cross-attention norm
    ``norm2(x.float()).type_as(x)`` (an affine ``FP32LayerNorm``), the plain residual ``x + attn_output``
    and ``norm3`` + modulate like ``norm1``. In eager mode that is about 27 kernels per block (the
    feed-forward's GELU aside), most of them over fp32 copies of ``[B, S, D]`` (Wan2.1-14B at 480x832x81:
    32,760 x 5120, 335 MB per bf16 pass): about 83 bf16-sized passes where 13 suffice. ``torch.compile``
    fuses them; eager users pay.

What the patch changes
    The block's ``forward`` keeps every module call (``attn1``, ``attn2``, ``ffn``: LoRA layers and hooks
    on them keep working) and the modulation arithmetic (``scale_shift_table + temb.float()``), and runs
    the glue through ``ops.modulate`` with ``rounding="once"`` (fp32 compute, one rounding):

    - ``norm1`` + modulate: ``layer_norm_modulate`` (one pass);
    - the self-attention's gated residual + ``norm2`` (affine): ``gate_residual_layer_norm`` (one pass,
      two outputs; with ``cross_attn_norm=False`` or a norm2 it may not skip, the gated residual alone);
    - the cross-attention residual + ``norm3`` + modulate: ``residual_layer_norm_modulate`` (one pass);
    - the feed-forward's gated residual: ``gate_residual`` (one pass).

    Everything it does not cover runs diffusers' forward: ``torch.compile``, ``torch.jit.trace``,
    gradients (also forward AD and functorch transforms), autocast, norms that are not stock
    ``FP32LayerNorm`` (hooked, subclassed, affine norm1/norm3), tensor subclasses, CPU tensors, a replaced
    global (``F.layer_norm``, ``LayerNorm.forward``, ``FP32LayerNorm.forward``). A step whose tensors do not
    fit (an attention output of another dtype, a float64 table) computes diffusers' expression for it.

Tolerance
    The gated residuals are bit-identical to diffusers (the same fp32 operations, one rounding); the
    LayerNorms are fp32 with another summation order (and fused multiply-adds on the GPU): one ulp of
    the output dtype where that crosses a rounding boundary (``ops/_modulate.py``).

Versions
    diffusers 0.42.x (fingerprint verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses the Wan block's glue for eager mode.
"""
from .._core.declare import Patch
from ._fused_common import FUSED_REQUIRES, LAYER_NORM, fused_target

_BODY = "torchpatches.patches._bodies.wan_block"
_WAN = "diffusers.models.transformers.transformer_wan"
_NORMALIZATION = "diffusers.models.normalization"
#: What the replaced glue reaches through modules (the three FP32LayerNorms).
_ASSUMES = LAYER_NORM + (f"{_NORMALIZATION}:FP32LayerNorm.forward",)


PATCH = Patch(
    name="wan_block", summary="Wan blocks: fp32 adaLN, gated residuals and norm2/norm3 in four kernels (eager)",
    targets=(fused_target("wan_block", f"{_WAN}:WanTransformerBlock.forward", f"{_BODY}:_block", "e3f915b69532cdf6", _ASSUMES),),
    requires=FUSED_REQUIRES,  # the fingerprint: diffusers 0.42.1
)
