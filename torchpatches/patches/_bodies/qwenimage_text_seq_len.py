"""The ``qwenimage_text_seq_len`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/qwenimage_text_seq_len.py``."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

from ..._core.compat import is_compiling


def _replacement(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_text_seq_len_from_mask(
        encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: Optional[torch.Tensor]
    ) -> Tuple[int, Optional[torch.Tensor], Optional[torch.Tensor]]:
        if is_compiling():
            return original(encoder_hidden_states, encoder_hidden_states_mask)
        # From here on diffusers 0.42.1's code, but for the fallback length's tensor.
        batch_size, text_seq_len = encoder_hidden_states.shape[:2]
        if encoder_hidden_states_mask is None:
            return text_seq_len, None, None

        if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
            raise ValueError(
                f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
                f"(batch_size, text_seq_len)=({batch_size}, {text_seq_len})."
            )

        if encoder_hidden_states_mask.dtype != torch.bool:
            encoder_hidden_states_mask = encoder_hidden_states_mask.to(torch.bool)

        position_ids = torch.arange(text_seq_len, device=encoder_hidden_states.device, dtype=torch.long)
        active_positions = torch.where(encoder_hidden_states_mask, position_ids, position_ids.new_zeros(()))
        has_active = encoder_hidden_states_mask.any(dim=1)
        per_sample_len = torch.where(
            has_active,
            active_positions.max(dim=1).values + 1,
            position_ids.new_full((), text_seq_len),  # the original: torch.as_tensor(text_seq_len, device=...)
        )
        return text_seq_len, per_sample_len, encoder_hidden_states_mask

    compute_text_seq_len_from_mask.__doc__ = original.__doc__
    return compute_text_seq_len_from_mask
