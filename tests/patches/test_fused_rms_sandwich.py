"""The RMSNorm-sandwich families' eager fusion (Z-Image, Ideogram 4): rms_sandwich_block, rms_sandwich_qk_norm_rope.

On the tiny ``zimage-fused`` (2 main blocks, a modulated noise refiner and an unmodulated context refiner; the
sequence padded to 32 with a mask) and ``ideogram4-fused`` (2 blocks, a segment mask) transformers on the CPU (a
forced tier stands in for the GPU): the fused paths compute what diffusers computes, bit for bit with the PyTorch
tier; the Triton tier (interpreted) within a few fp32 ulps; every form they do not cover gets diffusers' code (op
call counters show which path ran). The step-aside cases (forward AD, vmap/jvp, autocast, compile) run on both
families through ``_fused_models.MODELS`` in test_fused_step_aside.py and test_fused_recompiles.py.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import DEVICE, FUSED, exact, reverted, run, tiny  # noqa: E402
from harness import registry  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

#: Fused op calls per forward with every pattern on. Z-Image: three modulated blocks (2 main + the noise refiner)
#: make 3 rms_modulate and 1 swiglu each; the unmodulated context refiner is diffusers' code; all 4 attention calls
#: fuse. Ideogram 4: 2 blocks, each with its attention (half-split bf16 RoPE).
EXPECTED = {name: registry.FAMILIES[name].calls for name in ("zimage", "ideogram4")}
FAMILIES = sorted(EXPECTED)

try:
    import triton  # noqa: F401

    TIERS = ["torch", "triton"]
except ImportError:  # pragma: no cover
    TIERS = ["torch"]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel tier against diffusers: fp32 statistics in another order, the real-form rotation and Triton's
    ``exp`` move fp32 results by ulps (carried through attention), bf16/fp16 by one ulp where that crosses a rounding
    boundary; a wrong table, mask or vector moves them by order 1e-1."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[out.dtype]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def _zimage_batch(model: torch.nn.Module, inputs: Dict[str, Any]) -> Dict[str, Any]:
    """Two samples as ZImagePipeline's classifier-free guidance passes them: the latents twice, the prompt's and the
    negative prompt's caption features of different lengths (different padding, masks and RoPE rows per sample)."""
    x, cap = inputs["x"][0], inputs["cap_feats"][0]
    return dict(inputs, x=[x, x * 0.5], cap_feats=[cap, cap[:3] * 2], t=torch.tensor([0.5, 0.5], device=DEVICE))


@pytest.mark.parametrize("tier", TIERS)
def test_zimage_guidance_batch_has_per_sample_rope_and_masks(tier: str, calls: Dict[str, int]) -> None:
    """Batch 2 with captions of different lengths: each sample's own RoPE rows (``[B, S, D/2]`` frequencies) and
    padding mask; the fused attention runs (a shared table would rotate the second sample wrongly)."""
    model, inputs = tiny("zimage", torch.float32)
    inputs = _zimage_batch(model, inputs)
    ref = reverted(model, inputs)
    with force_tier(tier):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED["zimage"]
    if tier == "torch":
        assert torch.equal(out, ref)
    else:
        _close(out, ref)


def test_ideogram4_per_token_timesteps(calls: Dict[str, int]) -> None:
    """A ``[B, L]`` timestep: per-token ``[B, L, D]`` modulation vectors, through the same fused op."""
    model, inputs = tiny("ideogram4", torch.bfloat16)
    length = inputs["hidden_states"].shape[1]
    inputs["timestep"] = torch.linspace(0.1, 0.9, length, device=DEVICE, dtype=torch.bfloat16)[None]
    ref = reverted(model, inputs)
    with exact():
        out = run(model, inputs)
    assert dict(calls) == EXPECTED["ideogram4"] and torch.equal(out, ref)


def _first_block(model: torch.nn.Module) -> torch.nn.Module:
    return model.layers[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hooked_norm_gets_diffusers_block(family: str, calls: Dict[str, int]) -> None:
    """A forward hook on a block's post-attention norm: that block runs diffusers' code (the hook sees each call);
    the other blocks stay fused."""
    model, inputs = tiny(family, torch.bfloat16)
    ref = reverted(model, inputs)
    seen = []
    handle = _first_block(model).attention_norm2.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    try:
        with exact():
            out = run(model, inputs)
    finally:
        handle.remove()
    assert torch.equal(out, ref) and len(seen) == 1
    assert calls["rms_modulate"] == EXPECTED[family]["rms_modulate"] - 3


@pytest.mark.parametrize("change", ["bias", "no weight", "subclass"])
def test_a_norm_the_op_does_not_compute_gets_diffusers_block(change: str, calls: Dict[str, int]) -> None:
    model, inputs = tiny("ideogram4", torch.bfloat16)
    norm = _first_block(model).ffn_norm2
    if change == "bias":
        norm.bias = torch.nn.Parameter(torch.full_like(norm.weight, 0.25))
    elif change == "no weight":
        norm.weight = None
    else:  # a user's own norm class (its forward may compute anything)
        norm.__class__ = type("ScaledRMSNorm", (type(norm),), {"forward": lambda self, x: super(type(self), self)
                                                               .forward(x) * 0.5})
    ref = reverted(model, inputs)
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref)
    assert calls["rms_modulate"] == EXPECTED["ideogram4"]["rms_modulate"] - 3


