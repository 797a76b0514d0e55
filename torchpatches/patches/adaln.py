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
from __future__ import annotations

from typing import Any

import torch

from .._core.declare import Patch
from ._fused_common import FALLBACK, FUSED_REQUIRES, LAYER_NORM, LINEAR, fusable, fused_target, linear, plain_layer_norm
from ._modulate_calls import modulated

__all__ = ["PATCH"]

_NORMALIZATION = "diffusers.models.normalization"


def _covered(self: Any, x: Any, *tensors: Any) -> bool:
    """A [B, S, D] activation the kernel serves and a stock affine-free LayerNorm."""
    return fusable(x, (self,), *tensors) and x.dim() == 3 and plain_layer_norm(self.norm, x.shape[-1])


def _zero(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    if not _covered(self, x, emb):
        return FALLBACK
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = linear(self.linear, self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = modulated(self.norm, x, scale_msa, shift_msa, fuse=True)
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _zero_single(self, x, emb=None):
    if not _covered(self, x, emb):
        return FALLBACK
    emb = linear(self.linear, self.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    x = modulated(self.norm, x, scale_msa, shift_msa, fuse=True)
    return x, gate_msa


def _continuous(self, x, conditioning_embedding):
    if not _covered(self, x, conditioning_embedding):
        return FALLBACK
    emb = linear(self.linear, self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return modulated(self.norm, x, scale, shift, fuse=True)


#: (class, body, fingerprint of its forward in diffusers 0.42.1)
ADALN = (("AdaLayerNormZero", _zero, "099c201ecf64710b"), ("AdaLayerNormZeroSingle", _zero_single, "6e0c5aa5daa844ce"),
         ("AdaLayerNormContinuous", _continuous, "9cc655ba4fb2bfec"))

PATCH = Patch(
    name="adaln", summary="diffusers adaLN (LayerNorm + modulate) as one kernel in eager mode",
    targets=tuple(fused_target("adaln", f"{_NORMALIZATION}:{name}.forward", body, fingerprint, LAYER_NORM + LINEAR)
                  for name, body, fingerprint in ADALN),
    requires=FUSED_REQUIRES,
)
