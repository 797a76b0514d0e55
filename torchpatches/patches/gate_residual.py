"""gate_residual: FLUX.1/FLUX.2 (and Chroma) blocks with ``residual + gate * out`` (and the LayerNorm + modulate after it)
as one kernel, and FLUX.1's single-block concats without their copies (eager).

What goes wrong upstream
    Every FLUX block ends its attention and MLP halves with ``hidden_states + gate.unsqueeze(1) * out``:
    two eager ops (multiply, add), five passes over ``[B, S, D]`` where three suffice; in double blocks
    the result is immediately LayerNormed and modulated (``norm2(h) * (1 + scale) + shift``, four more
    ops, inline in the block's forward). FLUX.1's single block also concatenates its inputs
    (``torch.cat([encoder_hidden_states, hidden_states])``, although the previous single block returned
    them as two adjacent slices of one tensor) and concatenates the attention output with the GELU'd MLP
    output (``torch.cat([attn, gelu(mlp)], dim=2)``, a copy of ``[B, S, 5 * D]``) right before
    ``proj_out``. ``torch.compile`` removes all of it; eager users pay it in every block.

What the patch changes
    The four block ``forward`` methods (``FluxTransformerBlock``, ``FluxSingleTransformerBlock``,
    ``Flux2TransformerBlock``, ``Flux2SingleTransformerBlock``) and Chroma's two (FLUX.1's with pruned modulation:
    ``ChromaAdaLayerNormZero(Single)Pruned``'s LayerNorm + modulation through the modulate op too, and the text mask
    passed on as their ``[B, 1, S, S]`` product, built per block as diffusers does) keep every module call of
    diffusers' code
    (norm1, attention, feed-forward, projections: LoRA layers and hooks on them keep working; a stock
    attention module's processor is called as its ``forward`` would, below) and replace the tensor glue:

    - ``residual + gate * out`` by ``ops.gate_residual`` (one pass), with the fp16 clip where
      diffusers clips;
    - ``h = h + gate * attn`` followed by the inline LayerNorm + modulate by
      ``ops.gate_residual_layer_norm_modulate`` (one pass, two outputs) while the ``adaln`` patch
      is applied, and FLUX.2's inline pre-attention LayerNorm + modulate by ``layer_norm_modulate``;
    - FLUX.1 single block: the input concat is a view when the two inputs are adjacent slices of one
      tensor (every single block after the first), and ``gelu(proj_mlp(x))`` is written straight into the
      buffer ``proj_out`` reads (torch's own GELU kernel with ``out=``, so the values are diffusers'), so
      only the attention output is copied into it; ``proj_mlp`` and ``proj_out``, where stock ``nn.Linear``
      layers, are called as their ``forward`` would (``F.linear``) without the module call path;
    - the attention call: diffusers' attention ``forward`` (``FluxAttention``, ``Flux2Attention``,
      ``Flux2ParallelSelfAttention``) reads its processor's signature with ``inspect.signature`` on every
      call (about 20-40 us of host time, 57 calls per FLUX.1-dev step) to filter keyword arguments, then
      calls the processor with its arguments. With no keyword arguments to filter and a stock attention
      module (exactly that class, no hooks, no ``forward`` on the instance, the class's ``forward`` the one
      read, its source verified), the block calls the processor as that ``forward`` would, without the lookup.

    Every call it does not cover runs diffusers' forward: ``torch.compile``, ``torch.jit.trace``, IP-adapter
    processors (FLUX.1 double block), hooked or non-stock norms and activations it would skip, gradients
    (also forward AD and functorch transforms), autocast, a replaced global of the block or of
    ``F.layer_norm`` / ``F.gelu`` / ``torch.cat``, tensor subclasses, CPU tensors.

Tolerance
    Bit-identical to diffusers for the gate + residual (same roundings); the fused LayerNorm as in the
    ``adaln`` patch (one ulp where fp32 statistics differ in their last bit).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers fuses the block glue for eager mode.
"""
from __future__ import annotations

from typing import Any

from .._core.declare import Patch, Target
from ._fused_common import CAT, FUSED_REQUIRES, GELU, LAYER_NORM, LINEAR, fused_target

_BODY = "torchpatches.patches._bodies.gate_residual"
_FLUX = "diffusers.models.transformers.transformer_flux"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"
_CHROMA = "diffusers.models.transformers.transformer_chroma"
#: What the replaced glue reaches through modules (norm2 / norm2_context, the single block's concat).
_ASSUMES = LAYER_NORM + CAT


def _target(qualname: str, body: Any, fingerprint: str, assumes: tuple) -> Target:
    return fused_target("gate_residual", qualname, body, fingerprint, _ASSUMES + assumes)


PATCH = Patch(
    name="gate_residual",
    summary="FLUX blocks: gate + residual (+ next LayerNorm/modulate) in one kernel, concats without copies (eager)",
    targets=(  # fingerprints: diffusers 0.42.1; each assumes the forward of the attention it calls past
        _target(f"{_FLUX}:FluxTransformerBlock.forward", f"{_BODY}:_flux_double", "2ddc89c799fd6eca",
                (f"{_FLUX}:FluxAttention.forward",)),
        _target(f"{_FLUX}:FluxSingleTransformerBlock.forward", f"{_BODY}:_flux_single", "febf6aee7ca882b6",
                GELU + LINEAR + (f"{_FLUX}:FluxAttention.forward",)),  # proj_mlp, proj_out: linear()
        _target(f"{_FLUX2}:Flux2TransformerBlock.forward", f"{_BODY}:_flux2_double", "47bed5da14990da5",
                (f"{_FLUX2}:Flux2Attention.forward",)),
        _target(f"{_FLUX2}:Flux2SingleTransformerBlock.forward", f"{_BODY}:_flux2_single", "12422e38cc8c135b",
                (f"{_FLUX2}:Flux2ParallelSelfAttention.forward",)),
        _target(f"{_CHROMA}:ChromaTransformerBlock.forward", f"{_BODY}:_chroma_double", "2424ca9ddb6fd440",
                (f"{_FLUX}:FluxAttention.forward",)),
        _target(f"{_CHROMA}:ChromaSingleTransformerBlock.forward", f"{_BODY}:_chroma_single", "408706ac8b77b92c",
                GELU + LINEAR + (f"{_FLUX}:FluxAttention.forward",)),
    ),
    # The attention forwards the blocks call past (their source: diffusers 0.42.1; compile_warnings' copies of
    # them have the same fingerprints): another source skips the patch.
    verifies={f"{_FLUX}:FluxAttention.forward": frozenset({"d12ce2e9a0852e06"}),
              f"{_FLUX2}:Flux2Attention.forward": frozenset({"7c05eda1d782aa24"}),
              f"{_FLUX2}:Flux2ParallelSelfAttention.forward": frozenset({"7d9744609d245c93"})},
    requires=FUSED_REQUIRES,
)
