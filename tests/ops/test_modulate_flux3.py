"""torchpatches.ops modulate family, FLUX.3's forms: ``residual + gate * (y + y2)`` (``y2``: the feed-forward output
beside the attention output) and the norm's output written into a given view (``norm_out``: the rows of the joint
buffer ``torch.cat`` would fill).

The PyTorch tier is FLUX.3's expression (bit for bit); the Triton tier (the interpreter on the CPU) rounds where it
rounds: the gated sum bit for bit, the LayerNorm output within one ulp (fp32 statistics in another order).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_checks import DTYPES, hyp, needs_triton, strided, ulps
from torchpatches.ops import _modulate as modulate
from torchpatches.ops._modulate import force_tier


@st.composite
def cases(draw: Any) -> Dict[str, Any]:
    B, S, D = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.sampled_from([1, 7, 16, 33]))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    # per-token vectors as FLUX.3 holds them: chunks of a [B, S, 3D] modulation (row stride 3D)
    shift, scale, gate = rnd(B, S, 3 * D).chunk(3, dim=-1)
    x = rnd(B, S, D, scale=4.0)
    y = rnd(B, S, D)
    if draw(st.booleans()):
        x, y = strided(x), strided(y)
    return dict(x=x, y=y, y2=rnd(B, S, D), gate=gate, scale=scale, shift=shift, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_tier_is_flux3s_expression(dtype: torch.dtype) -> None:
    """``hidden_states + mod_gate * (attn_output + ff_output)`` and ``(1 + mod_scale) * norm(x) + mod_shift``
    (diffusers 0.42.1 Flux3ModeTransformerBlock), the norm written into rows of a joint buffer."""
    g = torch.Generator().manual_seed(0)
    x, a, f = (torch.randn(2, 5, 24, generator=g).to(dtype) for _ in range(3))
    shift, scale, gate = torch.randn(2, 5, 72, generator=g).to(dtype).chunk(3, dim=-1)
    assert torch.equal(modulate.gate_residual(x, gate, a, y2=f, tier="torch"), x + gate * (a + f))
    norm = torch.nn.LayerNorm(24, elementwise_affine=False, eps=1e-6)
    joint = torch.full((2, 8, 24), float("nan"), dtype=dtype)
    with force_tier("torch"):
        out = modulate.prechecked(x, None, None, scale, shift, 1e-6, norm_out=joint[:, 3:])[0]
        h = modulate.prechecked(x, gate, a, None, None, None, y2=f)[0]
    assert out.data_ptr() == joint[:, 3:].data_ptr() and torch.equal(joint[:, 3:], (1 + scale) * norm(x) + shift)
    assert joint[:, :3].isnan().all() and torch.equal(h, x + gate * (a + f))


@needs_triton
@settings(**hyp(20))
@given(cases(), st.sampled_from(["each", "once"]))
def test_triton_tier_rounds_where_torch_does(case: Dict[str, Any], rounding: str) -> None:
    x, y, y2, gate, scale, shift = (case[k] for k in ("x", "y", "y2", "gate", "scale", "shift"))
    ref = modulate.gate_residual(x, gate, y, y2=y2, rounding=rounding, tier="torch")
    got = modulate.gate_residual(x, gate, y, y2=y2, rounding=rounding, tier="triton")
    assert torch.equal(got, ref) or ulps(got, ref) == 0.0
    B, S, D = x.shape
    joint = torch.full((B, S + 2, D), float("nan"), dtype=x.dtype)
    with force_tier("triton"):
        out = modulate.prechecked(x, None, None, scale, shift, 1e-6, norm_out=joint[:, 2:])[0]
    want = modulate.layer_norm_modulate(x, scale, shift, eps=1e-6, tier="torch")
    assert out.data_ptr() == joint[:, 2:].data_ptr() and joint[:, :2].isnan().all()
    limit = 8.0 if case["dtype"] == torch.float32 else 1.0
    assert ulps(joint[:, 2:], want, x.abs().amax(-1, keepdim=True) * 4 + 1) <= limit


def test_y2_must_match_y() -> None:
    x = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="y2"):
        modulate.gate_residual(x, torch.randn(1, 4), x, y2=torch.randn(1, 3, 4), tier="torch")
    with pytest.raises(ValueError, match="y2"):
        modulate.gate_residual(x, torch.randn(1, 4), x, y2=x.double(), tier="torch")


@needs_triton
def test_y2_compiles_fullgraph_as_a_custom_op() -> None:
    x, g, y, y2 = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)

    def fn(x, g, y, y2):
        return modulate.gate_residual(x, g, y, y2=y2, tier="torch")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, g, y, y2), fn(x, g, y, y2), rtol=0, atol=0)
    torch._dynamo.reset()
