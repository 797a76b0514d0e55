"""The ``wan_block`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/wan_block.py``. The glue runs on the table-modulated block body
(``patches/_table_modulated.py``): Wan's row rounds once (fp32 arithmetic, ``.type_as``) and its unmodulated norm2 is
an affine ``FP32LayerNorm``."""
from __future__ import annotations

from typing import Any, Optional

import torch

from .._fused_common import FALLBACK, fusable
from .._modulate_calls import _vectors_fit
from .._table_modulated import Stream, Table, plain_fp32_layer_norm, run
from ...ops._runtime.tiers import FLOAT_DTYPES

WAN = Table(once=True, affine_plain=True)


def _modulation(table: torch.Tensor, temb: torch.Tensor) -> tuple:
    """diffusers 0.42.1's six modulation vectors, computed as it computes them, as one-term vectors."""
    if temb.ndim == 4:  # Wan 2.2 TI2V: [B, S, 6, D], per-token vectors
        chunks = (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return tuple((c.squeeze(2), None) for c in chunks)
    return tuple((c, None) for c in (table + temb.float()).chunk(6, dim=1))


def _two_terms(table: Any, temb: torch.Tensor, x: torch.Tensor) -> Optional[tuple]:
    """Wan 2.2 TI2V's six per-token vectors as ``(table row, temb chunk)`` pairs, the kernel adding each pair in fp32
    as diffusers' ``scale_shift_table.unsqueeze(0) + temb.float()`` does, without its ``[B, S, 6, D]`` fp32 tensor;
    None where the terms do not fit (then diffusers' expression)."""
    B, S, D = x.shape
    if not (type(table) in (torch.Tensor, torch.nn.Parameter) and tuple(table.shape) == (1, 6, D)
            and tuple(temb.shape) == (B, S, 6, D) and temb.stride(-1) == 1 and table.stride(-1) == 1
            and table.dtype in FLOAT_DTYPES and temb.dtype in FLOAT_DTYPES and table.device == x.device
            and temb.device == x.device):
        return None
    return tuple((table[0, k].expand(B, D), temb[:, :, k]) for k in range(6))


def _block(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
    x = hidden_states
    rotary = tuple(t for t in (rotary_emb if isinstance(rotary_emb, (tuple, list)) else (rotary_emb,))
                   if isinstance(t, torch.Tensor))
    if not (fusable(x, (self,), encoder_hidden_states, temb, *rotary) and x.dim() == 3
            and type(temb) is torch.Tensor and plain_fp32_layer_norm(self.norm1, x.shape[-1])):
        return FALLBACK
    vectors = _two_terms(self.scale_shift_table, temb, x) if temb.ndim == 4 else None
    if vectors is None:
        vectors = _modulation(self.scale_shift_table, temb)
        stream = Stream(WAN, x, _vectors_fit(x, *(v[0] for v in vectors), rounding="once"), two=False)
    else:
        stream = Stream(WAN, x)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = vectors
    # diffusers 0.42.1 WanTransformerBlock.forward: every module called as it calls them; each residual fused with
    # the norm after it (norm1 checked above, norm2 an affine FP32LayerNorm or nn.Identity, norm3 checked here).
    return run(stream, (
        (self.norm1, True, (scale_msa, shift_msa), self.attn1, (None, None, rotary_emb), gate_msa),
        (self.norm2, True, None, self.attn2, (encoder_hidden_states, None, None), None),
        (self.norm3, plain_fp32_layer_norm(self.norm3, x.shape[-1]), (c_scale_msa, c_shift_msa), self.ffn, (),
         c_gate_msa),
    ), float_y=True)
