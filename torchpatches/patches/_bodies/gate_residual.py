"""The ``gate_residual`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/gate_residual.py``."""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

import torch

from .._fused_common import FALLBACK, fusable, pattern_on, stock
from .._double_stream import Double, Stream, double_stream
from .._modulate_calls import modulated
from .._single_stream import Single, single_stream

_FLUX = "diffusers.models.transformers.transformer_flux"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"
_CHROMA = "diffusers.models.transformers.transformer_chroma"


def _block_ok(block: Any, *tensors: Any) -> bool:
    x = tensors[0]
    return (
        fusable(x, (block,), *tensors[1:])
        and x.dim() == 3
        and all(type(t) is torch.Tensor for t in tensors if t is not None)
    )


#: FLUX.1's double block (Chroma's too): adaLN-Zero norm1 modules, norm2 through the modulate op while adaln is on,
#: the fp16 clip on the text stream only, FluxAttention's processor called directly.
_FLUX_DOUBLE = Double(Stream("norm1", "norm2", "ff"), Stream("norm1_context", "norm2_context", "ff_context", clip=True),
                      processor=(_FLUX, "FluxAttention"))
_FLUX2_DOUBLE = dataclasses.replace(_FLUX_DOUBLE, processor=(_FLUX2, "Flux2Attention"))
#: FLUX.1's single block (Chroma's too): [attention | gelu(proj_mlp)] into proj_out. FLUX.2's: a plain LayerNorm with
#: Flux2Modulation's vectors, its parallel attention module (no text slot) the whole branch.
_FLUX_SINGLE = Single((_FLUX, "FluxAttention"))
_FLUX2_SINGLE = Single((_FLUX2, "Flux2ParallelSelfAttention"), text_slot=False, mlp=None,
                       vectors=(_FLUX2, "Flux2Modulation"))


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
    return single_stream(_FLUX_SINGLE, self, hidden_states, temb, {"image_rotary_emb": image_rotary_emb},
                         joint_attention_kwargs, encoder_hidden_states, split=True)


def _tanh_gelu(act: Any) -> bool:
    return stock(act, torch.nn.GELU) and act.approximate == "tanh"


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
    return single_stream(_FLUX2_SINGLE, self, hidden_states, temb_mod, {"image_rotary_emb": image_rotary_emb},
                         joint_attention_kwargs, encoder_hidden_states, split_hidden_states, text_seq_len)


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
    return single_stream(_FLUX_SINGLE, self, hidden_states, None,
                         {"image_rotary_emb": image_rotary_emb, "attention_mask": _outer(attention_mask)},
                         joint_attention_kwargs, modulation=norm)