def test_a_replaced_feed_forward_method_runs_the_module(calls: Dict[str, int]) -> None:
    """A user's own gating on the feed-forward instance: the module runs (its Linears and the user's gating)."""
    model, inputs = tiny("zimage", torch.bfloat16)
    ff = _first_block(model).feed_forward
    ff._forward_silu_gating = lambda x1, x3: torch.nn.functional.gelu(x1) * x3
    ref = reverted(model, inputs)
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and calls["swiglu"] == EXPECTED["zimage"]["swiglu"] - 1


@pytest.mark.parametrize("family, processor", [("zimage", "ZSingleStreamAttnProcessor"),
                                               ("qwenimage", "QwenDoubleStreamAttnProcessor2_0")])
def test_processors_keep_the_originals_parameters(family: str, processor: str) -> None:
    """diffusers' ``Attention.forward`` passes a processor only the keyword arguments its ``__call__``'s signature
    names (Z-Image's ``freqs_cis``, QwenImage's ``encoder_hidden_states_mask``): the replacement spells them out."""
    from torchpatches._core.slot import MARK_ORIGINAL

    model, _ = tiny(family)
    found = [m.processor for m in model.modules() if type(getattr(m, "processor", None)).__name__ == processor]
    call = type(found[0]).__call__
    original = getattr(call, MARK_ORIGINAL)
    assert list(inspect.signature(call).parameters) == list(inspect.signature(original).parameters)
    assert [p.default for p in inspect.signature(call).parameters.values()] == \
        [p.default for p in inspect.signature(original).parameters.values()]


@pytest.mark.parametrize("tier", TIERS)
def test_zimage_omni_per_token_modulation(tier: str, calls: Dict[str, int]) -> None:
    """Z-Image omni (ZImageOmniPipeline): a clean condition image and the noisy target in one sequence, SigLIP
    features, per-token vectors from ``select_per_token`` (``[B, S, D]``): the same fused op, diffusers' values."""
    from _fused_models import output
    from diffusers import ZImageTransformer2DModel
    from harness import CONFIGS

    torch.manual_seed(0)
    model = ZImageTransformer2DModel(**dict(CONFIGS["zimage-fused"][1], siglip_feat_dim=8)).eval().to(DEVICE)
    g = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE)

    inputs = dict(x=[[randn(4, 1, 8, 8), randn(4, 1, 8, 8)]], t=torch.tensor([0.5], device=DEVICE),
                  cap_feats=[[randn(5, 16), randn(3, 16)]], siglip_feats=[[randn(2, 2, 8), None]],
                  image_noise_mask=[[0, 1]])
    with torchpatches.disabled(*FUSED, "rope"), torch.no_grad():
        ref = output(model(**inputs, return_dict=False))
    with force_tier(tier), torch.no_grad():
        out = output(model(**inputs, return_dict=False))
    assert calls["rms_modulate"] == EXPECTED["zimage"]["rms_modulate"]
    if tier == "torch":
        assert torch.equal(out, ref)
    else:
        _close(out, ref)


def test_ideogram4_mask_made_additive_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ideogram 4's boolean block-diagonal mask goes to SDPA as the additive mask SDPA would make of it, built once
    for every block of the step (native backend), again after an in-place write; the output is diffusers'."""
    from torchpatches.patches import _per_step

    built = []
    real = _per_step.additive_mask
    monkeypatch.setattr(_per_step, "additive_mask", lambda *args: built.append(real(*args)) or built[-1])
    model, inputs = tiny("ideogram4", torch.bfloat16)
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    assert len(built) == 2 and built[0] is built[1] and built[0].dtype == torch.bfloat16
    mask = torch.tensor([[True, False], [True, True]])
    first = _per_step.additive_mask(mask, torch.float32)
    assert _per_step.additive_mask(mask, torch.float32) is first
    mask[0, 1] = True
    again = _per_step.additive_mask(mask, torch.float32)
    assert again is not first and torch.equal(again, torch.zeros(2, 2))
