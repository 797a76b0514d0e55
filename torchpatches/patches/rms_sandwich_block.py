"""rms_sandwich_block: RMSNorm-sandwich DiT blocks (Z-Image, Ideogram 4): norms, modulation, gated residuals and the
SwiGLU's product in four kernels (eager).

What goes wrong upstream
    ``ZImageTransformerBlock`` and ``Ideogram4TransformerBlock`` (the same block code, two modules) wrap attention
    and feed-forward in diffusers' ``RMSNorm`` before and after (``attention_norm1/2``, ``ffn_norm1/2``), scale the
    pre-norm by ``1 + scale`` and add the post-norm through a ``tanh`` gate. Each diffusers ``RMSNorm`` is five
    eager kernels over ``[B, S, D]`` (fp32 square, mean, rsqrt, the cast, the weight), so a block makes four of
    them plus the scale, gate and residual products and the feed-forward's ``silu`` and product: about 30 passes
    over the activations, where ``torch.compile`` makes about six. At 1024x1024 this glue is most of the gap between
    Z-Image's eager step and its compiled one.

What the patch changes
    The blocks' ``forward`` computes the modulation vectors as diffusers does (the ``adaLN_modulation`` Linear,
    ``chunk``, ``tanh``, ``1 + scale``; Z-Image's per-token ``select_per_token`` form too) and calls attention and
    the feed-forward's Linears as modules (LoRA layers and hooks on them keep working); in between it runs
    ``torchpatches.ops`` rms_modulate: ``attention_norm1(x) * scale_msa`` in one kernel, ``x + gate_msa *
    attention_norm2(attn)`` with ``ffn_norm1(x) * scale_mlp`` in one kernel, ``x + gate_mlp * ffn_norm2(ff)`` in
    one kernel; and ``silu(w1(y)) * w3(y)`` through the two-input ``ops.swiglu``. A family with this block shape
    is one row of ``_ROWS`` in the body (its class, signature adapter and module names). Everything else runs
    diffusers' own ``forward``: ``torch.compile``, Z-Image's unmodulated refiner blocks, norms that are not stock
    diffusers ``RMSNorm`` with a weight of the activations' dtype and no bias, hooked or replaced submodules, a
    feed-forward that is not the stock class, gradients, autocast, tensor subclasses, CPU tensors, a replaced
    global of the block (``select_per_token``) or a replaced ``RMSNorm.forward`` / ``F.silu`` / feed-forward method.

Tolerance
    The products and residuals round where diffusers rounds (bit-identical); the RMSNorm statistics are fp32 in
    another summation order: one ulp of the norm's output where that crosses a rounding boundary
    (``ops/_rms_modulate.py``); ``silu``'s ``exp`` may differ in its last fp32 bit (``ops/_swiglu.py``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses these blocks' norms for eager mode (e.g. through its kernels hub).
"""
from .._core.declare import Patch
from ._fused_common import FUSED_REQUIRES, LINEAR, SILU, fused_target

_BODY = "torchpatches.patches._bodies.rms_sandwich_block"
_ZIMAGE = "diffusers.models.transformers.transformer_z_image"
_IDEOGRAM4 = "diffusers.models.transformers.transformer_ideogram4"
_NORMALIZATION = "diffusers.models.normalization"
#: What the replaced stretch reaches through modules (per target: each may name only its own module and torch's).
_ASSUMES = SILU + LINEAR + (f"{_NORMALIZATION}:RMSNorm.forward",)

PATCH = Patch(
    name="rms_sandwich_block",
    summary="Z-Image / Ideogram 4 blocks: RMSNorm sandwich, modulation, gated residuals, SwiGLU in four kernels (eager)",
    targets=(  # fingerprints: diffusers 0.42.1 (the feed-forwards' methods: the body's _FEED_FORWARDS)
        fused_target("rms_sandwich_block", f"{_ZIMAGE}:ZImageTransformerBlock.forward", f"{_BODY}:zimage",
                     "c45a8f5c8b5ce5b0", _ASSUMES + (f"{_ZIMAGE}:FeedForward.forward",
                                                     f"{_ZIMAGE}:FeedForward._forward_silu_gating")),
        fused_target("rms_sandwich_block", f"{_IDEOGRAM4}:Ideogram4TransformerBlock.forward", f"{_BODY}:ideogram4",
                     "f480d0af2f372338", _ASSUMES + (f"{_IDEOGRAM4}:Ideogram4MLP.forward",)),
    ),
    # The norm the fused stretch computes in diffusers' place (diffusers 0.42.1): another source skips the patch.
    verifies={f"{_NORMALIZATION}:RMSNorm.forward": frozenset({"25f4c6d067d464a9"})},
    requires=FUSED_REQUIRES,
)
