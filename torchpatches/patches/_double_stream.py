"""One body for diffusers' joint double-stream blocks (image + text), with each model's differences as data.

SD3's ``JointTransformerBlock``, QwenImage's ``QwenImageTransformerBlock``, HunyuanVideo 1.5's
``HunyuanVideo15TransformerBlock`` and the FLUX.1 / FLUX.2 / Chroma double blocks (diffusers 0.42.1) run the same
stretch: per stream a LayerNorm + modulation (``norm1``), one joint attention call, then per stream
``h + gate_msa * attn`` with the next LayerNorm + modulation (``norm2``), the feed-forward and ``h + gate_mlp * ff``. A :class:`Double` row says where they differ;
:func:`double_stream` runs the stretch with every module call of diffusers' code (norms, attention, feed-forwards:
LoRA layers and hooks keep working) and the tensor glue through ``_modulate_calls``. The callers decide beforehand
whether the call is theirs (each model's eligibility predicate) and may hand in a stream's modulation where their
model computes it its own way (SD3.5's dual-attention norm, SD3's last block, FLUX.2's and Chroma's vectors).

The body reads the block's submodules from ``block._modules`` (what ``block.<name>`` returns for a registered
submodule, without ``nn.Module.__getattr__``'s Python frame: about 0.5 us per lookup, eight lookups per block)."""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple, Optional, Tuple

import torch

from ._fused_common import pattern_on, stock
from ._modulate_calls import modulated, residual, residual_modulated


class Stream(NamedTuple):
    """One stream's modules, by the block's attribute names, and its rounding (a tuple: the body unpacks it in one
    step, host time).

    - ``norm1`` / ``norm2``: the LayerNorm + modulation before the attention and before the feed-forward;
    - ``mlp``: the feed-forward;
    - ``mod``: the Linear that makes the stream's six vectors from ``temb`` (QwenImage: ``(shift, scale, gate)``
      twice) for ``norm1``, a plain LayerNorm; None: ``norm1(x, emb=temb)`` returns them (``AdaLayerNormZero``);
    - ``clip``: diffusers clips the fp16 output of the last residual (QwenImage; FLUX's text stream)."""

    norm1: str
    norm2: str
    mlp: str
    mod: Optional[str] = None
    clip: bool = False


@dataclasses.dataclass(frozen=True)
class Double:
    """How one diffusers 0.42.1 double-stream block differs from the others.

    - ``image`` / ``text``: each stream's :class:`Stream`;
    - ``fuse``: the LayerNorms go through the modulate op while ``adaln`` is applied (None: SD3, whose norm1 are
      adaLN modules) or always (True: the block owns its affine-free LayerNorms, QwenImage, HunyuanVideo 1.5);
    - ``image_first``: the block returns ``(image, text)`` (HunyuanVideo 1.5), not ``(text, image)``;
    - ``processor``: the (module, class) of the block's stock attention whose processor the body may call as that
      attention's ``forward`` would (:func:`stock_processor`; FLUX.1, FLUX.2, Chroma), else None: the module call."""

    image: Stream = Stream("norm1", "norm2", "ff")
    text: Stream = Stream("norm1_context", "norm2_context", "ff_context")
    fuse: Optional[bool] = None
    image_first: bool = False
    processor: Optional[Tuple[str, str]] = None


def stock_processor(attn: Any, module_name: str, cls_name: str, kwargs: Any) -> Any:
    """``attn.processor`` where the block may call it as the attention's ``forward`` would (diffusers 0.42.1):
    no keyword arguments for ``forward`` to filter against the processor's signature, and ``attn`` exactly
    the stock class (no hooks, no ``forward`` on the instance; the class's ``forward`` is an assumption of
    the target, checked per call). Else None: the module call."""
    if kwargs or not stock(attn, getattr(sys.modules[module_name], cls_name)):
        return None
    return attn.processor


def modulation(row: Double, stream: Stream, block: Any, x: torch.Tensor, temb: torch.Tensor) -> tuple:
    """``(norm1 output, gate_msa, shift_mlp, scale_mlp, gate_mlp)`` of one stream, as its block computes them."""
    modules = block._modules
    norm1 = modules[stream.norm1]
    if stream.mod is None:
        return norm1(x, emb=temb)
    first, second = modules[stream.mod](temb).chunk(2, dim=-1)
    shift1, scale1, gate1 = first.chunk(3, dim=-1)
    shift2, scale2, gate2 = second.chunk(3, dim=-1)
    fuse = pattern_on("adaln") if row.fuse is None else row.fuse
    return modulated(norm1, x, scale1, shift1, fuse=fuse), gate1, shift2, scale2, gate2


