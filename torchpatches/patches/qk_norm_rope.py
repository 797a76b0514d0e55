"""qk_norm_rope: FLUX attention processors with q/k RMSNorm, RoPE and the text/image concat in one kernel (eager).

What goes wrong upstream
    Between the QKV projections and the attention call, diffusers' FLUX processors
    (``FluxAttnProcessor``, ``Flux2AttnProcessor``, ``Flux2ParallelSelfAttnProcessor``) run four
    ``torch.nn.RMSNorm`` calls (q, k, and in double blocks the text q, k), three ``torch.cat`` of the
    text and image rows (q, k, v) and two ``apply_rotary_emb`` calls: nine passes over
    ``[B, S, H, D]`` tensors where one read of each input and one write of each output suffice. The
    ``rope`` patch already makes the RoPE one kernel; this patch takes the whole stretch. FLUX.2's single
    blocks also concatenate the attention output with the SwiGLU output before ``to_out``.

What the patch changes
    The three ``__call__`` methods run the projections and the attention exactly as diffusers does
    (module calls, so LoRA layers and hooks on them keep working; a stock ``nn.Linear`` projection, and a stock
    ``nn.Dropout`` in eval mode after ``to_out``, are called as their ``forward`` would, without the module call
    path: about 5 us of host time each, 300 per FLUX.1-dev step) and replace the stretch in between
    by ``torchpatches.ops.qk_norm_rope``: one launch that normalizes q and k per head,
    rotates them and writes q, k (and v) straight into the contiguous joint ``[B, S_txt + S_img, H, D]``
    tensors. For FLUX.2's single blocks, while the ``swiglu`` patch is applied, the SwiGLU output is
    written straight into the buffer ``to_out`` reads (only the attention output is copied into it).
    Under diffusers' context parallelism (a processor with a ``_parallel_config``) the stretch runs on the
    rank's shard of the sequence (the rotary tables are the shard's) and the processor hands its
    ``_parallel_config`` to the attention call, as diffusers' does (the host work the
    stretch saves is on a context-parallel step's critical path).
    Everything else runs diffusers' own ``__call__``: ``torch.compile`` (Inductor fuses this stretch
    itself), norms that are not stock ``torch.nn.RMSNorm`` with a weight of the activations' dtype, hooked
    norms, no rotary embedding or one that is not FLUX's fp32 ``(cos, sin)`` tables, gradients (also forward
    AD and functorch transforms), ``torch.jit.trace``, autocast, a replaced global of the processor (a
    user's own ``apply_rotary_emb``, ``dispatch_attention_fn``) or of ``F.rms_norm`` / ``RMSNorm.forward`` /
    ``torch.cat``, tensor subclasses, CPU tensors.

Tolerance
    torch's fused RMSNorm then diffusers' RoPE, rounding at the same two points; fp32 reduction order
    and fused multiply-adds may move a result by one ulp (``ops/_qk_norm_rope.py``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses q/k norm and RoPE for eager mode (e.g. through its kernels hub).
"""
from __future__ import annotations

from .._core.declare import Patch
from ._fused_common import CAT, DROPOUT, FUSED_REQUIRES, LINEAR, RMS_NORM, SILU, fused_target

_BODY = "torchpatches.patches._bodies.qk_norm_rope"
_FLUX = "diffusers.models.transformers.transformer_flux"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"
#: What the fused stretch skips besides the processors' own globals (checked per call by ``fused``).
_ASSUMES = RMS_NORM + CAT + LINEAR + DROPOUT


def _projections_of(module_name: str) -> tuple:
    """The projection function a processor's ``_get_qkv_projections`` calls: :func:`_projections` stands in for it."""
    return (f"{module_name}:_get_projections",)


PATCH = Patch(
    name="qk_norm_rope",
    summary="FLUX attention processors: q/k RMSNorm + RoPE + text/image concat in one kernel (eager)",
    targets=(  # fingerprints: diffusers 0.42.1
        fused_target("qk_norm_rope", f"{_FLUX}:FluxAttnProcessor.__call__", f"{_BODY}:flux",
                     "6af7ff9528985bcc", _ASSUMES + _projections_of(_FLUX)),
        fused_target("qk_norm_rope", f"{_FLUX2}:Flux2AttnProcessor.__call__", f"{_BODY}:flux2",
                     "e3f195d59c330a7b", _ASSUMES + _projections_of(_FLUX2)),
        fused_target("qk_norm_rope", f"{_FLUX2}:Flux2ParallelSelfAttnProcessor.__call__", f"{_BODY}:flux2_parallel",
                     "31019376b6209552", _ASSUMES + SILU),
    ),
    # The projection functions _projections stands in for (diffusers 0.42.1): another source skips the patch.
    verifies={f"{module}:{name}": frozenset({fingerprint}) for module, name, fingerprint in (
        (_FLUX, "_get_qkv_projections", "418c2abca63c6225"), (_FLUX, "_get_projections", "49221168b024c3c8"),
        (_FLUX2, "_get_qkv_projections", "d5cc5f876e36a190"), (_FLUX2, "_get_projections", "cfbd5526e084f871"))},
    requires=FUSED_REQUIRES,
)
