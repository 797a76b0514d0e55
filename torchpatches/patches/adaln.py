"""adaln: diffusers' adaptive LayerNorms (LayerNorm + ``* (1 + scale) + shift``) as one kernel in eager mode.

What goes wrong upstream
    ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle`` and ``AdaLayerNormContinuous``
    (``diffusers/models/normalization.py``) compute ``self.norm(x) * (1 + scale) + shift`` as four
    eager ops (LayerNorm, ``1 + scale``, multiply, add): three full passes over the ``[B, S, D]``
    activations, and torch's LayerNorm kernel itself runs far below the memory bandwidth at FLUX's
    widths (LayerNorm alone was 9.2 ms of a 151.6 ms eager FLUX.1-dev step on an H100).
    ``torch.compile`` fuses all of it; eager users pay it on every block. No upstream issue or fix as
    of diffusers 0.42.1.

What the patch changes
    The three ``forward`` methods run the embedding Linear as before (``self.linear(self.silu(emb))``,
    so LoRA layers and hooks on it keep working; a stock ``nn.Linear`` is called as its ``forward`` would,
    ``F.linear``, without the module call path) and then ``torchpatches.ops.layer_norm_modulate``:
    one pass that reads ``x`` once and writes the modulated output once. The same kernel is used for the
    LayerNorm + modulate that FLUX.1's double block (``norm2``) and FLUX.2's blocks write inline, by the
    ``gate_residual`` patch while this one is applied. Every call the kernel does not cover goes to
    diffusers' own forward: ``torch.compile`` (Inductor fuses it already), norms other than a stock
    ``nn.LayerNorm`` without affine parameters (``fp32_layer_norm``, ``rms_norm``, affine norms), hooked
    norms, gradients (also forward AD and functorch transforms), ``torch.jit.trace``, autocast, a replaced
    global of the original or of ``F.layer_norm`` / ``LayerNorm.forward``, tensor subclasses, CPU tensors,
    mismatched dtypes.

Tolerance
    Bit-identical to diffusers except where the fp32 LayerNorm statistics differ in their last bit
    from torch's (another summation order) and that crosses a rounding boundary: one ulp of the
    LayerNorm output, carried through the modulation (``ops/_modulate.py``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4 (tested on 2.11 and 2.13; GPU on
    2.11.0+cu130).

When to delete
    When diffusers ships fused adaLN kernels for eager mode (e.g. through its kernels hub).
"""
from .._core.declare import Patch
from ._fused_common import FUSED_REQUIRES, LAYER_NORM, LINEAR, fused_target

_BODY = "torchpatches.patches._bodies.adaln"
_NORMALIZATION = "diffusers.models.normalization"

#: (class, body, fingerprint of its forward in diffusers 0.42.1)
ADALN = (("AdaLayerNormZero", "_zero", "099c201ecf64710b"), ("AdaLayerNormZeroSingle", "_zero_single", "6e0c5aa5daa844ce"),
         ("AdaLayerNormContinuous", "_continuous", "9cc655ba4fb2bfec"))

PATCH = Patch(
    name="adaln", summary="diffusers adaLN (LayerNorm + modulate) as one kernel in eager mode",
    targets=tuple(fused_target("adaln", f"{_NORMALIZATION}:{name}.forward", f"{_BODY}:{body}", fingerprint,
                               LAYER_NORM + LINEAR) for name, body, fingerprint in ADALN),
    requires=FUSED_REQUIRES,
)
