"""lora: peft's ``lora.Linear`` with each adapter's product added in its GEMM's epilogue (eager).

What goes wrong upstream
    peft's ``lora.Linear.forward`` (how diffusers runs every LoRA loaded with ``load_lora_weights`` and not
    fused) computes ``result = base_layer(x)`` and then, per active adapter,
    ``result = result + lora_B(lora_A(dropout(x))) * scaling``: besides the two GEMMs, ``lora_B``'s output, the
    product with ``scaling`` and the sum are three more passes over the ``[tokens, out]`` output with two
    temporaries of its size. On FLUX.1-dev with rank-64 adapters on every projection the adapters cost
    52 ms per step on the fused path (40 ms on vanilla eager), and ``gelu_gemm`` stepped aside for a LoRA-wrapped
    FFN projection, so the GELU ran as a separate pass again.

What the patch changes
    ``Linear.forward`` computes the base result once and adds each adapter with
    ``result.addmm_(lora_A(x), B.T, beta=1, alpha=scaling)`` (``torchpatches.ops.lora``): the GEMM reads the
    result as its C matrix and writes the sum. When the layer is the projection of diffusers' tanh ``GELU`` and
    ``gelu_gemm`` is applied too, the last adapter's GEMM applies the GELU in its epilogue (cuBLASLt; on the CPU,
    where ``_addmm_activation`` is the erf GELU, ``F.gelu(..., "tanh")`` after it). Served: the stock case
    (``patches/_lora_calls.py`` lists it): several active adapters (``set_adapters(..., weights)``), a
    ``scale`` in ``joint_attention_kwargs`` (``scale_lora_layers``), 0-d tensor scalings (``enable_lora_hotswap``
    + a swap), dropout modules in eval mode. peft's own code runs for DoRA and the other ``lora_variant``s,
    ``lora_bias``, ``fan_in_fan_out``, dropout in training, mixed-batch ``adapter_names`` (any extra argument),
    merged or disabled adapters, subclasses (bnb, quantized layers) and other layer types (Conv, Embedding:
    other forwards), adapter weights of another dtype or device than ``x``, a gradient wanted, hooks on the
    skipped modules, autocast, and everything every fused path steps aside for (``torch.compile``,
    ``jit.trace``, forward AD, functorch, global hooks). Like every fused pattern it serves CUDA tensors (the
    CPU only while a test forces a tier).

Tolerance
    fp32: bit-identical to peft when each scaling is a power of two (``lora_alpha / r`` usually is), otherwise
    within the GEMM's own error bound (the GEMM applies ``alpha`` itself: ``ops/_lora.py``). bf16/fp16: one
    rounding of the sum where peft rounds three times (``lora_B``'s output, the product, the sum): the fused
    result is the more accurate, and from peft's at the summands' magnitude at most 1 ulp per adapter whose
    scaling is a power of two, 2 per adapter otherwise (peft rounds the unscaled product before scaling it), one
    more with the GELU (diffusers rounds once more); the one-adapter bounds are reached (``tests/patches/test_lora.py``). A
    scaling of 0 runs peft's order for its adapter: NaN where an adapter weight is inf or NaN, as peft's.

Versions
    peft 0.17 - 0.21: ``Linear.forward`` fingerprinted on 0.21.0 (installed, tested) and read from the
    released sources of 0.17.0, 0.17.1 (one fingerprint) and 0.18.0 - 0.21.2 (the 0.21.0 one); torch >= 2.4.

When to delete
    When peft computes the stock LoRA branch with ``addmm`` (or an equivalent fused epilogue) itself.
"""
from .._core.declare import Patch, Target
from ._fused_common import fused
from ._lora_calls import LAYER

_BODY = "torchpatches.patches._bodies.lora"
#: What the skipped module calls and helpers reach (checked by identity per call, as the original's globals).
ASSUMES = (
    "torch.nn.functional:linear",
    "torch.nn.modules.linear:Linear.forward",
    "torch.nn.modules.linear:Identity.forward",
    "torch.nn.modules.dropout:Dropout.forward",
    f"{LAYER}:Linear._check_forward_args",
    f"{LAYER}:Linear._cast_input_dtype",
)


PATCH = Patch(
    name="lora",
    summary="peft lora.Linear: each adapter's product added in its GEMM epilogue (addmm, beta=1), GELU too (eager)",
    targets=(
        Target(f"{LAYER}:Linear.forward", make_replacement=fused("lora", f"{_BODY}:_lora", ASSUMES),
               fingerprints=frozenset({
                   "a15acbef02c65d58",  # peft 0.21.0 (tested); the same source in 0.18.0 - 0.21.2
                   "9610a28f4ebc67ef",  # peft 0.17.0, 0.17.1 (read from the released source)
               })),
    ),
    requires={"peft": ">=0.17,<0.22", "torch": ">=2.4"},
    verifies={
        # Skipped calls: with no adapter_names it returns at once; with x in the weights' dtype it returns x.
        f"{LAYER}:LoraLayer._check_forward_args": frozenset({"f634b09698cfbc3d"}),  # peft 0.17.0 - 0.21.2
        "peft.tuners.tuners_utils:BaseTunerLayer._cast_input_dtype": frozenset({
            "6ae421ef719937a2",  # peft 0.20.0 - 0.21.2
            "7b08003f80255062",  # peft 0.17.0 - 0.19.1 (a docstring differs)
        }),
    },
)
