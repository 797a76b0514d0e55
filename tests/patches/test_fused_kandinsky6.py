"""Kandinsky 6's eager fusion: the kandinsky6 pattern (block glue, q/k RMSNorm + matrix RoPE).

On the tiny ``kandinsky6-fused`` transformer (2 video/audio blocks, 1 text block per modality, a padded prompt; CPU, a
forced tier standing in for the GPU): diffusers' video and audio outputs bit for bit with the PyTorch tier, within an
fp32 rounding / a bf16 ulp with the kernels. The step-aside cases run on it through ``_fused_models.MODELS``.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import DEVICE, outputs, reverted_outputs, tiny  # noqa: E402
from torchpatches._harness import registry  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

_HAS_TRITON = importlib.util.find_spec("triton") is not None

#: The registry's op calls of a forward (2 video/audio blocks, 1 text block per modality): per text block
#: layer_norm_modulate, gate_residual_layer_norm_modulate, gate_residual; per video/audio block and stream the first
#: LN + modulate, three gated residuals each with the next LN + modulate (text cross, cross-modal, feed-forward), the
#: last gated residual. qk_norm_rope: one launch per self-attention (q and k share length and table), one per tensor
#: in each cross-attention (text, video <- audio, audio <- video).
EXPECTED = registry.FAMILIES["kandinsky6"].calls


def _close(out: List[torch.Tensor], ref: List[torch.Tensor], tier: str, dtype: torch.dtype) -> None:
    assert len(out) == len(ref) == 2
    for o, r in zip(out, ref):
        if tier == "torch":
            assert torch.equal(o, r)
        elif dtype == torch.float32:
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
        else:  # one bf16 ulp where the fp32 statistics or a fused multiply-add cross a rounding boundary
            torch.testing.assert_close(o, r, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_video_and_audio_equal_diffusers(tier: str, dtype: torch.dtype, calls: Dict[str, int]) -> None:
    if tier == "triton":
        pytest.importorskip("triton")
    model, inputs = tiny("kandinsky6", dtype)
    ref = reverted_outputs(model, inputs)
    assert not calls
    with force_tier(tier), torchpatches.disabled("gelu_gemm"):
        out = outputs(model, inputs)
    assert dict(calls) == EXPECTED
    _close(out, ref, tier, dtype)


def test_fp32_modulation_as_from_pretrained_keeps_it(calls: Dict[str, int]) -> None:
    """``_keep_in_fp32_modules``: the modulation Linears stay fp32 in a bf16 model; their fp32 vectors enter the
    kernels as they are (diffusers' ``scale.float()``), bit for bit with the PyTorch tier."""
    model, inputs = tiny("kandinsky6", torch.bfloat16)
    for name, module in model.named_modules():
        if name.endswith("modulation") or "time_embeddings" in name:
            module.float()
    ref = reverted_outputs(model, inputs)
    with force_tier("torch"):
        out = outputs(model, inputs)
    assert dict(calls) == EXPECTED
    _close(out, ref, "torch", torch.bfloat16)


def test_video_alone(calls: Dict[str, int]) -> None:
    """Without audio latents the blocks run their video path alone (diffusers' ``elif vis is not None``)."""
    model, inputs = tiny("kandinsky6", torch.float32)
    inputs.pop("audio_hidden_states")
    ref = reverted_outputs(model, inputs)
    with force_tier("torch"):
        out = outputs(model, inputs)
    assert torch.equal(out[0], ref[0]) and len(out) == len(ref) == 1
    # text blocks 3 each; per video block: LN + modulate, two gated residuals with the next one, the last one
    assert dict(calls) == {"modulate": 2 * 3 + 2 * 4, "qk_norm_rope": 2 * 1 + 2 * 3}


def test_rope_tables_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The matrices become cos/sin tables once per source tensor (video, audio, two text tables) and forward, not
    once per block (``_per_step``'s cache: rebuilt after an in-place write, never kept for inference tensors)."""
    from torchpatches.patches import _per_step
    from torchpatches.patches._bodies import kandinsky6 as body

    built: List[int] = []

    class Counting(_per_step._PerSource):
        def put(self, source: torch.Tensor, *args: Any) -> torch.Tensor:
            built.append(id(source))
            return super().put(source, *args)

    monkeypatch.setattr(body, "_TABLES", Counting())
    model, inputs = tiny("kandinsky6", torch.float32)
    with force_tier("torch"):
        outputs(model, inputs)
    assert len(built) == len(set(built)) == 4


def test_matrix_tables_are_any_matrix_exactly() -> None:
    """``cos = (m00, m11)``, ``sin = (-m01, m10)``: the op's interleaved rotation computes diffusers' matrix product
    (``(rope * x).sum(-1)``) with the same fp32 products and sums, for any matrix, bit for bit."""
    from diffusers.models.transformers.transformer_kandinsky6 import apply_rotary

    from torchpatches.ops._qk_norm_rope import _rope_torch
    from torchpatches.patches._bodies.kandinsky6 import matrix_tables

    g = torch.Generator().manual_seed(0)
    rope = torch.randn(5, 1, 4, 2, 2, generator=g)
    x = torch.randn(2, 5, 3, 8, generator=g).to(torch.bfloat16)
    cos, sin = matrix_tables(rope, 5, 8, x.device)
    assert torch.equal(_rope_torch(x, cos, sin), apply_rotary(x, rope))
    assert matrix_tables(rope.double(), 5, 8, x.device) is None and matrix_tables(rope, 6, 8, x.device) is None


def test_default_eps_is_torchs() -> None:
    """``nn.RMSNorm(eps=None)`` adds the compute type's epsilon (fp32's for bf16 input), which the fused path passes."""
    from torchpatches.patches._bodies.kandinsky6 import _DEFAULT_EPS

    x = (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) * 1e-3).to(torch.bfloat16).to(DEVICE)
    w = torch.ones(16, dtype=torch.bfloat16, device=DEVICE)
    norm = torch.nn.functional.rms_norm
    assert torch.equal(norm(x, (16,), w, None), norm(x, (16,), w, _DEFAULT_EPS))
    assert not torch.equal(norm(x, (16,), w, None), norm(x, (16,), w, torch.finfo(torch.bfloat16).eps))


def test_hooked_norm_and_other_eps_run_diffusers_code(calls: Dict[str, int]) -> None:
    """A hooked q norm: that processor's q/k stretch is diffusers' code (the projections and attention still run);
    a hooked block LayerNorm: that step computes diffusers' expression. Values stay diffusers'."""
    model, inputs = tiny("kandinsky6", torch.float32)
    block = model.visual_transformer_blocks[0]
    hooks = [block.video_dec_block.self_attention.query_norm.register_forward_hook(lambda *a: None),
             block.va_normalization.register_forward_hook(lambda *a: None)]
    try:
        ref = reverted_outputs(model, inputs)
        with force_tier("torch"):
            out = outputs(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    _close(out, ref, "torch", torch.float32)
    assert calls["qk_norm_rope"] == EXPECTED["qk_norm_rope"] - 1
    # the vis gated residual before va_normalization alone (gate_residual), its LN + modulate diffusers'
    assert calls["modulate"] == EXPECTED["modulate"]


def test_processor_keeps_its_parameters() -> None:
    import inspect

    from diffusers.models.transformers import transformer_kandinsky6 as k6

    tiny("kandinsky6")
    params = inspect.signature(k6.Kandinsky6AttnProcessor.__call__).parameters
    assert list(params)[1:] == ["attn", "hidden_states", "encoder_hidden_states", "rotary_emb", "rotary_emb_kv",
                                "attn_mask"]


def _variant(dtype: torch.dtype, **changes: Any) -> torch.nn.Module:
    """The tiny fused model with other constructor options (seeded as the harness seeds it)."""
    import diffusers
    from harness import CONFIGS

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEVICE):
            torch.manual_seed(0)
            model = diffusers.Kandinsky6Transformer3DModel(**dict(CONFIGS["kandinsky6-fused"][1], **changes))
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("tier", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not _HAS_TRITON, reason="triton is not installed"))])
@pytest.mark.parametrize("changes", [
    dict(ca_rope=False, cross_gates=False, fix_modulation=False),  # the architecture variant without weights
    dict(model_dim_a=48, ff_dim_a=96),  # an audio stream of its own width (cross_gates' split vectors)
], ids=["flags-off", "audio-width"])
def test_other_options(changes: Dict[str, Any], tier: str, calls: Dict[str, int]) -> None:
    """The options' other branches: chunked cross-modal vectors, the cross-modal attentions without RoPE (q and k
    normalized alone), an audio width of its own."""
    _, inputs = tiny("kandinsky6", torch.float32)
    model = _variant(torch.float32, **changes)
    ref = reverted_outputs(model, inputs)
    with force_tier(tier):
        out = outputs(model, inputs)
    _close(out, ref, tier, torch.float32)
    assert dict(calls) == EXPECTED


@pytest.mark.parametrize("tier", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not _HAS_TRITON, reason="triton is not installed"))])
def test_batch_of_two(tier: str, calls: Dict[str, int]) -> None:
    """Two samples of their own timestep, prompt and padding (a batched guidance step): each sample's vectors (rows
    of the modulation output, batch-strided), mask and tokens."""
    model, inputs = tiny("kandinsky6", torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    two = {name: torch.cat([t, (torch.randn(t.shape, generator=g).to(t) if t.is_floating_point() else t)])
           if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    two["timestep"] = torch.tensor([500.0, 120.0], device=DEVICE)
    two["encoder_attention_mask"][1, 1:] = False
    ref = reverted_outputs(model, two)
    with force_tier(tier):
        out = outputs(model, two)
    _close(out, ref, tier, torch.bfloat16)
    assert dict(calls) == EXPECTED
