"""flux3: FLUX.3's blocks and attention processor: the per-token adaLN glue, the fp32 q/k norm + RoPE chain and the
SwiGLU as single kernels (eager).

What goes wrong upstream
    ``Flux3AttnProcessor`` casts q and k to fp32 (``query.float()``), runs each through ``nn.RMSNorm`` (fp32 weights:
    ``_keep_in_fp32_modules``), rotates them with ``apply_rotary_emb`` in fp32 and casts back: about ten passes over
    fp32 copies of q and k per attention call where one read and one write suffice. ``Flux3ModeTransformerBlock`` and
    ``Flux3SingleTransformerBlock`` (single-stream parallel attention + feed-forward, ``x + gate * (attn + ff)``)
    modulate with per-token ``[B, S, D]`` vectors (chunks of ``[B, S, 3D]``) as separate eager ops: LayerNorm,
    ``1 + scale``, ``*``, ``+``, then ``gate *`` and ``+`` per stream; ``Flux3SwiGLU`` (FLUX.2's, copied) is two ops
    over the ``[S, 2F]`` projection; ``Flux3AdaLayerNorm`` (``norm_out``) is the LayerNorm and modulation again.

What the patch changes
    The processor runs the projections (module calls: LoRA layers and hooks keep working) and the attention call as
    diffusers does; between them ``ops.qk_norm_rope`` with ``rounding="fp32"`` normalizes and rotates q and k in one
    launch, fp32 until the one rounding after RoPE, as diffusers rounds. The blocks call their attention and
    feed-forward as modules and run ``norm(x) * (1 + scale) + shift`` as one kernel per stream
    (``ops.layer_norm_modulate``, per-token vectors read in place through their row strides; in the single blocks
    each stream's kernel writes its rows of the joint ``[text; image]`` buffer, so the ``torch.cat`` costs no pass)
    and ``x + gate * (attn + ff)`` as one kernel per stream (``ops.gate_residual`` with ``y2``: the branch sum, the
    gate and the residual in one pass, each stream reading its rows of both branch outputs, so the single block's
    sum and ``split`` cost none either). ``Flux3SwiGLU.forward`` runs ``ops.swiglu`` (the ``swiglu`` pattern's
    body); ``norm_out`` its modulation through ``ops.layer_norm_modulate``.
    Everything else runs diffusers' own code: ``torch.compile``, gradients, autocast, tensor subclasses, CPU tensors,
    norms that are not stock ``nn.LayerNorm`` without affine parameters or stock ``nn.RMSNorm`` (q/k), modulation
    vectors of another dtype or shape, RoPE tables that are not fp32 ``[S, D]``, extra arguments, a replaced global
    (``dispatch_attention_fn``, ``F.layer_norm``, ``F.rms_norm``, ``apply_rotary_emb``, ``F.silu``, ``torch.cat``).

Tolerance
    The glue rounds where diffusers rounds; the LayerNorm and RMSNorm statistics are fp32 in another summation order
    (and fused multiply-adds on the GPU): one ulp of the output dtype where that crosses a rounding boundary
    (``ops/_modulate.py``, ``ops/_qk_norm_rope.py``). With the PyTorch tier: diffusers' values bit for bit.

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses FLUX.3's block glue and q/k chain for eager mode.
"""
from .._core.declare import Patch, Target
from ._fused_common import CAT, DROPOUT, FUSED_REQUIRES, LAYER_NORM, LINEAR, RMS_NORM, SILU, fused, fused_target
from ._named_parameters import named_parameters

_BODY = "torchpatches.patches._bodies.flux3"
_FLUX3 = "diffusers.models.transformers.transformer_flux3"

PATCH = Patch(
    name="flux3",
    summary="FLUX.3: per-token adaLN glue, fp32 q/k norm + RoPE chain and SwiGLU in single kernels (eager)",
    targets=(  # fingerprints: diffusers 0.42.1
        Target(f"{_FLUX3}:Flux3AttnProcessor.__call__", named_parameters(fused(
            "flux3", f"{_BODY}:processor", RMS_NORM + LINEAR + DROPOUT + (f"{_FLUX3}:_get_projections",))),
            frozenset({"824ca0fb5317c337"})),
        fused_target("flux3", f"{_FLUX3}:Flux3ModeTransformerBlock.forward", f"{_BODY}:mode_block",
                     "4e887201ccbead5b", LAYER_NORM),
        fused_target("flux3", f"{_FLUX3}:Flux3SingleTransformerBlock.forward", f"{_BODY}:single_block",
                     "b7777e4ffa74592e", LAYER_NORM + CAT),
        fused_target("flux3", f"{_FLUX3}:Flux3SwiGLU.forward", f"{_BODY}:swiglu", "e565d6e467a53e9b", SILU),
        fused_target("flux3", f"{_FLUX3}:Flux3AdaLayerNorm.forward", f"{_BODY}:norm_out", "14fad1e39d2af098",
                     LAYER_NORM + LINEAR),
    ),
    # The projection function the processor's stand-in replaces (diffusers 0.42.1): another source skips the patch.
    verifies={f"{_FLUX3}:_get_qkv_projections": frozenset({"7059a9925cda2e89"}),
              f"{_FLUX3}:_get_projections": frozenset({"019bcb092f452a6b"})},
    requires=FUSED_REQUIRES,
)
