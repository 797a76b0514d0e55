"""rope: diffusers' ``apply_rotary_emb`` through one fused RoPE kernel for the calls FLUX makes.

What goes wrong upstream
    diffusers' ``apply_rotary_emb`` (``diffusers/models/embeddings.py``) rotates q and k with
    about ten eager PyTorch ops: reshape/unbind into pairs, negate, stack, flatten, two fp32
    up-casts, two multiplies, an add and a down-cast, each a full pass over the tensor. Measured
    on one H200 (torch 2.11, diffusers 0.42.1), FLUX.1-dev shapes (q and k ``[1, 4608, 24, 128]``
    bf16): 630.6 us for q+k in eager, against 28.6 us for the bytes it must move; about 20% of an
    eager FLUX step (57 blocks, two calls each). There is no upstream issue or fix as of diffusers
    0.42.1; ``torch.compile`` fuses it (109.6 us alone, and into the neighbouring RMSNorm/cat when
    the whole model is compiled).

What the patch changes
    ``diffusers.models.embeddings.apply_rotary_emb`` is replaced, and rebound in the FLUX.1,
    FLUX.2 and FLUX.3 transformer modules, which import it by name. The replacement sends the
    form FLUX uses -- ``use_real=True``, ``use_real_unbind_dim=-1`` (interleaved pairs),
    ``sequence_dim`` 1 or 2, a 4-d fp32/bf16/fp16 ``x`` and a ``(cos, sin)`` tuple of fp32 ``[S, D]``
    on x's device -- through ``torchpatches.ops.apply_rope_qk`` (k=None), out of place, in x's
    dtype. On CUDA that is one Triton kernel (the ``torchpatches::rope_qk_triton`` custom op);
    elsewhere the op's plain-PyTorch tier (FlashInfer does not take diffusers' per-token form).
    Every other form (complex freqs with ``use_real=False``, ``use_real_unbind_dim=-2``, other
    shapes, dtypes or devices, tensor subclasses, inputs that need a gradient, forward-mode AD and
    functorch transforms (dual or wrapped tensors), ``torch.jit.trace``, anything the op refuses with
    ValueError) goes to the original function unchanged.

    Under ``torch.compile`` the replacement keeps diffusers' own math (the original function is
    traced): Inductor fuses it with the RMSNorm of q/k and the text/image concat, while a custom op
    is a fusion barrier that costs an extra write and read of q and k. Measured on the whole
    FLUX.1-dev-sized model (one H200, torch 2.11.0+cu130, diffusers 0.42.1, 1024x1024, bf16;
    ``benchmarks/NOTES-flux.md``): eager step 177.0 -> 148.2 ms (0.837x; RoPE 34 -> 1.9 ms of GPU
    time per step). Compiled, the op kept in the graph measured 1.011x, 1.005x and 0.999x of vanilla
    in three runs (no measurable win), while the patch as shipped compiles to exactly vanilla's
    kernels (1.000x). Patching the attention processor so q and k share one launch measured the same
    as two calls (148.13 vs 148.18 ms: the eager step is GPU-bound), so the smaller patch surface (one
    fingerprinted function) wins.

Tolerance
    The op computes ``x * cos + rotate(x) * sin`` in fp32 and rounds once to x's dtype, as the
    original does (``(x.float() * cos + x_rotated.float() * sin).to(x.dtype)``). Only fp32
    rounding order (a fused multiply-add) may differ: fp32 outputs agree to ~1e-6 relative,
    bf16/fp16 outputs to one unit in the last place (rtol 2**-7 for bf16, 2**-10 for fp16).

Versions
    diffusers >= 0.35, < 0.43: the source of every release 0.35.0 ... 0.42.1 is fingerprinted (``SOURCES``);
    tests run on 0.42.1 in every torch session and on 0.35.2 and 0.41.0 in the ``diffusers-*`` nox
    sessions (FLUX.2 exists since 0.36, FLUX.3 since 0.42); torch >= 2.11 (tested on 2.11, 2.13, 2.15).

When to delete
    When diffusers ships a fused RoPE for FLUX in eager mode (e.g. through its kernels hub), or
    when FLUX stops calling ``apply_rotary_emb`` by name.
"""
from __future__ import annotations

from typing import Tuple

from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.rope"
#: Modules that bind ``apply_rotary_emb`` at import time (``from ..embeddings import apply_rotary_emb``)
#: and call it in the FLUX form. Diffusers' other processors import it inside the function body
#: (``from .embeddings import apply_rotary_emb``) and so see the patched ``embeddings`` attribute.
ALIASES: Tuple[str, ...] = (
    "diffusers.models.transformers.transformer_flux:apply_rotary_emb",  # FLUX.1 (and Chroma, ControlNet, Kontext)
    "diffusers.models.transformers.transformer_flux2:apply_rotary_emb",  # FLUX.2
    "diffusers.models.transformers.transformer_flux3:apply_rotary_emb",  # FLUX.3 ("Copied from flux2")
    "diffusers.models.transformers.transformer_krea2:apply_rotary_emb",  # Krea 2 (the krea2 pattern's fallback)
)
#: fingerprint(diffusers.models.embeddings.apply_rotary_emb) of every release the patch accepts, as
#: measured (each wheel's source; tests check the installed release's entry). Two sources: 0.35.x and
#: 0.36.0 differ from 0.37.0+ only in Union/Tuple type hints and the docstring (diffed by hand).
SOURCES = {
    **dict.fromkeys(("0.35.0", "0.35.1", "0.35.2", "0.36.0"), "d9b2553000168b6b"),
    **dict.fromkeys(("0.37.0", "0.37.1", "0.38.0", "0.39.0", "0.40.0", "0.41.0", "0.42.0", "0.42.1"),
                    "a25267d425f8c5ea"),
}


PATCH = Patch("rope", targets=Target("diffusers.models.embeddings:apply_rotary_emb", f"{_BODY}:build_replacement",
                                     frozenset(SOURCES.values()), aliases=ALIASES),
              summary="diffusers FLUX apply_rotary_emb through one fused RoPE kernel in eager mode",
              requires={"diffusers": ">=0.35,<0.43", "torch": ">=2.11"})
