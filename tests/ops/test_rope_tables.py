"""``ops.rope_tables``: FLUX's rotary tables in one launch, against diffusers' own ``FluxPosEmbed`` /
``Flux2PosEmbed`` (every patch reverted) on drawn position ids, axes and thetas.

On the CPU the Triton tier runs in the interpreter (numpy's fp64 cos / sin against torch's): within one fp32 ulp.
With ``TORCHPATCHES_TEST_DEVICE=cuda`` the compiled kernel (libdevice, as torch's fp64 kernels) must give diffusers'
bits. The PyTorch tier is diffusers' code: bit for bit everywhere.
"""
from __future__ import annotations

import os
from typing import Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import HAS_TRITON, hyp, needs_triton
from torchpatches.ops import _rope_tables as rt
from torchpatches.ops import force_tier

diffusers = pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from diffusers.models.transformers import transformer_flux, transformer_flux2  # noqa: E402

DEVICE = torch.device(os.environ.get("TORCHPATCHES_TEST_DEVICE", "cpu"))


def diffusers_tables(ids: torch.Tensor, axes: Tuple[int, ...], theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """diffusers' own embedder (FLUX.2's reads the first ``len(axes)`` columns; FLUX.1's wants one per axis)."""
    cls = transformer_flux.FluxPosEmbed if ids.shape[1] == len(axes) else transformer_flux2.Flux2PosEmbed
    with torchpatches.disabled("rope_tables"):
        return cls(theta, list(axes))(ids)


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 units in the last place (same-sign values; the tables' zeros are +0)."""
    if a.numel() == 0:
        return 0
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


@st.composite
def cases(draw):
    axes = tuple(draw(st.lists(st.sampled_from([2, 4, 8, 16, 32, 56, 64]), min_size=1, max_size=4)))
    extra = draw(st.integers(0, 1))
    rows = draw(st.integers(0, 40))
    theta = draw(st.sampled_from([10000, 2000, 256.0, 7.5, 1e6]))
    # FLUX.1's pipeline passes the latents' float dtype, FLUX.2's int64 (cartesian_prod of aranges)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                  torch.int32]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4097, (rows, len(axes) + extra), generator=g).float()
    if dtype.is_floating_point and draw(st.booleans()):  # positions off the grid: any float
        ids = ids * torch.rand(ids.shape, generator=g) - 100
    ids = ids.to(dtype)
    if draw(st.booleans()):  # a strided view: columns of a transposed buffer
        ids = ids.t().contiguous().t()
    return ids.to(DEVICE), axes, theta


@needs_triton
@settings(**hyp(15))
@given(cases())
def test_triton_tier_gives_diffusers_tables(case) -> None:
    ids, axes, theta = case
    ref = diffusers_tables(ids, axes, theta)
    with force_tier("triton"):
        got = rt.rope_tables(ids, axes, theta)
    allowed = 0 if DEVICE.type == "cuda" else 1
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == torch.float32 and g.is_contiguous()
        assert ulp_diff(g, r) <= allowed


@settings(**hyp(15))
@given(cases())
def test_torch_tier_is_diffusers_code(case) -> None:
    ids, axes, theta = case
    ref = diffusers_tables(ids, axes, theta)
    with force_tier("torch"):
        got = rt.rope_tables(ids, axes, theta)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


@needs_triton
def test_production_shapes_are_exact() -> None:
    """FLUX.1-dev's and FLUX.2's tables at 1024x1024 (4096 image + 512 text positions): every bit, both tiers
    (on the CPU the interpreter's numpy cos / sin happen to agree here too)."""
    grid = torch.zeros(64, 64, 3)
    grid[..., 1] = torch.arange(64)[:, None]
    grid[..., 2] = torch.arange(64)[None, :]
    ids = torch.cat([torch.zeros(512, 3), grid.reshape(-1, 3)]).to(DEVICE)
    flux2 = torch.cat([ids, ids[:, :1]], 1).long()  # Flux2Pipeline's int64 ids
    for axes, theta, cols in (((16, 56, 56), 10000, ids), ((32, 32, 32, 32), 2000, flux2)):
        ref = diffusers_tables(cols, axes, theta)
        for tier in ("torch", "triton"):
            with force_tier(tier):
                got = rt.rope_tables(cols, axes, theta)
            assert all(torch.equal(g, r) for g, r in zip(got, ref)), (axes, tier)


def test_frequencies_are_kept_per_theta_and_axes() -> None:
    ids = torch.arange(12.0, device=DEVICE).reshape(4, 3)
    with force_tier("triton" if HAS_TRITON else "torch"):
        a = rt.rope_tables(ids, (4, 4, 2), 100.0)
        b = rt.rope_tables(ids, (4, 4, 2), 10.0)
        c = rt.rope_tables(ids, (2, 4, 4), 100.0)
    assert torch.equal(a[0], diffusers_tables(ids, (4, 4, 2), 100.0)[0])
    assert torch.equal(b[0], diffusers_tables(ids, (4, 4, 2), 10.0)[0])
    assert torch.equal(c[1], diffusers_tables(ids, (2, 4, 4), 100.0)[1])


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(4), (2,), 10.0), "2-D"),
    ((torch.zeros(4, 2, dtype=torch.bool), (2,), 10.0), "dtype"),
    ((torch.zeros(4, 2, dtype=torch.complex64), (2,), 10.0), "dtype"),
    ((torch.zeros(4, 2), (3,), 10.0), "even"),
    ((torch.zeros(4, 2), (0,), 10.0), "even"),
    ((torch.zeros(4, 2), (), 10.0), "even"),
    ((torch.zeros(4, 2), (2.0,), 10.0), "even"),
    ((torch.zeros(4, 2), 2, 10.0), "sequence"),
    ((torch.zeros(4, 2), (2, 2, 2), 10.0), "columns"),
    ((torch.zeros(4, 2), (2,), 0.0), "theta"),
    ((torch.zeros(4, 2), (2,), True), "theta"),
    (("ids", (2,), 10.0), "ids"),
])
def test_bad_input_raises_value_error_naming_it(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        rt.rope_tables(*args)


def test_gradient_through_the_positions() -> None:
    """Positions that require grad take diffusers' code (autograd records it); a forced kernel tier refuses."""
    ids = torch.tensor([[0.0, 1.5], [2.0, 3.0]], requires_grad=True)
    cos, sin = rt.rope_tables(ids, (2, 4), 10.0)
    (cos.sum() + sin.sum()).backward()
    ref_ids = ids.detach().clone().requires_grad_(True)
    ref = diffusers_tables(ref_ids, (2, 4), 10.0)
    (ref[0].sum() + ref[1].sum()).backward()
    assert torch.equal(ids.grad, ref_ids.grad)
    if HAS_TRITON:
        with pytest.raises(ValueError):
            rt.rope_tables(ids, (2, 4), 10.0, tier="triton")


def test_traced_as_one_custom_op() -> None:
    """Under torch.compile (fullgraph, aot_eager: the fake runs, no Inductor compile) the op is one node."""
    ids = torch.arange(24.0).reshape(8, 3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: rt.rope_tables(t, (4, 4, 2), 100.0), fullgraph=True, backend="aot_eager")
    got = compiled(ids)
    ref = diffusers_tables(ids, (4, 4, 2), 100.0)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
