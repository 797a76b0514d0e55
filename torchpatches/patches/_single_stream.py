"""One body for diffusers' single-stream blocks (text and image tokens in one sequence), with each model's
differences as data.

FLUX.1's ``FluxSingleTransformerBlock``, Chroma's ``ChromaSingleTransformerBlock``, FLUX.2's
``Flux2SingleTransformerBlock`` and FLUX.3's ``Flux3ModeTransformerBlock`` (diffusers 0.42.1) run the same stretch:
the text and image tokens joined into one sequence (FLUX.1, FLUX.2), one LayerNorm + modulation, a parallel branch
(the attention, and beside it an MLP whose output is concatenated to the attention's before ``proj_out``: FLUX.1,
Chroma; or a feed-forward whose output is added to it: FLUX.3; FLUX.2's attention module does both itself),
``h + gate * branch`` (clipped in fp16 but in FLUX.3), and the sequence split back into text and image.
A :class:`Single` row says where they differ; :func:`single_stream` runs the stretch with every module call of
diffusers' code (norm, attention, Linears: LoRA layers and hooks keep working), the concat into one buffer through
the ``slices`` op and the residual through ``_modulate_calls``. The callers decide beforehand whether the call is
theirs (each model's eligibility predicate) and may hand in the modulation where their model computes it its own
way (Chroma's pruned vectors, FLUX.3's chunks of ``temb_mod``).

The body reads the block's submodules from ``block._modules`` (``nn.Module.__getattr__`` is a Python frame)."""
from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Tuple

import torch

from .._core.lazy import lazy_module
from ._double_stream import stock_processor
from ._fused_common import FLOAT_DTYPES, linear, pattern_on
from ._modulate_calls import _rows_fit, _vectors_fit, modulate_ops, modulated, residual

#: ``torchpatches.ops.slices``, imported at the first fused call (it registers torch.library ops).
_slices_ops = lazy_module("torchpatches.ops._slices")


class Single(NamedTuple):
    """How one diffusers 0.42.1 single-stream block differs from the others.

    - ``processor``: the (module, class) of the block's stock attention, whose processor the body may call as that
      attention's ``forward`` would (:func:`stock_processor`), else None: the module call (FLUX.3);
    - ``text_slot``: that processor takes ``encoder_hidden_states`` second (FluxAttnProcessor), not only
      ``(hidden_states, attention_mask, image_rotary_emb)`` (FLUX.2's parallel processor);
    - ``mlp``: the block's (MLP Linear, output Linear) around the attention: ``proj_out([attn | gelu(proj_mlp)])``
      (FLUX.1, Chroma); None: the attention's output is the branch (FLUX.2);
    - ``vectors``: the (module, class) whose ``split(temb, 1)[0]`` is the block's ``(shift, scale, gate)`` for its
      plain LayerNorm ``norm`` (FLUX.2's ``Flux2Modulation``); None: ``norm(x, emb=temb)`` returns
      ``(normed, gate)`` (``AdaLayerNormZeroSingle``);
    - ``ff``: the feed-forward beside the attention, ``h + gate * (attn + ff)`` in one kernel and never clipped
      (FLUX.3's mode block), else None."""

    processor: Optional[Tuple[str, str]]
    text_slot: bool = True
    mlp: Optional[Tuple[str, str]] = ("proj_mlp", "proj_out")
    vectors: Optional[Tuple[str, str]] = None
    ff: Optional[str] = None


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


def _plain(t: Any) -> bool:
    return type(t) is torch.Tensor and t.dtype in FLOAT_DTYPES


def _attention(row: Single, attn: Any, normed: torch.Tensor, attention: dict, kwargs: Optional[dict]) -> Any:
    """``attn(hidden_states=normed, **attention, **kwargs)``, the block's call in diffusers 0.42.1; where
    :func:`stock_processor` allows it, the call that attention's ``forward`` makes instead, without its signature
    lookup."""
    processor = None if row.processor is None else stock_processor(attn, *row.processor, kwargs)
    if processor is not None:
        if row.text_slot:
            return processor(attn, normed, None, attention.get("attention_mask"), attention.get("image_rotary_emb"))
        return processor(attn, normed, attention.get("attention_mask"), attention.get("image_rotary_emb"))
    if kwargs:  # a name in both: TypeError, as in diffusers' call
        return attn(hidden_states=normed, **attention, **kwargs)
    return attn(hidden_states=normed, **attention)


