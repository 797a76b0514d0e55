"""FLUX.3's eager fusion: the flux3 pattern (per-token adaLN glue, the fp32 q/k norm + RoPE chain, SwiGLU).

On the tiny ``flux3-fused`` transformer (2 per-mode blocks per mode, 2 joint single blocks; CPU, a forced tier
standing in for the GPU). The registry's table (test_fused_families.py) runs it in each dtype; here: the kernels in
fp32, the q/k norms' fp32 weights and reference image tokens, fused projections, what steps aside. The step-aside
cases run on it through ``_fused_models.MODELS``.
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import DEVICE, reverted, run, tiny  # noqa: E402
from harness import registry  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

#: The fused op calls of one flux3-fused forward (the registry row's; test_fused_families.py pins them).
EXPECTED = registry.FAMILIES["flux3"].calls


def _check(out: torch.Tensor, ref: torch.Tensor, tier: str, dtype: torch.dtype) -> None:
    if tier == "torch":
        assert torch.equal(out, ref)
    elif dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # one bf16 ulp where the fp32 norm statistics cross a rounding boundary, carried through the blocks
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_triton_tier_in_fp32(calls: Dict[str, int]) -> None:
    """The kernels in fp32 (the registry's table runs them in bf16): within fp32 noise of diffusers' values."""
    pytest.importorskip("triton")
    model, inputs = tiny("flux3", torch.float32)
    ref = reverted(model, inputs)
    with force_tier("triton"), torchpatches.disabled("gelu_gemm"):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED
    _check(out, ref, "triton", torch.float32)


@pytest.mark.parametrize("tier", ["torch", "triton"])
def test_fp32_qk_norms_and_reference_image(tier: str, calls: Dict[str, int]) -> None:
    """As ``from_pretrained(torch_dtype=torch.bfloat16)`` loads it: the q/k norms' weights fp32
    (``_keep_in_fp32_modules``); with reference image tokens (the image_cond mode blocks, a cat of the modulation
    rows before the single blocks)."""
    if tier == "triton":
        pytest.importorskip("triton")
    model, inputs = tiny("flux3", torch.bfloat16)
    for name, module in model.named_modules():
        if name.endswith(("norm_q", "norm_k")):
            module.float()
    g = torch.Generator().manual_seed(1)
    cond = inputs["hidden_states"][:, :4]
    inputs = dict(inputs, image_cond_hidden_states=torch.randn(cond.shape, generator=g).to(cond),
                  image_cond_ids=inputs["img_ids"][:4] + torch.tensor([1.0, 0, 0, 0], device=DEVICE))
    ref = reverted(model, inputs)
    with force_tier(tier), torchpatches.disabled("gelu_gemm"):
        out = run(model, inputs)
    assert calls["qk_norm_rope"] == 8 and calls["modulate"] == 6 * 2 + 2 * 4 + 1
    _check(out, ref, tier, torch.bfloat16)


def _declines(model: torch.nn.Module, inputs: Dict[str, Any], calls: Dict[str, int]) -> torch.Tensor:
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    return out


def test_stock_modules_only(calls: Dict[str, int]) -> None:
    """A q/k norm of another class, an affine block norm: diffusers' code for that stretch (the q/k chain, the
    LayerNorm + modulate), the rest fused (the block's gated residual too)."""
    model, inputs = tiny("flux3", torch.float32)

    class Norm(torch.nn.RMSNorm):
        pass

    attn = model.single_transformer_blocks[0].attn
    norm = Norm(attn.norm_q.normalized_shape, eps=attn.norm_q.eps, device=DEVICE)
    norm.load_state_dict(attn.norm_q.state_dict())
    attn.norm_q = norm
    model.txt_mode_blocks[0].norm = torch.nn.LayerNorm(model.inner_dim, eps=1e-6, device=DEVICE)
    _declines(model, inputs, calls)
    assert calls["qk_norm_rope"] == EXPECTED["qk_norm_rope"] - 1
    assert calls["modulate"] == EXPECTED["modulate"] - 1


def test_extra_arguments_run_diffusers_forward(calls: Dict[str, int]) -> None:
    """A block called with an extra argument runs diffusers' forward (which raises as diffusers does)."""
    model, _ = tiny("flux3", torch.float32)
    block = model.txt_mode_blocks[0]
    x = torch.randn(1, 3, model.inner_dim)
    with force_tier("torch"), pytest.raises(TypeError):
        block(x, torch.randn(1, 3, 3 * model.inner_dim), None, "extra")
    assert not calls


def test_fused_projections(calls: Dict[str, int]) -> None:
    """After ``fuse_qkv_projections()`` the processor takes q, k, v as chunks of ``to_qkv``'s output: fused too."""
    model, inputs = tiny("flux3", torch.bfloat16)
    model.fuse_qkv_projections()
    assert model.single_transformer_blocks[0].attn.fused_projections
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref) and calls["qk_norm_rope"] == EXPECTED["qk_norm_rope"]


def test_single_block_text_of_another_dtype_runs_diffusers_glue(calls: Dict[str, int]) -> None:
    """Streams that do not fit one joint buffer (here text in fp32 beside bf16 image rows): each stream's glue is
    diffusers' expression where its tensors do not fit, torch.cat promoting as diffusers' does."""
    model, _ = tiny("flux3", torch.bfloat16)
    block = model.single_transformer_blocks[0]
    g = torch.Generator().manual_seed(2)
    D = model.inner_dim
    x, c = torch.randn(1, 4, D, generator=g).bfloat16(), torch.randn(1, 3, D, generator=g)
    mod, c_mod = torch.randn(1, 4, 3 * D, generator=g).bfloat16(), torch.randn(1, 3, 3 * D, generator=g)
    rope = model.pos_embed(torch.zeros(7, 4))
    with torchpatches.disabled("flux3", "rope"):
        try:
            ref = block(x, c, mod, c_mod, rope)
        except RuntimeError as error:  # diffusers' own failure (mixed dtypes in a Linear) is the answer
            ref = error
    with force_tier("torch"):
        if isinstance(ref, Exception):
            with pytest.raises(type(ref)):
                block(x, c, mod, c_mod, rope)
            return
        out = block(x, c, mod, c_mod, rope)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_eps_set_to_none_after_the_verdict(calls: Dict[str, int]) -> None:
    """``norm_q.eps = None`` (RMSNorm's dtype eps) after a fused forward: diffusers' code for that processor."""
    model, inputs = tiny("flux3", torch.float32)
    with force_tier("torch"):
        run(model, inputs)
    model.txt_mode_blocks[0].attn.norm_q.eps = None
    ref = reverted(model, inputs)
    calls.clear()
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref) and calls["qk_norm_rope"] == EXPECTED["qk_norm_rope"] - 1
