"""Krea 2's eager fusion: the krea2 pattern (block glue, the processor's q/k stretch and output gate, the block's
attention call without signature inspection).

On the tiny ``krea2-fused`` transformer (2 blocks, one layer-wise and one refiner text-fusion block, GQA 4 q / 2 kv
heads, a mid-prompt padded text mask; CPU, a forced tier standing in for the GPU): diffusers' values bit for bit
with the PyTorch tier, within a bf16 ulp with the kernels. Its norms' weights and modulation tables are drawn at
random (the constructor's zeros, which the registry-wide tests in test_fused_families.py run, would hide a wrong
``1 + w`` or table row). The step-aside cases run on it through ``_fused_models.MODELS``.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Dict, Iterator, Optional, Tuple

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import DEVICE, FUSED, run, tiny  # noqa: E402
from harness import registry  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

#: Per main block: norm1 + modulate, gate + residual + norm2 + modulate, gate + residual (modulate), the SwiGLU
#: product (swiglu); per attention call (2 blocks, 2 text-fusion blocks) one qk_norm_rope and the sigmoid gate
#: (swiglu): the registry's row.
EXPECTED = registry.FAMILIES["krea2"].calls


def _krea2() -> Any:
    from diffusers.models.transformers import transformer_krea2

    return transformer_krea2


def model_and_inputs(dtype: torch.dtype, norm_dtype: Optional[torch.dtype] = None
                     ) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The tiny model with random norm weights (of ``norm_dtype``: fp32 as ``from_pretrained`` keeps them) and
    modulation tables."""
    model, inputs = tiny("krea2", dtype)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "norm" in name.split(".")[-2] or name.endswith("scale_shift_table"):
            to = norm_dtype if norm_dtype is not None and "norm" in name else p.dtype
            p.data = (torch.randn(p.shape, generator=g) * 0.2).to(device=p.device, dtype=to)
    return model, inputs


def diffusers_code() -> Any:
    """diffusers' own code: every pattern off (the rope patch too: its alias in Krea 2's module is put back)."""
    return torchpatches.disabled(*FUSED, "rope")


def diffusers_run(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    with diffusers_code():
        return run(model, inputs)


@pytest.fixture
def signatures(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """The ``inspect.signature`` calls ``Krea2Attention.forward`` makes (of its processor's ``__call__``)."""
    seen: list = []
    real, processor = inspect.signature, _krea2().Krea2AttnProcessor

    def signature(obj: Any, *args: Any, **kwargs: Any) -> inspect.Signature:
        if isinstance(getattr(obj, "__self__", None), processor):
            seen.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", signature)
    yield seen


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_equals_diffusers(tier: str, dtype: torch.dtype, calls: Dict[str, int], signatures: list) -> None:
    if tier == "triton":
        pytest.importorskip("triton")
    model, inputs = model_and_inputs(dtype)
    ref = diffusers_run(model, inputs)
    assert not calls and len(signatures) == 4, "diffusers inspects its processor in every attention call"
    signatures.clear()
    with force_tier(tier), torchpatches.disabled("gelu_gemm"):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED and len(signatures) == 2, "the text-fusion blocks' attention still inspects"
    if tier == "torch":
        assert torch.equal(out, ref)
    elif dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:  # one bf16 ulp where the fp32 norm statistics cross a rounding boundary, carried through the GEMMs
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tier", ["torch", "triton"])
def test_fp32_norms_of_a_bf16_checkpoint(tier: str, calls: Dict[str, int]) -> None:
    """As ``from_pretrained(torch_dtype=bf16)`` leaves Krea 2: its norms in fp32 (``_keep_in_fp32_modules``), the
    rest bf16. Still fused; bit for bit with the PyTorch tier."""
    if tier == "triton":
        pytest.importorskip("triton")
    model, inputs = model_and_inputs(torch.bfloat16, torch.float32)
    assert model.transformer_blocks[0].attn.norm_q.weight.dtype == torch.float32
    ref = diffusers_run(model, inputs)
    with force_tier(tier):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED
    if tier == "torch":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("where", ["norm2", "attn"])
def test_a_hooked_submodule(where: str, calls: Dict[str, int], signatures: list) -> None:
    """A forward hook on a block's norm: that block runs diffusers' forward. On its attention: the block calls it as
    a module (diffusers' forward then inspects its processor), the rest stays fused. The hook sees its call."""
    model, inputs = model_and_inputs(torch.float32)
    ref = diffusers_run(model, inputs)
    signatures.clear()
    seen = []
    hook = getattr(model.transformer_blocks[0], where).register_forward_hook(lambda *args: seen.append(1))
    with force_tier("torch"), contextlib.ExitStack() as stack:
        stack.callback(hook.remove)
        out = run(model, inputs)
    assert seen == [1] and len(signatures) == 3 and torch.equal(out, ref)
    if where == "norm2":
        assert calls["modulate"] == 3 and calls["swiglu"] == 5
    else:
        assert dict(calls) == EXPECTED


def test_processor_keeps_its_parameters() -> None:
    """diffusers' Attention passes a processor only the keyword arguments its signature names."""
    model_and_inputs(torch.float32)
    params = inspect.signature(_krea2().Krea2AttnProcessor.__call__).parameters
    assert list(params) == ["self", "attn", "hidden_states", "attention_mask", "image_rotary_emb"]


def test_a_temb_of_another_shape_runs_diffusers_block(calls: Dict[str, int]) -> None:
    """A ``[B, 6 * D]`` temb (the model passes ``[B, 1, 6 * D]``): diffusers' block, which broadcasts it."""
    model, inputs = model_and_inputs(torch.float32)
    block = model.transformer_blocks[0]
    x = torch.randn(1, 21, model.hidden_size, device=DEVICE)
    temb = torch.randn(1, 6 * model.hidden_size, device=DEVICE)
    rope = model.rotary_emb(inputs["position_ids"])
    with torch.no_grad():
        with diffusers_code():
            ref = block(x, temb, rope)
        with force_tier("torch"):
            out = block(x, temb, rope)
    assert torch.equal(out, ref)
    assert "modulate" not in calls and calls["qk_norm_rope"] == calls["swiglu"] == 1
