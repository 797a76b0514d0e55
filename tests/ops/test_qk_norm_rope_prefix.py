"""torchpatches.ops qk_norm_rope's ``k_prefix`` (``prechecked`` only): the returned k is
``torch.cat([k_prefix, k], dim=1)`` (QwenImage 2.1's KV cache: the prompt's keys, cached normalized and rotated),
the kernel writing k's rows behind the prefix's copy. Both tiers give exactly what they give without the prefix,
concatenated; q is untouched by it.
"""
from __future__ import annotations

import pytest
import torch

from _fused_checks import DTYPES, needs_triton
from torchpatches.ops._qk_norm_rope import force_tier, prechecked


def _case(B: int, S: int, P: int, H: int, D: int, dtype: torch.dtype, rope: bool):
    g = torch.Generator().manual_seed(B * 100 + S)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    qkv = rnd(B, S, 3, H * D)  # views of one projection: strided q and k, as the fused ones
    q, k = (qkv[:, :, i].unflatten(-1, (H, D)) for i in range(2))
    tables = (None, None)
    if rope:
        angles = torch.rand(S, D // 2, generator=g) * 6.0
        tables = tuple(t.repeat_interleave(2, dim=-1) for t in (angles.cos(), angles.sin()))
    return q, k, tables, 1 + 0.3 * rnd(D), 1 + 0.3 * rnd(D), rnd(B, P, H, D)


@pytest.mark.parametrize("tier", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_k_behind_the_prefix_is_the_cat(dtype: torch.dtype, B: int, rope: bool, tier: str) -> None:
    q, k, tables, wq, wk, prefix = _case(B, 5, 3, 2, 16, dtype, rope)
    with force_tier(tier):
        q1, k1, _ = prechecked(q, k, *tables, wq, wk, (1e-6, 1e-5, 0.0, 0.0), rounding="each", k_prefix=prefix)
        q0, k0, _ = prechecked(q, k, *tables, wq, wk, (1e-6, 1e-5, 0.0, 0.0), rounding="each")
    assert torch.equal(q1, q0) and k1.is_contiguous()
    assert torch.equal(k1, torch.cat([prefix, k0], dim=1))
