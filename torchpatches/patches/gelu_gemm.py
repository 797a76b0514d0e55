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
from .._core.declare import Patch
from ._fused_common import FUSED_REQUIRES, GELU, fused_target

_BODY = "torchpatches.patches._bodies.gelu_gemm"
_ACTIVATIONS = "diffusers.models.activations"


PATCH = Patch(
    name="gelu_gemm", summary="diffusers GELU(tanh) projection with the GELU in the cuBLASLt epilogue (eager, CUDA)",
    targets=(fused_target("gelu_gemm", f"{_ACTIVATIONS}:GELU.forward", f"{_BODY}:_gelu_gemm", "d6728e812cd51ebb",
                          GELU + (f"{_ACTIVATIONS}:GELU.gelu",)),),
    requires=FUSED_REQUIRES,  # the fingerprint: diffusers 0.42.1
)
