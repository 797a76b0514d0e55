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

__all__ = ["rope_tables", "joint_mask", "complex_tables", "square_mask", "additive_mask", "image_rows_tables"]

class _PerSource:
    """Results cached per source tensor: weakly keyed (an entry lives as long as its source), rebuilt when the key
    differs (it holds the sources' version counters and the other inputs), the cached result was written in place,
    or a second source it was built from (``partner``) is another tensor. A key of None (an inference tensor among
    the sources: no version counter) is never cached."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries = WeakIdKeyDictionary()

    def get(self, source: torch.Tensor, key: Any, partner: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if key is None:
            return None
        hit = self._entries.get(source)
        if hit is None:
            return None
        partner_ref, cached_key, result, version = hit
        if cached_key != key or result._version != version or (partner_ref is not None and partner_ref() is not partner):
            return None
        return result

    def __contains__(self, source: Any) -> bool:
        return source in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, source: torch.Tensor, key: Any, result: torch.Tensor,
            partner: Optional[torch.Tensor] = None) -> torch.Tensor:
        if key is not None and not result.is_inference():
            self._entries[source] = (None if partner is None else weakref.ref(partner), key, result, result._version)
        return result


_TABLES, _MASKS, _COMPLEX, _SQUARE, _IMAGE_ROWS, _ADDITIVE = (_PerSource() for _ in range(6))


def _versions(*tensors: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The tensors' version counters, or None where one has none (an inference tensor: never cached)."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


def _with(versions: Optional[tuple], *others: Any) -> Any:
    """A cache key: the sources' versions and the other inputs, or None (never cached) without versions."""
    return None if versions is None else (versions, *others)


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
    tables = _TABLES.get(img_freqs, key, txt_freqs)
    if tables is None:
        pairs = torch.view_as_real(torch.cat([txt_freqs, img_freqs], dim=0))  # [S, D/2, (re, im)]
        # [(cos, sin), S, D/2, pair]: each of Re / Im repeated for the two elements of its pair, in one copy.
        tables = _TABLES.put(img_freqs, key, pairs.permute(2, 0, 1).unsqueeze(-1).expand(2, s_txt + s_img, half, 2)
                             .reshape(2, -1, head_dim), txt_freqs)
    return tables[0], tables[1]


def joint_mask(encoder_hidden_states_mask: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers 0.42.1 ``QwenDoubleStreamAttnProcessor2_0``'s joint attention mask, built once per mask."""
    seq_img = hidden_states.shape[1]
    key = _with(_versions(encoder_hidden_states_mask), hidden_states.shape[0], seq_img, hidden_states.device)
    attention_mask = _MASKS.get(encoder_hidden_states_mask, key)
    if attention_mask is None:
        # diffusers' own code, verbatim:
        image_mask = torch.ones((hidden_states.shape[0], seq_img), dtype=torch.bool, device=hidden_states.device)
        attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
        attention_mask = attention_mask[:, None, None, :]
        _MASKS.put(encoder_hidden_states_mask, key, attention_mask)
    return attention_mask


def _batched_freqs_fit(t: Any, device: torch.device, half: int) -> bool:
    return type(t) is torch.Tensor and t.dtype == torch.complex64 and t.device == device and t.dim() in (2, 3) \
        and t.shape[-1] == half and t.stride(-1) == 1


def complex_tables(freqs: Any, rows: int, head_dim: int, device: torch.device
                   ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Z-Image's per-sample complex frequencies ``[B, S, D/2]`` (QwenImage 2.1's shared ``[S, D/2]``) as
    ``ops.qk_norm_rope``'s fp32 ``[B, S, D]`` (``[S, D]``) ``cos``/``sin`` tables (each value repeated for its
    interleaved pair), cached per source tensor as :func:`rope_tables`; None if ``freqs`` is not such a complex64
    tensor with ``rows`` rows on ``device``."""
    half = head_dim // 2
    if not (_batched_freqs_fit(freqs, device, half) and freqs.shape[-2] == rows):
        return None
    key = _versions(freqs)
    tables = _COMPLEX.get(freqs, key)
    if tables is None:
        lead = tuple(freqs.shape[:-1])  # (B, S) or (S,)
        pairs = torch.view_as_real(freqs)  # [B, S, D/2, (re, im)]
        tables = _COMPLEX.put(freqs, key, pairs.movedim(-1, 0).unsqueeze(-1).expand(2, *lead, half, 2)
                              .reshape(2, *lead, head_dim))
    return tables[0], tables[1]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ATen's ``convert_boolean_attn_mask``, exactly, in one pass: +0 of ``dtype`` where ``mask``, else ``-inf``."""
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), float("-inf"))


