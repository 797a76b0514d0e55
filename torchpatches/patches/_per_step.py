"""What fused attention processors (QwenImage, Z-Image, HunyuanVideo 1.5) compute once per step instead of once per block.

Every ``QwenImageTransformerBlock`` of a forward gets the same ``image_rotary_emb`` tuple and the same
``encoder_hidden_states_mask`` tensor, and diffusers' processor rebuilds from them, per block, things
that depend on nothing else:

- :func:`rope_tables`: the complex RoPE frequencies (``apply_rotary_emb_qwen(use_real=False)``) as
  the fp32 ``cos``/``sin`` tables of ``ops.qk_norm_rope`` (``[S_txt + S_img, D]``, text rows first,
  each value repeated for its interleaved pair);
- :func:`joint_mask`: the joint ``[B, 1, 1, S_txt + S_img]`` mask (text mask, then ones for the image),
  built by diffusers' own two lines the first time.

Both are cached per source tensor in weak-keyed dictionaries: an entry lives exactly as long as the
tensor it was built from (the pipeline's per-step freqs and mask), and is rebuilt when a source or the
cached result was written in place (``_version``), or the other inputs differ. No entry outlives a step
in diffusers' pipelines, so nothing accumulates. Inference tensors (made under ``torch.inference_mode()``)
carry no version counter, so an in-place write could not be seen: for them nothing is cached and each
block builds its own, as diffusers does (2 small launches each).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["rope_tables", "joint_mask", "complex_tables", "square_mask", "image_rows_tables"]

_TABLES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _versions(*tensors: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The tensors' version counters, or None where one has none (an inference tensor: never cached)."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


def _freqs_fit(t: Any, device: torch.device, half: int) -> bool:
    return type(t) is torch.Tensor and t.dtype == torch.complex64 and t.device == device and t.dim() == 2 \
        and t.shape[1] == half


def rope_tables(img_freqs: Any, txt_freqs: Any, s_img: int, s_txt: int, head_dim: int, device: torch.device
                ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(cos, sin)`` for ``[txt_freqs; img_freqs]``, or None if the freqs are not complex64 ``[S, D/2]``
    tables of these lengths on ``device`` (the processor then runs diffusers' code)."""
    half = head_dim // 2
    if not (_freqs_fit(img_freqs, device, half) and _freqs_fit(txt_freqs, device, half)
            and img_freqs.shape[0] == s_img and txt_freqs.shape[0] == s_txt):
        return None
    key = _versions(img_freqs, txt_freqs)
    hit = _TABLES.get(img_freqs) if key is not None else None
    if hit is not None:
        txt_ref, versions, tables, tables_version = hit
        if txt_ref() is txt_freqs and versions == key and tables._version == tables_version:
            return tables[0], tables[1]
    pairs = torch.view_as_real(torch.cat([txt_freqs, img_freqs], dim=0))  # [S, D/2, (re, im)]
    # [(cos, sin), S, D/2, pair]: each of Re / Im repeated for the two elements of its pair, in one copy.
    tables = pairs.permute(2, 0, 1).unsqueeze(-1).expand(2, s_txt + s_img, half, 2).reshape(2, -1, head_dim)
    if key is not None and not tables.is_inference():
        _TABLES[img_freqs] = (weakref.ref(txt_freqs), key, tables, tables._version)
    return tables[0], tables[1]


