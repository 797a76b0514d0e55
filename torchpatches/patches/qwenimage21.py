"""qwenimage21: QwenImage 2.1's blocks, attention processor and final norm: the block glue in three kernels, the
SwiGLU product in one, q/k RMSNorm + complex RoPE in one, k behind the cached keys, the final norm in one (eager).

What goes wrong upstream
    ``QwenImage21TransformerBlock`` slices its scales and gates out of the model's shared modulation and selects each
    per token (``_select_modulation_rows``: a ``torch.where`` writing a ``[B, S, D]`` tensor, four per block, the
    same four in every block of the step), then runs ``img_norm1``, ``1 + scale``, the product, ``gate.tanh()``, the
    gated residual, ``img_norm2`` and its modulation, the SwiGLU's ``silu`` and product and the second gated residual
    as separate eager ops: about 20 passes over the activations per block where ``torch.compile`` makes a handful.
    The final ``QwenImage21AdaLayerNormContinuous`` selects its scale per token and modulates the same way.
    ``QwenImage21AttnProcessor`` normalizes q and k with diffusers' ``RMSNorm`` (eight eager ops each), casts them,
    rotates them through ``apply_rotary_emb_qwen`` in complex form (fp32 cast, complex multiply, cast back) and, in
    the KV-cached steps, copies k once more behind the cached keys (``torch.cat``).

What the patch changes
    The block's ``forward`` calls attention and the feed-forward's Linears as modules (LoRA layers and hooks on them
    keep working); in between it runs ``torchpatches.ops`` modulate (LayerNorm, ``"each"`` rounding):
    ``img_norm1(x) * (1 + scale1)`` in one kernel (with a zero shift: exact), ``x + tanh(gate1) * attn`` with
    ``img_norm2(x) * (1 + scale2)`` in one, ``x + tanh(gate2) * ff`` (and the fp16 clip) in one; and
    ``silu(gate_layer(y)) * proj(y)`` through the two-input ``ops.swiglu``. Each token's modulation row (its
    sample's for the target image, the ``t = 0`` row for the prompt: ``_select_modulation_rows``) is chosen in the
    kernels (``select``) from the shared ``[B + 1, D]`` rows, ``tanh`` taken of the gate rows: no ``[B, S, D]``
    vector tensors (diffusers writes four per block) and no ``tanh`` pass over them; the final norm's
    ``norm(x) * (1 + scale)`` likewise in one kernel (its Linear and SiLU called as modules). The
    processor runs the projections, the values' KV-cache concat and the attention call as diffusers does
    (``dispatch_attention_fn`` with the processor's backend and mask) and replaces the q/k stretch by
    ``ops.qk_norm_rope(rounding="each")`` with the complex ``[S, D/2]`` table as fp32 ``cos``/``sin``
    (``_per_step.complex_tables``: once per step, per block under ``torch.inference_mode()``), writing k behind the
    cached keys (``k_prefix``: the keys' concat costs no pass over k); its PyTorch tier rotates with diffusers' own
    complex multiply and concatenates as diffusers does. The prefill (the first step of a KV-cached run, every step
    without the cache) attends per segment with diffusers' own calls and masks. Everything else runs
    diffusers' own code: ``torch.compile``, gradients, autocast, tensor subclasses, CPU tensors, norms that are not
    stock (``nn.LayerNorm`` without affine parameters, diffusers ``RMSNorm`` with a weight of the activations'
    dtype), a modulation or mask of another shape or dtype, hooked or replaced submodules, a replaced global
    (``_select_modulation_rows``, ``apply_rotary_emb_qwen``, ``_qwenimage21_prepare_qkv``,
    ``dispatch_attention_fn``) or a replaced ``_modulate`` / ``QwenImage21SwiGLUFeedForward.forward`` /
    ``RMSNorm.forward`` / ``F.layer_norm`` / ``F.silu`` / ``F.linear`` / ``torch.cat``.

Tolerance
    The products, sums and residuals round where diffusers rounds (bit-identical; a zero's sign may differ:
    ``n * (1 + scale) + 0``); the LayerNorm and RMSNorm statistics are fp32 in another summation order: one ulp of
    a norm's output where that crosses a rounding boundary (``ops/_modulate.py``, ``ops/_qk_norm_rope.py``); the
    kernel's real-form rotation may differ from torch's complex multiply by an fp32 fused multiply-add;
    ``silu``'s ``exp`` may differ in its last fp32 bit (``ops/_swiglu.py``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses QwenImage 2.1's block glue and q/k stretch for eager mode.
"""
from .._core.declare import Patch, Target
from ._fused_common import (CAT, DROPOUT, FUSED_REQUIRES, LAYER_NORM, LINEAR, SILU, fused,
                            fused_target)
from ._named_parameters import named_parameters

_BODY = "torchpatches.patches._bodies.qwenimage21"
_Q21 = "diffusers.models.transformers.transformer_qwenimage21"
_RMS_NORM = "diffusers.models.normalization:RMSNorm.forward"

PATCH = Patch(
    name="qwenimage21",
    summary="QwenImage 2.1: block glue in three kernels, SwiGLU, q/k RMSNorm + RoPE, final norm (eager)",
    targets=(  # fingerprints: diffusers 0.42.1
        fused_target("qwenimage21", f"{_Q21}:QwenImage21TransformerBlock.forward", f"{_BODY}:block",
                     "ada3458fdbec5b1f", LAYER_NORM + LINEAR + SILU + (
                         f"{_Q21}:QwenImage21TransformerBlock._modulate", f"{_Q21}:_select_modulation_rows",
                         f"{_Q21}:QwenImage21SwiGLUFeedForward.forward")),
        # named_parameters: the processor's parameters spelled out, as diffusers' other processors.
        Target(f"{_Q21}:QwenImage21AttnProcessor.__call__", named_parameters(fused(
            "qwenimage21", f"{_BODY}:processor", LINEAR + DROPOUT + CAT + (
                f"{_Q21}:apply_rotary_emb_qwen", _RMS_NORM))), frozenset({"caee7f5e6ef67597"})),
        fused_target("qwenimage21", f"{_Q21}:QwenImage21AdaLayerNormContinuous.forward", f"{_BODY}:norm_out",
                     "d15777704c87410a", LAYER_NORM + (f"{_Q21}:_select_modulation_rows",)),
    ),
    # What the bodies compute in place of diffusers' own (diffusers 0.42.1): another source skips the patch.
    verifies={f"{_Q21}:QwenImage21TransformerBlock._modulate": frozenset({"9d319704db4c5acd"}),
              f"{_Q21}:_select_modulation_rows": frozenset({"0bb95ec8f022697b"}),
              f"{_Q21}:QwenImage21SwiGLUFeedForward.forward": frozenset({"9741a0e6493f6414"}),
              f"{_Q21}:_qwenimage21_prepare_qkv": frozenset({"9ee3a2cadb728874"})},
    requires=FUSED_REQUIRES,
)
