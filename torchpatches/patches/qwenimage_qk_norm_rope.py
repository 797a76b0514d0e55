"""qwenimage_qk_norm_rope: QwenImage's joint attention processor with q/k RMSNorm, RoPE and the concat in one kernel.

What goes wrong upstream
    Between its six projections and the attention call, diffusers' ``QwenDoubleStreamAttnProcessor2_0``
    (``transformer_qwenimage.py``) runs four diffusers ``RMSNorm`` calls (eight eager ops each: cast,
    pow, mean, add, rsqrt, multiply, cast, weight), four ``apply_rotary_emb_qwen`` calls in complex form
    (fp32 cast, complex multiply, cast back), three ``torch.cat`` of the text and image rows and, per
    block, the same joint attention mask again (``torch.ones`` + ``torch.cat``): about 50 launches per
    block and a dozen passes over ``[B, S, H, D]`` tensors where one read of each input and one write
    of each output suffice. No upstream issue or fix as of diffusers 0.42.1.

What the patch changes
    ``__call__`` runs the projections, the attention (``dispatch_attention_fn`` with the processor's
    backend and the joint mask, unchanged) and the output projections exactly as diffusers does
    (module calls: LoRA layers and hooks on them keep working; a stock ``nn.Linear`` or eval-mode ``nn.Dropout``
    is called as its ``forward`` would, without the module call path, ``_fused_common.linear``), and replaces the
    stretch in between by
    ``torchpatches.ops.qk_norm_rope(rounding="each")``: one launch that
    normalizes q and k per head as diffusers' ``RMSNorm`` rounds, rotates them and writes q, k and v
    straight into the joint ``[B, S_txt + S_img, H, D]`` tensors. The complex freqs become the op's
    fp32 ``cos``/``sin`` tables once per step, and the joint mask is built once per step
    (``_per_step``); the PyTorch tier rotates with diffusers' complex multiply instead (Tolerance).
    Everything else runs diffusers' own ``__call__``: ``torch.compile``,
    ``torch.jit.trace``, forward AD and functorch transforms, gradients, autocast, an external
    ``attention_mask`` or no text stream (diffusers raises), no rotary embedding or one that is not two
    complex64 tables of the streams' lengths, q/k norms that are not stock diffusers ``RMSNorm`` with a
    weight of the activations' dtype and no bias, hooked norms, a replaced global of the processor
    (``apply_rotary_emb_qwen``, ``dispatch_attention_fn``) or of ``RMSNorm.forward`` / ``torch.cat``, tensor
    subclasses, CPU tensors. Under diffusers' context parallelism (a processor with a ``_parallel_config``)
    the stretch runs on the rank's shard: the image and text streams, their rotary
    tables and the text mask are split alike by diffusers' plan, every step of the stretch is per token, and the
    attention call gets diffusers' arguments (the config, the joint mask).

Tolerance
    PyTorch tier (a forced tier on the CPU; a GPU without Triton): bit-identical to diffusers on the CPU, fp32 at
    head dims 8, 12, 16, 24, 32, 40 and 64, bf16 and fp16 at 16 (tests). The op only normalizes and concatenates
    there; each stream is rotated by diffusers' own ``apply_rotary_emb_qwen`` (one complex64 multiply). torch's
    CPU complex product equals the op's real-form rotation only in the pairs its vector loop covers (8 per row
    with AVX-512, 4 with AVX2): the scalar tail contracts ``a*c - b*d`` to an FMA, so the cos/sin rotation put
    the last ``(D/2) mod 8`` pairs 1 ulp off (head dims 8, 12, 24, 40: tiny fp32 model up to 7.2e-7). CUDA's
    complex product contracts everywhere; the same change should make the tier exact there (not measured).
    The Triton kernel rounds at the same points; fp32 reduction order and fused multiply-adds move the
    stretch's q/k by up to 2.6 eps x a head's largest value, the tiny fp32 model's output by at most
    3.1 eps x max|out| (7.2e-7 at head dim 12; ``ops/_qk_norm_rope.py``).

Versions
    diffusers 0.42.x (fingerprint verified on 0.42.1; 0.42.0's source of the target is the same); torch >= 2.4.

When to delete
    When diffusers fuses q/k norm and RoPE for eager mode (e.g. through its kernels hub).
"""
from __future__ import annotations

from .._core.declare import Patch, Target
from ._named_parameters import named_parameters
from ._fused_common import CAT, DROPOUT, LINEAR, fused

_BODY = "torchpatches.patches._bodies.qwenimage_qk_norm_rope"
_QWEN = "diffusers.models.transformers.transformer_qwenimage"
_NORMALIZATION = "diffusers.models.normalization"
#: What the fused stretch skips besides the processor's own globals (checked per call by ``fused``).
_ASSUMES = (f"{_NORMALIZATION}:RMSNorm.forward",) + CAT + LINEAR + DROPOUT


PATCH = Patch(
    name="qwenimage_qk_norm_rope",
    summary="QwenImage attention processor: q/k RMSNorm + complex RoPE + text/image concat in one kernel (eager)",
    targets=(
        Target(f"{_QWEN}:QwenDoubleStreamAttnProcessor2_0.__call__",
               make_replacement=named_parameters(fused("qwenimage_qk_norm_rope", f"{_BODY}:_processor", _ASSUMES)),
               fingerprints=frozenset({"6d1be42e5eb224d8"})),  # diffusers 0.42.0, 0.42.1
    ),
    requires={"diffusers": ">=0.42,<0.43", "torch": ">=2.4"},
)