def square_mask(attention_mask: torch.Tensor, seq_len: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """diffusers 0.42.1 ``HunyuanVideo15AttnProcessor2_0``'s ``[B, 1, S, S]`` self-attention mask from the text mask
    ``[B, L]`` (padded in front to S), built once per mask tensor and length instead of once per block (at 480p, 121
    frames: 2.4 GB a block). With ``dtype``: the additive mask SDPA makes of a boolean one in every call
    (``convert_boolean_attn_mask``: zeros of ``dtype``, ``-inf`` where the mask is False), exactly, made once too
    (4.8 GB a block in bf16); only that form is kept then."""
    key = _with(_versions(attention_mask), seq_len, dtype)
    square = _SQUARE.get(attention_mask, key)
    if square is not None:
        return square
    batch_size = attention_mask.shape[0]
    mask = torch.nn.functional.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True)  # diffusers'
    mask = mask.bool()
    # diffusers repeats the row mask to [B, 1, S, S] and ands it with its transpose; ATen then makes zeros and fills
    # -inf where False: five passes over S * S (28 ms at 480p, 121 frames on an H200). The square is separable, so
    # one broadcast pass writes the same values: row & column, or 0 + 0 = 0 where both are kept, else -inf.
    rows, columns = mask.view(batch_size, 1, seq_len, 1), mask.view(batch_size, 1, 1, seq_len)
    if dtype is None:
        square = rows & columns
    else:
        line = _additive(mask, dtype)
        square = line.view(batch_size, 1, seq_len, 1) + line.view(batch_size, 1, 1, seq_len)
    return _SQUARE.put(attention_mask, key, square)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask SDPA makes of a boolean ``mask`` in every call (ATen's ``convert_boolean_attn_mask``:
    zeros of ``dtype``, ``-inf`` where False), made once per mask tensor, its version and ``dtype``: Ideogram 4
    builds one ``[B, 1, S, S]`` mask per step and hands it to every block."""
    key = _with(_versions(mask), dtype)
    additive = _ADDITIVE.get(mask, key)
    if additive is None:
        additive = _ADDITIVE.put(mask, key, _additive(mask, dtype))
    return additive


def image_rows_tables(cos: Any, sin: Any, text_rows: int, device: torch.device
                      ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """HunyuanVideo 1.5's fp32 RoPE tables ``[S_img, D]`` extended to its joint ``[image; text]`` rows: identity rows
    (cos 1, sin 0) for the text, which diffusers leaves unrotated (``x * 1 + rotate(x) * 0`` is ``x`` in fp32, up to
    the sign of a zero). Cached per source table as :func:`rope_tables`; None if the tables are not fp32 ``[S, D]``
    of one shape on ``device``."""
    if not (type(cos) is torch.Tensor and type(sin) is torch.Tensor and cos.dtype == sin.dtype == torch.float32
            and cos.dim() == 2 and cos.shape == sin.shape and cos.device == sin.device == device):
        return None
    key = _with(_versions(cos, sin), text_rows)
    tables = _IMAGE_ROWS.get(cos, key, sin)
    if tables is None:
        width = cos.shape[1]
        tables = _IMAGE_ROWS.put(cos, key, torch.stack([torch.cat([cos, cos.new_ones(text_rows, width)]),
                                                        torch.cat([sin, sin.new_zeros(text_rows, width)])]), sin)
    return tables[0], tables[1]
