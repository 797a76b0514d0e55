"""rope_tables: FLUX.1 / FLUX.2 rotary cos / sin tables in one kernel instead of 44 or 58 (eager).

What goes wrong upstream
    ``FluxPosEmbed.forward`` (FLUX.1) and ``Flux2PosEmbed.forward`` (FLUX.2) compute the rotary tables of every
    forward from the position ids: per axis ``get_1d_rotary_pos_embed`` runs about fourteen small kernels (an
    ``arange``, divisions, ``pow``, a reciprocal, the fp64 ``outer`` product, ``cos`` and ``sin``, two
    ``repeat_interleave`` and two casts), then the axes are concatenated: 44 launches per call for FLUX.1's three
    axes, 58 for FLUX.2's four (measured: the launches the patch removes from a step). They run before the first
    transformer block, while the GPU has nothing else queued, so the GPU waits for the host through all of them
    (docs/notes/fusion.md, "The prologue and rope_tables", measures those waits).
    ``torch.compile`` fuses them; eager users pay them on every step. No upstream issue or PR as of diffusers
    0.42.1.

What the patch changes
    Both forwards call ``torchpatches.ops.rope_tables`` (one Triton kernel; the fp64 frequency
    vectors are computed once per device with diffusers' own ops and kept) when ``ids`` is a plain 2-D CUDA
    tensor of a real float or integer dtype (FLUX.2's pipeline passes int64 ids) without gradients, with one
    column per axis (FLUX.1) or at least as many columns as axes (FLUX.2), and the axes are positive even ints;
    otherwise diffusers' forward. It steps aside under ``torch.compile``, ``torch.jit.trace``, forward AD and
    functorch transforms, autocast, module-global hooks, and when a global of the forward
    (``get_1d_rotary_pos_embed``, ``maybe_adjust_dtype_for_device``) or a function it reaches through ``torch``
    (``torch.cat``, ``torch.arange``, ``torch.outer``) is not what it was. Hooks on the embedder run around the
    fused forward (they see its inputs and the same output).

Tolerance
    The same fp64 frequencies, product, cos / sin (the CUDA math library in both), one rounding to fp32:
    diffusers' bits on CUDA (checked by the CUDA run of tests/ops/test_rope_tables.py). The source of
    ``get_1d_rotary_pos_embed`` and ``maybe_adjust_dtype_for_device`` is verified (``Patch.verifies``).

Versions
    diffusers 0.42.x (fingerprints verified on 0.42.1); torch >= 2.4.

When to delete
    When diffusers caches or fuses the FLUX rotary tables in eager mode.
"""
from .._core.declare import Patch
from ._fused_common import CAT, FUSED_REQUIRES, fused_target

_BODY = "torchpatches.patches._bodies.rope_tables"
_FLUX = "diffusers.models.transformers.transformer_flux"
_FLUX2 = "diffusers.models.transformers.transformer_flux2"
#: What the replaced code reaches through modules: the forward's concat, get_1d_rotary_pos_embed's arange and outer.
_ASSUMES = CAT + ("torch:arange", "torch:outer")


PATCH = Patch(
    name="rope_tables",
    summary="FLUX.1 / FLUX.2 rotary cos/sin tables in one kernel (eager)",
    targets=(  # fingerprints: diffusers 0.42.1
        fused_target("rope_tables", f"{_FLUX}:FluxPosEmbed.forward", f"{_BODY}:_flux", "9f26fa5cbad33ac0", _ASSUMES),
        fused_target("rope_tables", f"{_FLUX2}:Flux2PosEmbed.forward", f"{_BODY}:_flux2", "6a09d958bc3721c4", _ASSUMES),
    ),
    # What the replaced forwards call and the op reproduces (diffusers 0.42.1): another source skips the patch.
    verifies={"diffusers.models.embeddings:get_1d_rotary_pos_embed": frozenset({"0734204c538630d0"}),
              "diffusers.utils.torch_utils:maybe_adjust_dtype_for_device": frozenset({"a8c927dd2807ee99"})},
    requires=FUSED_REQUIRES,
)
