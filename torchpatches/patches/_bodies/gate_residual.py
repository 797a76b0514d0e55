"""The ``gate_residual`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/gate_residual.py``."""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional, Tuple

import torch

from ..._core.lazy import lazy_module
from .._fused_common import FALLBACK, FLOAT_DTYPES, fusable, linear, pattern_on, stock
from .._double_stream import Double, Stream, double_stream, stock_processor
from .._modulate_calls import modulated, residual

_FLUX = "diffusers.models.transformers.transformer_flux"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"
_CHROMA = "diffusers.models.transformers.transformer_chroma"


def joined(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``torch.cat([first, second], dim=1)``, as a view when ``second`` starts where ``first`` ends.

    The previous FLUX.1 single block returns ``out[:, :T]`` and ``out[:, T:]`` of one contiguous tensor;
    viewing them as one is what the concat would compute, without the copy. The view aliases that
    tensor, which nothing writes to (every block writes new tensors).
    """
    if (
        type(first) is torch.Tensor
        and type(second) is torch.Tensor
        and first.dim() == 3
        and second.dim() == 3
        and first.dtype == second.dtype
        and first.device == second.device
        and first.shape[0] == second.shape[0]
        and first.shape[2] == second.shape[2]
        and first.stride() == second.stride()
        and first.stride(2) == 1
        and first.stride(1) == first.shape[2]
        and (first.shape[0] == 1 or first.stride(0) == (first.shape[1] + second.shape[1]) * first.stride(1))
        and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        and second.storage_offset() == first.storage_offset() + first.shape[1] * first.stride(1)
    ):
        B, T, D = first.shape
        return first.as_strided((B, T + second.shape[1], D), first.stride(), first.storage_offset())
    return torch.cat([first, second], dim=1)


#: ``torchpatches.ops.slices``, imported at the first fused call (it registers torch.library ops).
_slices_ops = lazy_module("torchpatches.ops._slices")


def _plain(t: Any) -> bool:
    return type(t) is torch.Tensor and t.dtype in FLOAT_DTYPES


def _block_ok(block: Any, *tensors: Any) -> bool:
    x = tensors[0]
    return (
        fusable(x, (block,), *tensors[1:])
        and x.dim() == 3
        and all(type(t) is torch.Tensor for t in tensors if t is not None)
    )


def _attention(attn: Any, where: Tuple[str, str], kwargs: Any, processor_args: tuple, **named: Any) -> Any:
    """``attn(**named, **kwargs)``, the block's call in diffusers 0.42.1; where :func:`stock_processor` allows it,
    the call that attention's ``forward`` makes instead, ``attn.processor(attn, *processor_args)``, without its
    signature lookup. ``where``: the (module, class) of the block's stock attention."""
    processor = stock_processor(attn, *where, kwargs)
    if processor is not None:
        return processor(attn, *processor_args)
    return attn(**named, **(kwargs or {}))


#: FLUX.1's double block (Chroma's too): adaLN-Zero norm1 modules, norm2 through the modulate op while adaln is on,
#: the fp16 clip on the text stream only, FluxAttention's processor called directly.
_FLUX_DOUBLE = Double(Stream("norm1", "norm2", "ff"), Stream("norm1_context", "norm2_context", "ff_context", clip=True),
                      processor=(_FLUX, "FluxAttention"))
_FLUX2_DOUBLE = dataclasses.replace(_FLUX_DOUBLE, processor=(_FLUX2, "Flux2Attention"))


def _flux_double(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                 joint_attention_kwargs=None):
    if not (_block_ok(self, hidden_states, encoder_hidden_states, temb)
            and type(self.attn.processor) is sys.modules[_FLUX].FluxAttnProcessor):  # not IP-adapter (3 outputs)
        return FALLBACK
    return double_stream(_FLUX_DOUBLE, self, hidden_states, encoder_hidden_states, temb,
                         {"image_rotary_emb": image_rotary_emb}, joint_attention_kwargs)


def _flux_single(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                 joint_attention_kwargs=None):
    if not (_block_ok(self, hidden_states, encoder_hidden_states, temb) and _tanh_gelu(self.act_mlp)):
        return FALLBACK
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = joined(encoder_hidden_states, hidden_states)
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    hidden_states = _single_rest(self, hidden_states, norm_hidden_states, gate, image_rotary_emb,
                                 joint_attention_kwargs)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def _tanh_gelu(act: Any) -> bool:
    return stock(act, torch.nn.GELU) and act.approximate == "tanh"


def _single_rest(self, residual_states, norm_hidden_states, gate, image_rotary_emb, joint_attention_kwargs,
                 **mask: Any) -> torch.Tensor:
    """FLUX.1's single block (and Chroma's) from the MLP projection on: ``[attention | gelu(mlp)]`` written into
    one buffer, ``proj_out``, the gated residual. ``mask``: ``attention_mask=`` where the block passes one."""
    slices = _slices_ops()
    mlp = linear(self.proj_mlp, norm_hidden_states)
    # [attention output | gelu(mlp)]: the GELU writes its half of proj_out's input directly.
    width = self.attn.inner_dim
    buf = mlp.new_empty((*mlp.shape[:-1], width + mlp.shape[-1]))
    if _plain(mlp):  # the buffer was just allocated from it: same shape, dtype, device, no shared memory
        slices.prechecked(mlp, buf[..., width:], gelu=True)
    else:
        slices.gelu_tanh_into(mlp, buf[..., width:])
    del mlp
    attn_output = _attention(self.attn, (_FLUX, "FluxAttention"), joint_attention_kwargs,
                             (norm_hidden_states, None, mask.get("attention_mask"), image_rotary_emb),
                             hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb, **mask)
    if _plain(attn_output) and attn_output.shape == buf[..., :width].shape and attn_output.dtype == buf.dtype \
            and attn_output.device == buf.device and _plain(buf):
        slices.prechecked(attn_output, buf[..., :width], gelu=False)
    else:  # a processor returned another width or dtype: the concat diffusers would do
        buf = torch.cat([attn_output, buf[..., width:]], dim=2)
    return residual(residual_states, gate, linear(self.proj_out, buf), clip=True)


def _flux2_double(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb=None,
                  joint_attention_kwargs=None):
    if not _block_ok(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt):
        return FALLBACK
    split = sys.modules[_FLUX2].Flux2Modulation.split
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = split(temb_mod_img, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = split(temb_mod_txt, 2)
    fuse = pattern_on("adaln")
    image = (modulated(self.norm1, hidden_states, scale_msa, shift_msa, fuse=fuse), gate_msa, shift_mlp, scale_mlp,
             gate_mlp)
    text = (modulated(self.norm1_context, encoder_hidden_states, c_scale_msa, c_shift_msa, fuse=fuse), c_gate_msa,
            c_shift_mlp, c_scale_mlp, c_gate_mlp)
    return double_stream(_FLUX2_DOUBLE, self, hidden_states, encoder_hidden_states, None,
                         {"image_rotary_emb": image_rotary_emb}, joint_attention_kwargs, image, text)


def _flux2_single(self, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb=None,
                  joint_attention_kwargs=None, split_hidden_states=False, text_seq_len=None):
    if not _block_ok(self, hidden_states, encoder_hidden_states, temb_mod):
        return FALLBACK
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = joined(encoder_hidden_states, hidden_states)
    mod_shift, mod_scale, mod_gate = sys.modules[_FLUX2].Flux2Modulation.split(temb_mod, 1)[0]
    norm_hidden_states = modulated(self.norm, hidden_states, mod_scale, mod_shift, fuse=pattern_on("adaln"))
    attn_output = _attention(self.attn, (_FLUX2, "Flux2ParallelSelfAttention"), joint_attention_kwargs,
                             (norm_hidden_states, None, image_rotary_emb),  # no encoder_hidden_states parameter
                             hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb)
    hidden_states = residual(hidden_states, mod_gate, attn_output, clip=True)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


# ---- Chroma: FLUX.1's blocks with pruned modulation (vectors from the model, no Linear) and a text mask ----------


def _pruned(norm: Any, cls_name: str, x: torch.Tensor, emb: torch.Tensor, chunks: int) -> Optional[tuple]:
    """``norm(x, emb=emb)`` for a stock ``ChromaAdaLayerNormZero(Single)Pruned`` without its own embedder: its
    LayerNorm + modulation through the modulate op (diffusers 0.42.1's chunking), the other vectors as they are;
    None for another norm."""
    if not (stock(norm, getattr(sys.modules[_CHROMA], cls_name)) and getattr(norm, "emb", None) is None):
        return None
    shift, scale, *rest = emb.flatten(1, 2).chunk(chunks, dim=1)
    return (modulated(norm.norm, x, scale, shift, fuse=pattern_on("adaln")), *rest)


def _outer(attention_mask: Any) -> Any:
    """Chroma's block-level ``[B, 1, S, S]`` mask, as its blocks build it (once per block, as in diffusers)."""
    if attention_mask is None:
        return None
    return attention_mask[:, None, None, :] * attention_mask[:, None, :, None]


def _chroma_double(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_mask=None,
                   joint_attention_kwargs=None):
    if not (_block_ok(self, hidden_states, encoder_hidden_states, temb, attention_mask)
            and type(self.attn.processor) is sys.modules[_FLUX].FluxAttnProcessor):  # not IP-adapter (3 outputs)
        return FALLBACK
    img = _pruned(self.norm1, "ChromaAdaLayerNormZeroPruned", hidden_states, temb[:, :6], 6)
    txt = _pruned(self.norm1_context, "ChromaAdaLayerNormZeroPruned", encoder_hidden_states, temb[:, 6:], 6)
    if img is None or txt is None:
        return FALLBACK
    return double_stream(_FLUX_DOUBLE, self, hidden_states, encoder_hidden_states, None,
                         {"image_rotary_emb": image_rotary_emb, "attention_mask": _outer(attention_mask)},
                         joint_attention_kwargs, img, txt)


def _chroma_single(self, hidden_states, temb, image_rotary_emb=None, attention_mask=None,
                   joint_attention_kwargs=None):
    if not (_block_ok(self, hidden_states, temb, attention_mask) and _tanh_gelu(self.act_mlp)):
        return FALLBACK
    norm = _pruned(self.norm, "ChromaAdaLayerNormZeroSinglePruned", hidden_states, temb, 3)
    if norm is None:
        return FALLBACK
    return _single_rest(self, hidden_states, norm[0], norm[1], image_rotary_emb, joint_attention_kwargs,
                        attention_mask=_outer(attention_mask))
