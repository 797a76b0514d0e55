"""gelu_gemm: diffusers' ``GELU(approximate="tanh")`` projection with the GELU in the GEMM epilogue (eager).

What goes wrong upstream
    ``diffusers.models.activations.GELU`` (the first half of ``FeedForward(activation_fn=
    "gelu-approximate")``, FLUX.1's double-block MLPs) runs ``self.proj`` (a cuBLAS GEMM) and then
    ``F.gelu(..., approximate="tanh")`` as a separate kernel: one more read and write of the
    ``[tokens, 4 * dim]`` activation (FLUX.1-dev: 4608 x 12288 bf16, 226 MB per MLP). cuBLASLt can apply
    the tanh GELU in the GEMM's epilogue at no extra pass; torch exposes it as
    ``torch._addmm_activation(bias, x, W.T, use_gelu=True)``, which diffusers does not use.

What the patch changes
    ``GELU.forward`` calls ``torchpatches.ops.linear_gelu_tanh`` with ``self.proj``'s weight
    and bias when the projection is a stock, unhooked ``nn.Linear`` with a bias, on CUDA in bf16/fp16,
    without gradients; a peft LoRA-wrapped ``proj`` goes to the ``lora`` pattern's GELU epilogue while ``lora``
    is applied (``patches/_lora_calls.lora_gelu``); everything else (exact GELU, a subclass overriding ``gelu``,
    other wrapped ``proj``, hooks, CPU, fp32, autocast, forward AD, functorch transforms, ``torch.jit.trace``,
    ``torch.compile``) runs diffusers' forward. On CPU ``torch._addmm_activation(use_gelu=True)`` computes
    the *erf* GELU, so the op never uses it there (checked on torch 2.11 and 2.13).

Tolerance
    The epilogue applies GELU to the fp32 accumulator plus bias and rounds once, where diffusers
    rounds the GEMM output and then the GELU of it: outputs differ by about one ulp (the fused one is
    the more accurate). Measured on the GPU in ``benchmarks/fused.py``.

Versions
    diffusers 0.42.x (fingerprint verified on 0.42.1); torch >= 2.4 with CUDA (cuBLASLt).

When to delete
    When diffusers (or torch's ``F.linear``) fuses the activation into the GEMM in eager mode.
"""
from __future__ import annotations

import sys

import torch

from .._core.declare import Patch
from ._fused_common import FALLBACK, FUSED_REQUIRES, GELU, declined, fusable, fused_target, stock
from ._lora_calls import lora_gelu

__all__ = ["PATCH"]

_ACTIVATIONS = "diffusers.models.activations"


def _gelu_gemm(self, hidden_states):
    from ..ops import _linear_gelu as ops  # lazily: with the target

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


PATCH = Patch(
    name="gelu_gemm", summary="diffusers GELU(tanh) projection with the GELU in the cuBLASLt epilogue (eager, CUDA)",
    targets=(fused_target("gelu_gemm", f"{_ACTIVATIONS}:GELU.forward", _gelu_gemm, "d6728e812cd51ebb",
                          GELU + (f"{_ACTIVATIONS}:GELU.gelu",)),),
    requires=FUSED_REQUIRES,  # the fingerprint: diffusers 0.42.1
)
