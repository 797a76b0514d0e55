"""krea2: Krea 2's blocks and attention processor: the block glue in four kernels, q/k norm + RoPE + GQA repeat in
one, the sigmoid output gate in one, no signature inspection per block's attention call (eager).

What goes wrong upstream
    ``Krea2TransformerBlock`` forms its six modulation vectors (``temb + scale_shift_table``), then runs each
    zero-centered ``Krea2RMSNorm`` as five eager kernels over ``[B, S, D]`` (``float()``, ``weight + 1``, the fp32
    ``rms_norm``, the cast back) and the modulation ``(1 + scale) * n + shift``, the gated residuals and the SwiGLU's
    ``silu`` and product as separate ops: about 25 passes over the activations per block where ``torch.compile``
    makes a handful. ``Krea2AttnProcessor`` normalizes q and k the same way per head, rotates them through
    ``apply_rotary_emb`` (five passes each) and copies k for its grouped-query attention (``repeat_interleave``);
    ``Krea2Attention.forward`` calls ``inspect.signature`` on its processor at every call.

What the patch changes
    The block's ``forward`` calls attention and the feed-forward's Linears as modules (LoRA layers and hooks on them
    keep working); in between it runs ``torchpatches.ops`` modulate with Krea 2's zero-centered RMSNorm (the six
    vectors summed from ``temb`` and the table inside the kernels): ``(1 + prescale) * norm1(x) + preshift`` in one
    kernel, ``x + pregate * attn`` with ``(1 + postscale) * norm2(x) + postshift`` in one, ``x + postgate * ff`` in
    one; and ``silu(gate(y)) * up(y)`` through the two-input ``ops.swiglu``. The processor runs the projections and
    the attention call as diffusers does and replaces the q/k stretch by ``ops.qk_norm_rope``
    (``rounding="zero_centered"``, ``k_repeat``: k normalized, rotated and written with q's heads in one launch) and
    the output gate ``hidden_states * sigmoid(gate)`` by ``ops.swiglu(gate, hidden_states, activation="sigmoid")``;
    v's repeat is diffusers' code. The block hands a stock ``Krea2Attention`` (no
    hooks) its call as its ``forward`` does, without the signature inspection (no extra keyword arguments: nothing
    to filter); the text-fusion blocks' attention calls still inspect. Everything else runs
    diffusers' own code: ``torch.compile``, gradients, autocast, tensor subclasses, CPU tensors, norms that are not
    stock ``Krea2RMSNorm`` with a float weight, a ``temb`` or table of another shape or dtype, hooked or replaced
    submodules, a replaced global (``apply_rotary_emb``, ``dispatch_attention_fn``) or a replaced
    ``Krea2RMSNorm.forward`` / ``Krea2SwiGLU.forward`` / ``Krea2Attention.forward`` / ``F.silu`` /
    ``torch.sigmoid`` / ``F.linear``.

Tolerance
    The products, sums and residuals round where diffusers rounds (bit-identical); the RMSNorm statistics are fp32 in
    another summation order: one ulp of a norm's output where that crosses a rounding boundary (``ops/_modulate.py``,
    ``ops/_qk_norm_rope.py``); ``silu``'s and ``sigmoid``'s ``exp`` may differ in its last fp32 bit
    (``ops/_swiglu.py``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses Krea 2's block glue and q/k stretch for eager mode.
"""
from .._core.declare import Patch, Target
from ._fused_common import FUSED_REQUIRES, LINEAR, SILU, fused, fused_target
from ._named_parameters import named_parameters

_BODY = "torchpatches.patches._bodies.krea2"
_KREA2 = "diffusers.models.transformers.transformer_krea2"
#: The module methods the fused stretches compute in diffusers' place (checked per call by ``fused``).
_NORM = (f"{_KREA2}:Krea2RMSNorm.forward",)

PATCH = Patch(
    name="krea2",
    summary="Krea 2: block glue in four kernels, q/k norm + RoPE + GQA repeat in one, sigmoid gate in one (eager)",
    targets=(  # fingerprints: diffusers 0.42.1
        # Krea2Attention.forward: the block calls a stock attention's processor as that forward does (compile_warnings
        # replaces the forward itself; its replacement stands for diffusers' here).
        fused_target("krea2", f"{_KREA2}:Krea2TransformerBlock.forward", f"{_BODY}:block", "780ffcae0e1de188",
                     LINEAR + SILU + _NORM + (f"{_KREA2}:Krea2SwiGLU.forward", f"{_KREA2}:Krea2Attention.forward")),
        # named_parameters: diffusers' Attention passes a processor only the keyword arguments its signature names.
        Target(f"{_KREA2}:Krea2AttnProcessor.__call__",
               named_parameters(fused("krea2", f"{_BODY}:processor", LINEAR + _NORM + ("torch:sigmoid",))),
               frozenset({"135f815c490c0d63"})),
    ),
    # The norm the fused stretches compute in diffusers' place (diffusers 0.42.1): another source skips the patch.
    verifies={f"{_KREA2}:Krea2RMSNorm.forward": frozenset({"28606ca99b5ed757"}),
              f"{_KREA2}:Krea2SwiGLU.forward": frozenset({"31145393bdc18dcf"})},
    requires=FUSED_REQUIRES,
)
