"""wan_qk_norm_rope: Wan 2.x attention with q/k RMSNorm (across heads) and RoPE in one kernel (eager).

What goes wrong upstream
    ``WanAttnProcessor.__call__`` (diffusers ``transformer_wan.py``) normalizes q and k with
    ``torch.nn.RMSNorm`` over the full width (``qk_norm="rms_norm_across_heads"``), then, in self-attention,
    rotates them with a nested ``apply_rotary_emb`` that computes in fp32 through strided views: six fp32
    elementwise kernels, an ``empty_like`` and two strided copies per tensor. For Wan2.1-14B at 480x832x81
    (32,760 tokens x 5120) that is about 38 bf16-sized passes over q and k per block where 4 suffice.
    ``torch.compile`` fuses them; eager users pay.

What the patch changes
    ``WanAttnProcessor.__call__`` runs the projections, the attention and ``to_out`` exactly as diffusers
    does (module calls, so LoRA layers and hooks on them keep working; ``to_out``'s stock ``nn.Linear`` and
    eval-mode ``nn.Dropout`` are called as their ``forward`` would, ``_fused_common.linear``) and replaces the
    stretch in between
    by ``torchpatches.ops.rms_norm_rope``: one launch that normalizes q and k over their width
    and (self-attention) rotates them; the cross-attention's q (image tokens) and k (text tokens) are
    normalized in one launch too. Everything else runs diffusers' own ``__call__``: the I2V image context
    (``add_k_proj``), ``torch.compile``, norms that are not stock ``torch.nn.RMSNorm(inner_dim)`` with a
    weight of the activations' dtype, hooked norms, a rotary embedding that is not Wan's fp32
    ``(cos, sin)`` pair of ``[1, S, 1, head_dim]``, gradients (also forward AD
    and functorch transforms), ``torch.jit.trace``, autocast, a replaced global of the processor
    (``dispatch_attention_fn``, ``_get_qkv_projections``) or of ``F.rms_norm`` / ``RMSNorm.forward``, tensor
    subclasses, CPU tensors. Under diffusers' context parallelism the stretch runs on the rank's shard (its rotary
    tables are the shard's) and the processor hands diffusers' attention call what diffusers' does: its
    ``_parallel_config`` in self-attention, none in cross-attention (the text is not split).

Tolerance
    torch's fused RMSNorm then Wan's RoPE, rounding at the same two points; fp32 reduction order and fused
    multiply-adds may move a result by one ulp (``ops/_rms_norm_rope.py``).

Versions
    diffusers 0.42.x (fingerprint verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses Wan's q/k norm and RoPE for eager mode.
"""
from .._core.declare import Patch
from ._fused_common import DROPOUT, FUSED_REQUIRES, LINEAR, RMS_NORM, fused_target

_BODY = "torchpatches.patches._bodies.wan_qk_norm_rope"
_WAN = "diffusers.models.transformers.transformer_wan"


PATCH = Patch(
    name="wan_qk_norm_rope", summary="Wan attention: q/k RMSNorm across heads + RoPE in one kernel (eager)",
    targets=(fused_target("wan_qk_norm_rope", f"{_WAN}:WanAttnProcessor.__call__", f"{_BODY}:_processor", "6bfcee2af4a77d09",
                          RMS_NORM + LINEAR + DROPOUT),),
    requires=FUSED_REQUIRES,  # the fingerprint: diffusers 0.42.1
)
