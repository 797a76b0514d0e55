"""torchpatches.ops modulate's ``select`` form (``prechecked`` only): ``[B + 1, D]`` vector rows, each token's row
chosen by a bool ``[S]`` mask as QwenImage 2.1's ``_select_modulation_rows`` chooses it.

The PyTorch tier is diffusers' selection followed by the op's per-token form; the Triton tier (Triton's interpreter on
the CPU) must give exactly what it gives for the per-token ``[B, S, D]`` vectors the selection makes: the same math,
only the vectors' addressing differs.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from _fused_checks import DTYPES, needs_triton
from torchpatches.ops import _modulate, _modulate_torch, force_tier


def _select_modulation_rows(params: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    # diffusers 0.42.1 transformer_qwenimage21._select_modulation_rows, verbatim
    if mask is None:
        return params.unsqueeze(1)
    real, zero = params[:-1].unsqueeze(1), params[-1:].unsqueeze(0)
    return torch.where(mask.view(1, -1, 1), real, zero)


def _case(B: int, S: int, D: int, dtype: torch.dtype, pattern: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    # the mask a slice of a longer one (diffusers' cached step: target_token_mask[prefix_len:]): an offset view
    full = {"all": torch.ones(S + 3, dtype=torch.bool), "none": torch.zeros(S + 3, dtype=torch.bool),
            "mixed": torch.rand(S + 3, generator=g) > 0.5}[pattern]
    rows = 4 * D  # the model's shared modulation [B + 1, 4 D]; the vectors are strided column slices of it
    modulation = rnd(B + 1, rows, scale=0.5)
    scale, gate = modulation[:, :D], modulation[:, D:2 * D].tanh()
    return rnd(B, S, D, scale=4.0), rnd(B, S, D, scale=2.0), scale, gate, full[3:]


@pytest.mark.parametrize("pattern", ["all", "none", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_tier_is_diffusers_selection_and_expression(dtype: torch.dtype, pattern: str) -> None:
    x, y, scale, gate, mask = _case(2, 6, 16, dtype, pattern)
    zero = torch.zeros(1, 16, dtype=dtype).expand(3, 16)
    with force_tier("torch"):
        out = _modulate.prechecked(x, None, None, scale, zero, 1e-6, select=mask)[0]
        h, out2 = _modulate.prechecked(x, gate, y, scale, zero, 1e-6, select=mask)
        h3 = _modulate.prechecked(x, gate, y, None, None, None, clip=True, select=mask)[0]
    norm = torch.nn.functional.layer_norm(x, (16,), eps=1e-6)
    assert torch.equal(out, norm * (1 + _select_modulation_rows(scale, mask)))
    ref_h = x + _select_modulation_rows(gate, mask) * y
    assert torch.equal(h, ref_h) and torch.equal(h3, ref_h.clip(-65504, 65504) if dtype == torch.float16 else ref_h)
    assert torch.equal(out2, torch.nn.functional.layer_norm(ref_h, (16,), eps=1e-6)
                       * (1 + _select_modulation_rows(scale, mask)))
    assert torch.equal(_modulate_torch.select_rows(scale, mask), _select_modulation_rows(scale, mask))


@needs_triton
@pytest.mark.parametrize("pattern", ["all", "none", "mixed"])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_tier_equals_its_per_token_form(dtype: torch.dtype, B: int, pattern: str) -> None:
    x, y, scale, gate, mask = _case(B, 5, 33, dtype, pattern, seed=B)
    zero = torch.zeros(1, 33, dtype=dtype).expand(B + 1, 33)
    tokens = [_select_modulation_rows(v, mask) for v in (scale, gate, zero)]
    with force_tier("triton"):
        got = [_modulate.prechecked(x, None, None, scale, zero, 1e-6, select=mask),
               _modulate.prechecked(x, gate, y, scale, zero, 1e-6, select=mask),
               _modulate.prechecked(x, gate, y, None, None, None, clip=True, select=mask)]
        want = [_modulate.prechecked(x, None, None, tokens[0], tokens[2], 1e-6),
                _modulate.prechecked(x, tokens[1], y, tokens[0], tokens[2], 1e-6),
                _modulate.prechecked(x, tokens[1], y, None, None, None, clip=True)]
    for a, b in zip(got, want):
        assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
