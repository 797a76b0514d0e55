"""The fused call helpers the patches share (``patches/_modulate_calls``), for the second rounding mode:
Wan's ``(norm1(x.float()) * (1 + scale) + shift).type_as(x)`` with diffusers' ``FP32LayerNorm`` and an fp32
modulation table. The fused op (PyTorch tier forced on CPU) must give Wan's expression bit for bit, and a
norm it does not cover (affine, hooked) must run Wan's expression itself."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.models.normalization import FP32LayerNorm  # noqa: E402
from torchpatches.ops.modulate import force_tier  # noqa: E402
from torchpatches.patches._modulate_calls import modulated_once  # noqa: E402


def _wan(norm: torch.nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return (norm(x.float()) * (1 + scale) + shift).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("affine", [False, True])
def test_modulated_once_is_wans_expression(dtype: torch.dtype, affine: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchpatches.ops import modulate

    ran = []
    real = modulate._impl
    monkeypatch.setattr(modulate, "_impl", lambda *a, **k: ran.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 32, generator=g).to(dtype)
    table = torch.randn(2, 1, 64, generator=g)  # fp32: Wan's scale_shift_table + temb
    shift, scale = table.chunk(2, dim=-1)
    norm = FP32LayerNorm(32, eps=1e-6, elementwise_affine=affine)
    with torch.no_grad(), force_tier("torch"):
        got = modulated_once(norm, FP32LayerNorm, x, scale, shift)
    assert got.dtype == dtype and torch.equal(got, _wan(norm, x, scale, shift))
    assert len(ran) == (0 if affine else 1)