def _parallel(row: Single, modules: dict, normed: torch.Tensor, attention: dict, kwargs: Optional[dict]) -> Any:
    """``proj_out(cat([attn(normed), gelu(proj_mlp(normed))], dim=2))`` with both halves written into one buffer
    (the GELU by the ``slices`` op, the attention's output copied in where it fits)."""
    proj_mlp, proj_out = row.mlp
    slices = _slices_ops()
    attn = modules["attn"]
    mlp = linear(modules[proj_mlp], normed)
    width = attn.inner_dim
    buf = mlp.new_empty((*mlp.shape[:-1], width + mlp.shape[-1]))
    if _plain(mlp):  # the buffer was just allocated from it: same shape, dtype, device, no shared memory
        slices.prechecked(mlp, buf[..., width:], gelu=True)
    else:
        slices.gelu_tanh_into(mlp, buf[..., width:])
    del mlp
    attn_output = _attention(row, attn, normed, attention, kwargs)
    if _plain(attn_output) and attn_output.shape == buf[..., :width].shape and attn_output.dtype == buf.dtype \
            and attn_output.device == buf.device and _plain(buf):
        slices.prechecked(attn_output, buf[..., :width], gelu=False)
    else:  # a processor returned another width or dtype: the concat diffusers would do
        buf = torch.cat([attn_output, buf[..., width:]], dim=2)
    return linear(modules[proj_out], buf)


def gated_sum(h: torch.Tensor, gate: torch.Tensor, attn_output: torch.Tensor, ff_output: torch.Tensor
              ) -> torch.Tensor:
    """``h + gate * (attn_output + ff_output)``: one kernel (the sum read from both branches) when everything fits."""
    if _vectors_fit(h, gate) and _rows_fit(h, attn_output) and _rows_fit(h, ff_output):
        return modulate_ops().prechecked(h, gate, attn_output, None, None, None, y2=ff_output)[0]
    return residual(h, gate, attn_output + ff_output, clip=False)


def single_stream(row: Single, block: Any, hidden_states: torch.Tensor, temb: Any, attention: dict,
                  joint_attention_kwargs: Optional[dict] = None, text: Optional[torch.Tensor] = None,
                  split: bool = False, text_seq_len: Optional[int] = None,
                  modulation: Optional[tuple] = None) -> Any:
    """The block's output for a call its caller covers: ``(text, image)`` where ``split``, else the sequence.

    ``text``: the text tokens, joined before ``hidden_states`` (their length is then ``text_seq_len``);
    ``attention``: the keyword arguments of ``block.attn`` besides the normalized sequence (``image_rotary_emb=``,
    a mask), then ``joint_attention_kwargs``; ``modulation``: ``(normed, gate)`` where the caller computes it."""
    if text is not None:
        text_seq_len = text.shape[1]
        hidden_states = joined(text, hidden_states)
    modules = block._modules  # block.<name> is nn.Module.__getattr__ in Python: ten times the dict lookup
    if modulation is None:
        if row.vectors is None:
            modulation = modules["norm"](hidden_states, emb=temb)
        else:
            shift, scale, gate = getattr(sys.modules[row.vectors[0]], row.vectors[1]).split(temb, 1)[0]
            modulation = modulated(modules["norm"], hidden_states, scale, shift, fuse=pattern_on("adaln")), gate
    normed, gate = modulation
    if row.mlp is None:
        branch = _attention(row, modules["attn"], normed, attention, joint_attention_kwargs)
    else:
        branch = _parallel(row, modules, normed, attention, joint_attention_kwargs)
    if row.ff is not None:
        return gated_sum(hidden_states, gate, branch, modules[row.ff](normed))
    hidden_states = residual(hidden_states, gate, branch, clip=True)
    if split:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states
