"""The ``gate_residual`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/gate_residual.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

import torch

from ..._core.lazy import lazy_module
from .._fused_common import FALLBACK, FLOAT_DTYPES, fusable, linear, pattern_on, stock
from .._modulate_calls import modulated, residual, residual_modulated

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


def _processor_of(attn: Any, module_name: str, cls_name: str, kwargs: Any) -> Any:
    """``attn.processor`` where the block may call it as the attention's ``forward`` would (diffusers 0.42.1):
    no keyword arguments for ``forward`` to filter against the processor's signature, and ``attn`` exactly
    the stock class (no hooks, no ``forward`` on the instance; the class's ``forward`` is an assumption of
    the target, checked per call). Else None: the module call."""
    if kwargs or not stock(attn, getattr(sys.modules[module_name], cls_name)):
        return None
    return attn.processor


def _attention(attn: Any, where: Tuple[str, str], kwargs: Any, processor_args: tuple, **named: Any) -> Any:
    """``attn(**named, **kwargs)``, the block's call in diffusers 0.42.1; where :func:`_processor_of` allows it, the
    call that attention's ``forward`` makes instead, ``attn.processor(attn, *processor_args)``, without its
    signature lookup. ``where``: the (module, class) of the block's stock attention."""
    processor = _processor_of(attn, *where, kwargs)
    if processor is not None:
        return processor(attn, *processor_args)
    return attn(**named, **(kwargs or {}))


def _double_rest(self, hidden_states, encoder_hidden_states, norm_hidden_states, norm_encoder_hidden_states,
                 img_mlp, txt_mlp, image_rotary_emb, joint_attention_kwargs, attention: Tuple[str, str],
                 **mask: Any):
    """The shared rest of the double blocks (diffusers 0.42.1) from the attention call on, with the glue fused.
    ``img_mlp`` / ``txt_mlp``: (gate_msa, shift_mlp, scale_mlp, gate_mlp) of each stream; ``attention``: the
    (module, class) of the block's stock attention; ``mask``: ``attention_mask=`` where the block passes one
    (Chroma)."""
    gate_msa, shift_mlp, scale_mlp, gate_mlp = img_mlp
    c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = txt_mlp
    attn_output, context_attn_output = _attention(
        self.attn, attention, joint_attention_kwargs,
        (norm_hidden_states, norm_encoder_hidden_states, mask.get("attention_mask"), image_rotary_emb),
        hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb, **mask,
    )
    hidden_states, norm_hidden_states = residual_modulated(
        self.norm2, hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp
    )
    hidden_states = residual(hidden_states, gate_mlp, self.ff(norm_hidden_states), clip=False)
    encoder_hidden_states, norm_encoder_hidden_states = residual_modulated(
        self.norm2_context, encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp
    )
    encoder_hidden_states = residual(encoder_hidden_states, c_gate_mlp, self.ff_context(norm_encoder_hidden_states),
                                     clip=True)
    return encoder_hidden_states, hidden_states


def _flux_double(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                 joint_attention_kwargs=None):
    if not (_block_ok(self, hidden_states, encoder_hidden_states, temb)
            and type(self.attn.processor) is sys.modules[_FLUX].FluxAttnProcessor):  # not IP-adapter (3 outputs)
        return FALLBACK
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb
    )
    return _double_rest(self, hidden_states, encoder_hidden_states, norm_hidden_states, norm_encoder_hidden_states,
                        (gate_msa, shift_mlp, scale_mlp, gate_mlp), (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp),
                        image_rotary_emb, joint_attention_kwargs, (_FLUX, "FluxAttention"))


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
    norm_hidden_states = modulated(self.norm1, hidden_states, scale_msa, shift_msa, fuse=fuse)
    norm_encoder_hidden_states = modulated(self.norm1_context, encoder_hidden_states, c_scale_msa, c_shift_msa,
                                           fuse=fuse)
    return _double_rest(self, hidden_states, encoder_hidden_states, norm_hidden_states, norm_encoder_hidden_states,
                        (gate_msa, shift_mlp, scale_mlp, gate_mlp), (c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp),
                        image_rotary_emb, joint_attention_kwargs, (_FLUX2, "Flux2Attention"))


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
    return _double_rest(self, hidden_states, encoder_hidden_states, img[0], txt[0], img[1:], txt[1:],
                        image_rotary_emb, joint_attention_kwargs, (_FLUX, "FluxAttention"),
                        attention_mask=_outer(attention_mask))


def _chroma_single(self, hidden_states, temb, image_rotary_emb=None, attention_mask=None,
                   joint_attention_kwargs=None):
    if not (_block_ok(self, hidden_states, temb, attention_mask) and _tanh_gelu(self.act_mlp)):
        return FALLBACK
    norm = _pruned(self.norm, "ChromaAdaLayerNormZeroSinglePruned", hidden_states, temb, 3)
    if norm is None:
        return FALLBACK
    return _single_rest(self, hidden_states, norm[0], norm[1], image_rotary_emb, joint_attention_kwargs,
                        attention_mask=_outer(attention_mask))
