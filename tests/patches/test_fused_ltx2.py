"""LTX-2's eager fusion: the ltx2 pattern (block glue, q/k RMSNorm across heads + split RoPE), beyond the table-driven
cases (``test_fused_families``, ``test_fused_step_aside``: the registry's ``ltx2-fused``, LTX-2.3's options).

Here: LTX-2.0's options (the production checkpoints': no gated attention, no cross-attention modulation, so an
unmodulated norm2), the modalities isolated or one cross-modal direction off, the perturbed-attention (STG) blocks,
the interleaved RoPE, and the plain norm's signed zeros. Tiny models on the CPU, a forced tier standing in for the GPU.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("diffusers")

import diffusers  # noqa: E402

import torchpatches  # noqa: E402
from _fused_models import DEVICE, outputs, reverted_outputs  # noqa: E402
from torchpatches._harness import registry  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

FAMILY = registry.FAMILIES["ltx2"]
#: LTX-2.0's block options (the released LTX-2 checkpoints): the production path.
LTX20 = dict(gated_attn=False, cross_attn_mod=False, audio_gated_attn=False, audio_cross_attn_mod=False)


def _model(dtype: torch.dtype = torch.float32, **overrides: Any):
    """``ltx2-fused`` (2 blocks) with ``overrides``, seeded as the harness builds it, and its inputs."""
    config = dict(FAMILY.fused_config(), **overrides)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEVICE):
            torch.manual_seed(0)
            model = diffusers.LTX2VideoTransformer3DModel(**config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)

    inputs = FAMILY.inputs(config, randn, DEVICE, dtype)
    inputs.pop("return_dict")
    return model, inputs


def _close(out: List[torch.Tensor], ref: List[torch.Tensor], tier: str) -> None:
    for o, r in zip(out, ref):
        if tier == "torch":
            assert torch.equal(o, r)
        else:  # the fp32 statistics in another order: an ulp of a norm's output where it crosses a rounding
            torch.testing.assert_close(o, r, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tier, dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                         ("triton", torch.bfloat16)])
def test_ltx20_options_equal_diffusers(tier: str, dtype: torch.dtype, calls: Dict[str, int]) -> None:
    """LTX-2.0: norm2 unmodulated (the modulate kernel with a zero scale and a negative-zero shift), the text
    residual ungated; the same op calls as LTX-2.3."""
    if tier == "triton":
        pytest.importorskip("triton")
    model, inputs = _model(dtype, **LTX20)
    ref = reverted_outputs(model, inputs)
    with force_tier(tier), torchpatches.disabled("gelu_gemm"):
        out = outputs(model, inputs)
    assert dict(calls) == FAMILY.calls
    _close(out, ref, tier)


def test_isolated_modalities(calls: Dict[str, int]) -> None:
    """``isolate_modalities=True``: no cross-modal norms or attentions; per block and stream the text residual alone
    and norm3 without a residual before it (5 modulate), 4 attentions."""
    model, inputs = _model(torch.bfloat16, **LTX20)
    inputs["isolate_modalities"] = True
    ref = reverted_outputs(model, inputs)
    with force_tier("torch"), torchpatches.disabled("gelu_gemm"):
        out = outputs(model, inputs)
    assert dict(calls) == {"modulate": 20, "rms_norm_rope": 8}
    _close(out, ref, "torch")


@pytest.mark.parametrize("off", ["use_a2v_cross_attention", "use_v2a_cross_attention"])
def test_one_cross_modal_direction(off: str, calls: Dict[str, int]) -> None:
    """One direction off (set by a pre-hook on the blocks): the cross-modal norm modulated once per stream, the
    stream without a cross-modal output goes to norm3 without a residual."""
    model, inputs = _model(torch.bfloat16)

    def hook(module: Any, args: Any, kwargs: Dict[str, Any]) -> Any:
        return args, dict(kwargs, **{off: False})

    handles = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in model.transformer_blocks]
    try:
        ref = reverted_outputs(model, inputs)
        with force_tier("torch"), torchpatches.disabled("gelu_gemm"):
            out = outputs(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    assert dict(calls) == {"modulate": 20, "rms_norm_rope": 10}
    _close(out, ref, "torch")


def test_perturbed_attention_blocks_fuse_their_glue(calls: Dict[str, int]) -> None:
    """Spatio-temporal guidance (``perturbed_attn=True``): the blocks' glue fuses, the self-attentions get the
    perturbation arguments as diffusers passes them, and ``LTX2PerturbedAttnProcessor`` (not targeted) runs diffusers'
    code; a perturbed block (0) and one that is not (1)."""
    model, inputs = _model(torch.bfloat16, perturbed_attn=True)
    inputs["spatio_temporal_guidance_blocks"] = [0]
    inputs["perturbation_mask"] = torch.tensor([0.0], device=DEVICE)
    ref = reverted_outputs(model, inputs)
    with force_tier("torch"), torchpatches.disabled("gelu_gemm"):
        out = outputs(model, inputs)
    assert dict(calls) == {"modulate": 24}
    _close(out, ref, "torch")


def test_interleaved_rope_keeps_diffusers_rotation(calls: Dict[str, int]) -> None:
    """``rope_type="interleaved"`` (``[B, S, W]`` tables): the processor rotates with diffusers' code; only the text
    cross-attentions (no RoPE) normalize through the op; the block glue still fuses."""
    model, inputs = _model(torch.bfloat16, rope_type="interleaved")
    ref = reverted_outputs(model, inputs)
    with force_tier("torch"), torchpatches.disabled("gelu_gemm"):
        out = outputs(model, inputs)
    assert dict(calls) == {"modulate": 24, "rms_norm_rope": 4}
    _close(out, ref, "torch")


@pytest.mark.parametrize("tier", ["torch", "triton"])
def test_plain_norm_keeps_signed_zeros(tier: str) -> None:
    """The unmodulated norm through the modulate kernel (``n * (1 + 0) + (-0.0)``) is ``RMSNorm(x)`` bit for bit,
    signs of zeros included (a ``+0.0`` shift would turn ``-0.0`` into ``+0.0``)."""
    if tier == "triton":
        pytest.importorskip("triton")
    from diffusers.models.normalization import RMSNorm

    from torchpatches.ops import _modulate
    from torchpatches.patches import _table_modulated

    x = torch.randn(2, 3, 16, dtype=torch.bfloat16, device=DEVICE)
    x[0, 1] = -0.0
    x[1, 2, :5] = -0.0
    zero, negative = _table_modulated.identity(x)
    with force_tier(tier), torchpatches.disabled("gelu_gemm"):
        out = _modulate.prechecked(x, None, None, zero, negative, 1e-6, addends=(None, zero, negative), rms=True)[0]
    ref = RMSNorm(16, eps=1e-6, elementwise_affine=False)(x)
    assert torch.equal(out, ref) and torch.equal(out.signbit(), ref.signbit())


def test_text_mask_prepared_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The text cross-attentions' ``prepare_attention_mask`` runs once per mask tensor (video, audio) and step, not
    per block; a new step's mask is prepared again; under ``torch.inference_mode()`` (no version counters) per call."""
    from diffusers.models.transformers import transformer_ltx2

    model, inputs = _model(torch.bfloat16)
    real = transformer_ltx2.LTX2Attention.prepare_attention_mask
    seen: List[int] = []

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(transformer_ltx2.LTX2Attention, "prepare_attention_mask", counting)
    ref = reverted_outputs(model, inputs)
    assert len(seen) == 4  # 2 blocks x (video, audio)
    seen.clear()
    with force_tier("torch"), torchpatches.disabled("gelu_gemm"):
        _close(outputs(model, inputs), ref, "torch")
        assert len(seen) == 2
        outputs(model, inputs)
        assert len(seen) == 4
        with torch.inference_mode():
            _close(list(model(**inputs, return_dict=False)), ref, "torch")
    assert len(seen) == 8