def joint_mask(encoder_hidden_states_mask: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``QwenDoubleStreamAttnProcessor2_0``'s joint attention mask, built once per mask."""
    seq_img = hidden_states.shape[1]
    versions = _versions(encoder_hidden_states_mask)
    key = (versions, hidden_states.shape[0], seq_img, hidden_states.device)
    hit = _MASKS.get(encoder_hidden_states_mask) if versions is not None else None
    if hit is not None:
        versions, joint, joint_version = hit
        if versions == key and joint._version == joint_version:
            return joint
    # diffusers' own code, verbatim:
    image_mask = torch.ones((hidden_states.shape[0], seq_img), dtype=torch.bool, device=hidden_states.device)
    attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
    attention_mask = attention_mask[:, None, None, :]
    if versions is not None and not attention_mask.is_inference():
        _MASKS[encoder_hidden_states_mask] = (key, attention_mask, attention_mask._version)
    return attention_mask


_COMPLEX: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _batched_freqs_fit(t: Any, device: torch.device, half: int) -> bool:
    return type(t) is torch.Tensor and t.dtype == torch.complex64 and t.device == device and t.dim() == 3 \
        and t.shape[2] == half and t.stride(-1) == 1


def complex_tables(freqs: Any, rows: int, head_dim: int, device: torch.device
                   ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Z-Image's per-sample complex frequencies ``[B, S, D/2]`` as ``ops.qk_norm_rope``'s fp32 ``[B, S, D]``
    ``cos``/``sin`` tables (each value repeated for its interleaved pair), cached per source tensor as
    :func:`rope_tables`; None if ``freqs`` is not such a complex64 tensor with ``rows`` rows on ``device``."""
    half = head_dim // 2
    if not (_batched_freqs_fit(freqs, device, half) and freqs.shape[1] == rows):
        return None
    key = _versions(freqs)
    hit = _COMPLEX.get(freqs) if key is not None else None
    if hit is not None:
        versions, tables, tables_version = hit
        if versions == key and tables._version == tables_version:
            return tables[0], tables[1]
    batch = freqs.shape[0]
    pairs = torch.view_as_real(freqs)  # [B, S, D/2, (re, im)]
    tables = pairs.permute(3, 0, 1, 2).unsqueeze(-1).expand(2, batch, rows, half, 2).reshape(2, batch, rows, head_dim)
    if key is not None and not tables.is_inference():
        _COMPLEX[freqs] = (key, tables, tables._version)
    return tables[0], tables[1]


_SQUARE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def square_mask(attention_mask: torch.Tensor, seq_len: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """diffusers 0.42.1 ``HunyuanVideo15AttnProcessor2_0``'s ``[B, 1, S, S]`` self-attention mask from the text mask
    ``[B, L]`` (padded in front to S), built once per mask tensor and length instead of once per block (at 480p, 121
    frames: 2.4 GB a block). With ``dtype``: the additive mask SDPA makes of a boolean one in every call
    (``convert_boolean_attn_mask``: zeros of ``dtype``, ``-inf`` where the mask is False), exactly, made once too
    (4.8 GB a block in bf16); only that form is kept then."""
    versions = _versions(attention_mask)
    key = (versions, seq_len, dtype)
    hit = _SQUARE.get(attention_mask) if versions is not None else None
    if hit is not None:
        cached_key, square, square_version = hit
        if cached_key == key and square._version == square_version:
            return square
    # diffusers' own code, verbatim:
    batch_size = attention_mask.shape[0]
    mask = torch.nn.functional.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True)
    mask = mask.bool()
    self_attn_mask_1 = mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
    self_attn_mask_2 = self_attn_mask_1.transpose(2, 3)
    square = (self_attn_mask_1 & self_attn_mask_2).bool()
    if dtype is not None:  # ATen's convert_boolean_attn_mask
        square = torch.zeros_like(square, dtype=dtype).masked_fill_(square.logical_not(), float("-inf"))
    if versions is not None and not square.is_inference():
        _SQUARE[attention_mask] = (key, square, square._version)
    return square


_IMAGE_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def image_rows_tables(cos: Any, sin: Any, text_rows: int, device: torch.device
                      ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """HunyuanVideo 1.5's fp32 RoPE tables ``[S_img, D]`` extended to its joint ``[image; text]`` rows: identity rows
    (cos 1, sin 0) for the text, which diffusers leaves unrotated (``x * 1 + rotate(x) * 0`` is ``x`` in fp32, up to
    the sign of a zero). Cached per source table as :func:`rope_tables`; None if the tables are not fp32 ``[S, D]``
    of one shape on ``device``."""
    if not (type(cos) is torch.Tensor and type(sin) is torch.Tensor and cos.dtype == sin.dtype == torch.float32
            and cos.dim() == 2 and cos.shape == sin.shape and cos.device == sin.device == device):
        return None
    key = (_versions(cos, sin), text_rows)
    hit = _IMAGE_ROWS.get(cos) if key[0] is not None else None
    if hit is not None:
        sin_ref, cached_key, tables, tables_version = hit
        if sin_ref() is sin and cached_key == key and tables._version == tables_version:
            return tables[0], tables[1]
    width = cos.shape[1]
    tables = torch.stack([torch.cat([cos, cos.new_ones(text_rows, width)]),
                          torch.cat([sin, sin.new_zeros(text_rows, width)])])
    if key[0] is not None and not tables.is_inference():
        _IMAGE_ROWS[cos] = (weakref.ref(sin), key, tables, tables._version)
    return tables[0], tables[1]
