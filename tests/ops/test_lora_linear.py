"""``torchpatches.ops.lora_linear``: the GEMM-epilogue tier against peft's op order (the torch tier).

fp32 bit-identical where every scaling is a power of two (``s * acc`` exact, so an FMA of ``alpha * acc + C``
or an ``alpha`` applied to the packed operand changes nothing), within the GEMM's own error bound otherwise;
the GELU is the tanh form on the CPU too (``_addmm_activation`` would be the erf one there); calls autograd
records get the torch tier. The whole-layer cases and half-precision ulps are in ``tests/patches/test_lora.py``
(with peft).
"""
from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn.functional as F

from torchpatches.ops._lora import lora_linear


def make(shape_x, n_out: int, ranks: List[int], scalings, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape_x, generator=g)
    k = shape_x[-1]
    weight, bias = torch.randn(n_out, k, generator=g), torch.randn(n_out, generator=g)
    adapters = [(torch.randn(r, k, generator=g), torch.randn(n_out, r, generator=g), s)
                for r, s in zip(ranks, scalings)]
    return x, weight, bias, adapters


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("shape_x", [(2, 7, 24), (5, 24), (24,), (0, 24)])
def test_epilogue_bit_identical_to_peft_order_for_power_of_two_scalings(shape_x, gelu: bool) -> None:
    x, weight, bias, adapters = make(shape_x, 40, [4, 3], [2.0, 0.5])
    with torch.no_grad():
        out = lora_linear(x, weight, bias, adapters, gelu=gelu, tier="epilogue")
        ref = lora_linear(x, weight, bias, adapters, gelu=gelu, tier="torch")
    manual = F.linear(x, weight, bias)
    for a, b, s in adapters:
        manual = manual + F.linear(F.linear(x, a), b) * s
    assert torch.equal(ref, F.gelu(manual, approximate="tanh") if gelu else manual)
    assert out.shape == ref.shape and torch.equal(out, ref)


def test_other_scalings_within_the_gemm_error_and_cpu_tensor_scaling() -> None:
    x, weight, bias, adapters = make((64, 32), 48, [8], [0.3])
    with torch.no_grad():
        out = lora_linear(x, weight, bias, adapters, tier="epilogue")
        ref = lora_linear(x, weight, bias, adapters, tier="torch")
        as_tensor = lora_linear(x, weight, bias, [(adapters[0][0], adapters[0][1], torch.tensor(0.3))], tier="epilogue")
    assert torch.equal(as_tensor, out)  # a 0-d CPU tensor is read as the number
    # The GEMM may apply alpha before it accumulates (MKL scales the packed panel): both are sums of the same
    # products rounded in another order, so they agree within the GEMM's own error bound,
    # (rank + 2) * u * (|C| + s * |t| @ |B|.T), u = 2**-24 (measured on
    # this CPU: 2.8 - 5.1 units over 5 seeds and two shapes).
    t = F.linear(x, adapters[0][0])
    magnitude = F.linear(x, weight, bias).abs() + 0.3 * F.linear(t.abs(), adapters[0][1].abs())
    units = ((out - ref).abs() / (magnitude * 2.0**-24)).max()
    assert units <= 8 + 2, units


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_zero_with_non_finite_weights_is_peft_order(dtype: torch.dtype) -> None:
    """peft's ``result + lora_B(t) * 0`` is NaN where ``lora_B(t)`` is inf or NaN; a GEMM with ``alpha=0`` may not
    compute its product at all (MKL's fp32 GEMM does not), so a scaling of 0 takes peft's order: bit-identical,
    NaN positions included. A nonzero scaling gives the same NaN and inf positions through the GEMM."""
    x, weight, bias, adapters = make((2, 3, 16), 8, [2, 3], [1.0, 1.0])
    x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    (a1, b1, _), (a2, b2, _) = [(a.to(dtype), b.to(dtype), s) for a, b, s in adapters]
    b1[2, 0], b1[5, 1], a2[0, 3] = float("inf"), float("nan"), float("nan")
    for s1, s2 in ((0.0, 1.0), (0, 0.5), (torch.tensor(0.0), 1.0), (1.5, 0.0), (1.25, 2.0)):
        for gelu in (False, True):
            both = [(a1, b1, s1), (a2, b2, s2)]
            first = [(a1, b1, s1)]  # lora_B output not finite in columns 2 and 5 only
            for chosen in (first, both):
                with torch.no_grad():
                    out = lora_linear(x, weight, bias, chosen, gelu=gelu, tier="epilogue")
                    ref = lora_linear(x, weight, bias, chosen, gelu=gelu, tier="torch")
                assert ref.isnan().any()
                assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf()), (s1, s2)
                if chosen is first and float(s1) == 0:  # peft's order itself
                    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def test_grad_gets_the_torch_tier_and_the_epilogue_tier_refuses_it() -> None:
    x, weight, bias, adapters = make((3, 16), 8, [2], [1.0])
    a = adapters[0][0].requires_grad_(True)
    out = lora_linear(x, weight, bias, adapters)
    out.sum().backward()
    assert a.grad is not None
    with pytest.raises(ValueError, match="epilogue"):
        lora_linear(x, weight, bias, adapters, tier="epilogue")


def test_argument_errors_name_the_argument() -> None:
    x, weight, bias, adapters = make((3, 16), 8, [2], [1.0])
    with pytest.raises(ValueError, match="unknown tier"):
        lora_linear(x, weight, bias, adapters, tier="cuda")
    with pytest.raises(ValueError, match=r"adapters\[0\] B"):
        lora_linear(x, weight, bias, [(adapters[0][0], [1.0], 1.0)])
    with pytest.raises(ValueError, match=r"adapters\[0\] scaling"):
        lora_linear(x, weight, bias, [(adapters[0][0], adapters[0][1], "2")])