def _joint_attention(row: Double, attn: Any, image: torch.Tensor, text: torch.Tensor, attention: dict,
                     joint_attention_kwargs: Optional[dict]) -> tuple:
    """``attn(hidden_states=image, encoder_hidden_states=text, **attention, **joint_attention_kwargs)``, or the
    processor call its ``forward`` would make (``row.processor``) without its signature lookup."""
    processor = None if row.processor is None else stock_processor(attn, *row.processor, joint_attention_kwargs)
    if processor is not None:
        return processor(attn, image, text, attention.get("attention_mask"), attention.get("image_rotary_emb"))
    if joint_attention_kwargs:  # a name in both: TypeError, as in diffusers' call
        return attn(hidden_states=image, encoder_hidden_states=text, **attention, **joint_attention_kwargs)
    return attn(hidden_states=image, encoder_hidden_states=text, **attention)


def double_stream(row: Double, block: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                  temb: Any, attention: dict, joint_attention_kwargs: Optional[dict] = None,
                  image: Optional[tuple] = None, text: Optional[tuple] = None) -> tuple:
    """The block's output for a call its caller covers: ``(text, image)``, or as ``row.image_first`` says.

    ``attention``: the keyword arguments of ``block.attn`` besides the two normalized streams (the caller's
    names: ``image_rotary_emb=``, a mask), then ``joint_attention_kwargs``. ``image`` / ``text``: a stream's
    :func:`modulation` where the caller computes it; an image tuple of 7 (SD3.5's dual attention: the second
    normalized input and its gate) runs ``attn2`` on the image stream after the joint attention; a text tuple of
    1 (SD3's ``context_pre_only`` last block: the normalized text only) ends the text stream at the attention and
    returns ``(None, image)``.

    Each stream's tail (``h + gate_msa * attn`` with norm2 + modulation, the feed-forward, ``h + gate_mlp * ff``)
    is written out twice rather than called: host time, per block of every step."""
    image_row, text_row, fuse = row.image, row.text, row.fuse
    modules = block._modules  # block.<name> is nn.Module.__getattr__ in Python: ten times the dict lookup
    norm1, norm2, mlp, mod, clip = image_row
    norm1_context, norm2_context, mlp_context, mod_context, clip_context = text_row
    if image is None:  # an adaLN-Zero module call inline where it is one (host time)
        image = modules[norm1](hidden_states, emb=temb) if mod is None \
            else modulation(row, image_row, block, hidden_states, temb)
    if text is None:
        text = modules[norm1_context](encoder_hidden_states, emb=temb) if mod_context is None \
            else modulation(row, text_row, block, encoder_hidden_states, temb)
    attn_output, context_attn_output = _joint_attention(row, modules["attn"], image[0], text[0], attention,
                                                        joint_attention_kwargs)
    gate_msa = image[1]
    if len(image) == 7:  # diffusers: the first residual alone, attn2, then the fused residual with its gate
        hidden_states = residual(hidden_states, gate_msa, attn_output, clip=False)
        attn_output = modules["attn2"](hidden_states=image[5], **(joint_attention_kwargs or {}))
        gate_msa = image[6]
    hidden_states, normed = residual_modulated(modules[norm2], hidden_states, gate_msa, attn_output,
                                               image[3], image[2], fuse=fuse)
    hidden_states = residual(hidden_states, image[4], modules[mlp](normed), clip=clip)
    if len(text) == 1:
        return None, hidden_states
    encoder_hidden_states, normed = residual_modulated(modules[norm2_context], encoder_hidden_states,
                                                       text[1], context_attn_output, text[3], text[2], fuse=fuse)
    encoder_hidden_states = residual(encoder_hidden_states, text[4], modules[mlp_context](normed),
                                     clip=clip_context)
    if row.image_first:
        return hidden_states, encoder_hidden_states
    return encoder_hidden_states, hidden_states
