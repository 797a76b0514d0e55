"""The eager fusion patches under hostile use: inputs needing grad that the block-level checks do not see,
and user subclasses of patched diffusers classes. The fused path must never drop a gradient, and must
never skip code a user overrode.

Tiny FLUX.1 / FLUX.2 from ``torchpatches._harness`` on CPU; a forced PyTorch tier stands in for the GPU
(op call counters show which path ran).
"""
from __future__ import annotations

from typing import Dict

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import FUSED, exact, tiny  # noqa: E402
from diffusers.models import activations  # noqa: E402
from diffusers.models.transformers import transformer_flux, transformer_flux2  # noqa: E402,F401
from torchpatches.ops import _linear_gelu as linear_gelu  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")


@pytest.mark.parametrize("which", ["flux1", "flux2", "sd3"])
def test_text_embeddings_needing_grad_get_diffusers_code(which: str, calls: Dict[str, int]) -> None:
    """Prompt tuning / textual inversion: a frozen model, encoder_hidden_states requiring grad. The image
    stream needs no grad, so the attention processor must look at the text stream too: its q/k/v would go
    through a fused kernel (no backward on the GPU: the gradient of the prompt silently lost)."""
    model, inputs = tiny(which)

    def grad_of_prompt() -> torch.Tensor:
        prompt = inputs["encoder_hidden_states"].clone().requires_grad_(True)
        out = model(**{**inputs, "encoder_hidden_states": prompt}, return_dict=False)[0]
        out.square().sum().backward()
        return prompt.grad

    with torchpatches.disabled(*FUSED):
        ref = grad_of_prompt()
    with force_tier("torch"):
        got = grad_of_prompt()
    assert not any(key.endswith("with grad") for key in calls), dict(calls)
    assert torch.equal(got, ref)


class _ReluGELU(activations.GELU):
    """A user's subclass that changes the activation, as diffusers' own GELU.gelu lets it."""

    def gelu(self, gate: torch.Tensor) -> torch.Tensor:
        return torch.relu(gate)


def test_gelu_subclass_overriding_gelu_keeps_its_activation(monkeypatch: pytest.MonkeyPatch) -> None:
    # The epilogue tier is CUDA-only; let it "fit" on CPU (there torch._addmm_activation is the erf GELU,
    # which is enough to see which path ran).
    monkeypatch.setattr(linear_gelu, "lt_tier_fits", lambda *args: True)
    x = torch.randn(2, 3, 8)
    with torch.no_grad(), force_tier("torch"):  # a forced tier: permission to fuse on CPU
        stock = activations.GELU(8, 6, approximate="tanh").eval()
        fused = torch._addmm_activation(stock.proj.bias, x.reshape(-1, 8), stock.proj.weight.t(), use_gelu=True)
        assert torch.equal(stock(x), fused.view(2, 3, 6))  # the patched path runs for the stock class
        mine = _ReluGELU(8, 6, approximate="tanh").eval()
        assert torch.equal(mine(x), torch.relu(mine.proj(x)))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's, on diffusers' path
@pytest.mark.parametrize("misfit", ["fp32 key", "expanded value", "text key of another shape"])
def test_projections_that_do_not_fit_get_diffusers_code(misfit: str, calls: Dict[str, int]) -> None:
    """The FLUX q/k path calls the op's unchecked entry, so the pattern itself must refuse what the op would
    have refused: a projection of another dtype (a hook casting to fp32), an expanded view (two outputs in one
    place), a text projection whose shape does not match. Diffusers' own code then runs: the same output."""
    model, inputs = tiny("flux1")
    block = model.transformer_blocks[0]
    target = {"fp32 key": block.attn.to_k, "expanded value": block.attn.to_v,
              "text key of another shape": block.attn.add_k_proj}[misfit]

    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if misfit == "fp32 key":  # the tiny model is fp32: another dtype is float64
            return out.double()
        if misfit == "expanded value":
            return out[:, :1].expand_as(out)
        return out[:, :-1]

    target.register_forward_hook(hook)
    with torch.no_grad():
        with torchpatches.disabled(*FUSED, "rope"):  # diffusers' own code throughout (rope: its Triton tier on a GPU)
            try:
                ref = model(**inputs, return_dict=False)[0]
            except RuntimeError as e:  # diffusers' own code refuses the misfit too: the same error
                ref = e
        with exact():  # the PyTorch tier, gelu_gemm off: bit for bit on a GPU too
            try:
                got = model(**inputs, return_dict=False)[0]
            except RuntimeError as e:
                got = e
    if isinstance(ref, Exception):
        assert type(got) is type(ref) and str(got) == str(ref)
    else:
        assert torch.equal(got, ref)
        assert calls["qk_norm_rope"] == len(model.single_transformer_blocks)  # the hooked double block: diffusers'

