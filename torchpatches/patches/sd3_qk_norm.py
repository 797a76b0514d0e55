"""sd3_qk_norm: SD3's joint attention processor with q/k RMSNorm and the image/text concat in one kernel (eager).

What goes wrong upstream
    Between its projections and ``F.scaled_dot_product_attention``, diffusers' ``JointAttnProcessor2_0``
    (SD3 / SD3.5 ``JointTransformerBlock``, ``qk_norm="rms_norm"``) runs four diffusers ``RMSNorm`` calls
    (q, k, text q, text k), each eight eager ops (``to(float32)``, ``pow``, ``mean``, ``+ eps``, ``rsqrt``,
    ``*``, ``to(dtype)``, ``* weight``), then three ``torch.cat`` of the image and text rows (q, k, v), and
    after the attention a copy (``transpose(1, 2).reshape``, the attention output laid out heads-first):
    about 36 launches per block over ``[B, S, H, D]`` tensors where one launch suffices. At SD3.5-large's
    width (38 heads x 64) these small kernels, not their bytes, cost the time. ``torch.compile`` fuses them.

What the patch changes
    ``JointAttnProcessor2_0.__call__`` runs the projections (module calls: LoRA layers and hooks on them keep
    working; a stock ``nn.Linear`` or eval-mode ``nn.Dropout`` is called as its ``forward`` would, without the
    module call path, ``_fused_common.linear``), then ``ops.qk_norm_rope(..., cos=None, text_first=False,
    rounding="each")``: one launch that
    normalizes q and k per head as diffusers' ``RMSNorm`` does (two roundings) and writes q, k and v straight
    into contiguous ``[B, S_img + S_txt, H, D]`` tensors, image rows first. The attention gets their
    ``[B, H, S, D]`` views, so its output is already token-major and the ``reshape`` after it is a view.
    Everything else is diffusers' code. diffusers' own ``__call__`` runs for: ``torch.compile``,
    ``torch.jit.trace``, forward AD / functorch, autocast, gradients, an attention mask or extra arguments
    (the original ignores them; it is left to say so), ``qk_norm`` other than ``"rms_norm"`` (SD3.0 has no
    q/k norm), norms that are not stock diffusers ``RMSNorm`` with a weight of the activations' dtype (or are
    hooked), a non-stock ``Attention``, context-parallel processors, a replaced global of the processor
    (``F``, ``torch``) or of ``RMSNorm.forward`` / ``torch.cat``, torch_npu, tensor subclasses, CPU tensors.

Tolerance
    diffusers' RMSNorm rounding points exactly; the fp32 statistic may differ in its last bit (another
    summation order): within 2 ulp of the output dtype. The attention reads the same values in another
    memory layout (``[B, S, H, D]`` as FLUX's processors give it).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses the q/k norm and the concat of ``JointAttnProcessor2_0`` for eager mode.
"""
from .._core.declare import Patch
from ._fused_common import CAT, DROPOUT, FUSED_REQUIRES, LINEAR, fused_target

_BODY = "torchpatches.patches._bodies.sd3_qk_norm"
_PROCESSOR = "diffusers.models.attention_processor"
_NORMALIZATION = "diffusers.models.normalization"
#: What the fused stretch skips besides the processor's own globals: diffusers' RMSNorm and the concat.
_ASSUMES = (f"{_NORMALIZATION}:RMSNorm.forward",) + CAT + LINEAR + DROPOUT


PATCH = Patch(
    name="sd3_qk_norm", summary="SD3 joint attention: q/k RMSNorm + image/text concat in one kernel (eager)",
    targets=(fused_target("sd3_qk_norm", f"{_PROCESSOR}:JointAttnProcessor2_0.__call__", f"{_BODY}:_joint_attn",
                          "131735ccb11abb73", _ASSUMES),),  # the fingerprints: diffusers 0.42.1
    verifies={f"{_NORMALIZATION}:RMSNorm.forward": frozenset({"25f4c6d067d464a9"})},
    requires=FUSED_REQUIRES)
