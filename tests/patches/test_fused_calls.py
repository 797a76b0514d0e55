"""The fused call helpers the patches share (``patches/_modulate_calls``): they fuse through the op's ``prechecked``
entry, and give diffusers' expression (PyTorch tier forced on CPU: bit for bit)."""
from __future__ import annotations

import pytest
import torch

from torchpatches.ops._modulate import force_tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_helpers_fuse_through_prechecked_not_the_checked_entries(dtype: torch.dtype,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The helpers have checked what the public entries check, so they take ``prechecked`` (host time); the
    result is diffusers' expression (PyTorch tier forced: bit for bit)."""
    from torchpatches.ops import _modulate as modulate
    from torchpatches.patches import _modulate_calls as calls

    def checked_entry(*args, **kwargs):
        raise AssertionError("the checked entry ran")

    monkeypatch.setattr(modulate, "_run", checked_entry)
    g = torch.Generator().manual_seed(1)
    h, y = (torch.randn(2, 5, 16, generator=g).to(dtype) for _ in range(2))
    gate, scale, shift = (torch.randn(2, 16, generator=g).to(dtype) for _ in range(3))
    norm = torch.nn.LayerNorm(16, elementwise_affine=False, eps=1e-6)
    with torch.no_grad(), force_tier("torch"):
        out = calls.modulated(norm, h, scale, shift, fuse=True)
        res = calls.residual(h, gate, y, clip=False)
        both = calls.residual_modulated(norm, h, gate, y, scale, shift, fuse=True)
    want_res = h + gate[:, None] * y
    assert torch.equal(out, norm(h) * (1 + scale[:, None]) + shift[:, None])
    assert torch.equal(res, want_res)
    assert torch.equal(both[0], want_res)
    assert torch.equal(both[1], norm(want_res) * (1 + scale[:, None]) + shift[:, None])


def test_vectors_fit_refuses_what_prechecked_does_not_check() -> None:
    """Everything ``prechecked`` skips is refused here (then diffusers' expression runs)."""
    from torchpatches.patches._modulate_calls import _vectors_fit

    x, v = torch.randn(2, 5, 16), torch.randn(2, 16)
    assert _vectors_fit(x, v, v) and _vectors_fit(x, v[:, None], torch.randn(2, 5, 16))
    assert not _vectors_fit(x, v, None)  # a missing vector
    assert not _vectors_fit(x.to(torch.int32), v.to(torch.int32))  # not a served dtype
    assert not _vectors_fit(x[0], v)  # not [B, S, D]
    assert not _vectors_fit(x, v.double())  # another dtype
    assert _vectors_fit(x.bfloat16(), v, rounding="once")  # any float vector when computing in fp32
    assert not _vectors_fit(x, torch.randn(1, 16)) and not _vectors_fit(x, torch.randn(2, 3, 16))  # shapes
    assert not _vectors_fit(x, torch.nn.Parameter(v))  # a subclass
    assert not _vectors_fit(torch.nn.Parameter(x), v)
