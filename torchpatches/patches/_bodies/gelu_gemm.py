"""The ``gelu_gemm`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/gelu_gemm.py``."""
from __future__ import annotations

import sys

import torch

from .._fused_common import FALLBACK, declined, fusable, stock
from .._lora_calls import lora_gelu

_ACTIVATIONS = "diffusers.models.activations"


def _gelu_gemm(self, hidden_states):
    from ...ops import _linear_gelu as ops  # lazily: with the target

    proj = self.proj
    if self.approximate != "tanh":
        return declined(f"GELU(approximate={self.approximate!r}): the epilogue computes the tanh form")
    if type(self).gelu is not sys.modules[_ACTIVATIONS].GELU.gelu:  # the fused path skips ``self.gelu``
        return declined("a GELU subclass overrides gelu()")
    if not fusable(hidden_states, (self,)):
        return FALLBACK
    if type(proj) is not torch.nn.Linear:  # a LoRA-wrapped projection: the GELU in its last adapter's epilogue
        return lora_gelu(proj, hidden_states)
    if not (stock(proj, torch.nn.Linear) and type(proj.weight) is torch.nn.Parameter):
        return FALLBACK
    if not ops.lt_tier_fits(hidden_states, proj.weight, proj.bias):
        return declined("the cuBLASLt epilogue serves this projection only on CUDA, in fp16/bf16, with a bias")
    return ops.linear_gelu_tanh(hidden_states, proj.weight, proj.bias, tier="cublaslt")
