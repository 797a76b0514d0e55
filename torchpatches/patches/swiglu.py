"""swiglu: FLUX.2's SwiGLU (``silu(x[..., :F]) * x[..., F:]``) as one kernel in eager mode.

What goes wrong upstream
    ``Flux2SwiGLU.forward`` (``diffusers/models/transformers/transformer_flux2.py``) runs ``silu`` on the
    first half and multiplies by the second half as two eager ops: three reads and two writes of
    ``[tokens, F]`` (FLUX.2-dev: F = 18432) where one read of ``x`` and one write suffice. FLUX.2's single
    blocks then concatenate the result with the attention output, one more full copy.

What the patch changes
    ``Flux2SwiGLU.forward`` calls ``torchpatches.ops.swiglu`` (one Triton kernel) when ``gate_fn`` is
    a stock, unhooked ``nn.SiLU`` and the input is a plain CUDA tensor without gradients; otherwise
    diffusers' forward. While this patch is applied, the ``qk_norm_rope`` patch's FLUX.2 single-block
    processor also writes the SwiGLU output straight into the ``[attention, MLP]`` buffer that
    ``to_out`` reads, so the concat costs only the copy of the attention output.

Tolerance
    Rounds where diffusers rounds (after ``silu`` and after the product); Triton's fp32 ``exp`` may
    differ in its last bit from torch's, so outputs match to one ulp.

Versions
    diffusers 0.42.x (fingerprint verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers ships a fused SwiGLU for eager mode.
"""
from .._core.declare import Patch
from ._fused_common import FUSED_REQUIRES, SILU, fused_target

_BODY = "torchpatches.patches._bodies.swiglu"


PATCH = Patch(
    name="swiglu", summary="FLUX.2 SwiGLU as one kernel in eager mode",
    targets=(fused_target("swiglu", "diffusers.models.transformers.transformer_flux2:Flux2SwiGLU.forward", f"{_BODY}:_swiglu",
                          "e565d6e467a53e9b", SILU),),
    requires=FUSED_REQUIRES,  # the fingerprint: diffusers 0.42.1
)
