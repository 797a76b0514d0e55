"""The ``lora`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/lora.py``."""
from __future__ import annotations

from .._fused_common import FALLBACK
from .._lora_calls import lora_linear


def _lora(self, x, *args, **kwargs):
    if args or kwargs:  # adapter_names (mixed batch), variant or base-layer arguments: peft's code
        return FALLBACK
    return lora_linear(self, x)
