"""``_triton_common._round_to``: the fused kernels' rounding to bf16 / fp16 is torch's own, bit for bit.

Compiled kernels round with a cast, the CPU interpreter's kernels with integer arithmetic (the
interpreter's cast truncates); both must equal ``tensor.to(dtype)`` -- round to nearest, ties to even,
NaN kept, overflow to inf, subnormals kept -- on every fp32 bit pattern class. The CUDA case runs
where a GPU is visible.
"""
from __future__ import annotations

import pytest
import torch

from _fused_checks import HAS_TRITON, needs_triton

pytestmark = [needs_triton, pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")]

if HAS_TRITON:
    import triton.language as tl

    from torchpatches.ops._runtime import triton_common as _triton_common
    from torchpatches.ops._runtime.triton_common import KINDS, _round_to

    def _round_kernel(x_ptr, o_ptr, N, BLOCK: tl.constexpr, KIND: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        x = tl.load(x_ptr + i, mask=m, other=0.0)
        tl.store(o_ptr + i, _round_to(x, KIND), mask=m)

    kernel_for = _triton_common.for_devices(_round_kernel)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def hard_values() -> torch.Tensor:
    """fp32 values where a rounding to 16 bits can go wrong, as fp32 bit patterns, plus random ones."""
    bits = [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00001,  # +-0, +-inf, NaNs
        0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x477FEFFF, 0x477FF000, 0x477FF001,  # fp32 / bf16 / fp16 overflow edges
        0x00000001, 0x00007FFF, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000,  # subnormals, ties among them
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000,  # ties to even, either side
        0x3F801000, 0x3F803000, 0x33800000, 0x33000000, 0x38800000, 0x387FE000,  # fp16 ties, fp16 subnormal edges
    ]
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-2**31, 2**31, (4096,), generator=g, dtype=torch.int64)
    fixed = torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits], dtype=torch.int64)
    ints = torch.cat([fixed, rand]).to(torch.int32)
    return ints.view(torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_is_torchs_rounding(device: str, dtype: torch.dtype) -> None:
    x = hard_values().to(device)
    if device == "cpu":  # the interpreter is slow: the fixed patterns and 256 random ones
        x = x[:287]
    out = torch.empty_like(x)
    block = 256
    kernel_for(device)[(-(-x.numel() // block),)](x, out, x.numel(), BLOCK=block, KIND=KINDS[dtype])
    ref = x.to(dtype).to(torch.float32)
    same = (out.view(torch.int32) == ref.view(torch.int32)) | (out.isnan() & ref.isnan())
    bad = (~same).nonzero().flatten()[:5].tolist()
    assert not bad, [(hex(int(x.view(torch.int32)[i]) & 0xFFFFFFFF), float(out[i]), float(ref[i])) for i in bad]


def test_interpreting_triton_gives_cuda_tensors_the_interpreters_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TRITON_INTERPRET=1 at triton's import, ``triton.jit`` interprets: a CUDA tensor must then get the
    interpreter's kernel (integer rounding), not the compiled kernel's cast, which the interpreter truncates."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setattr(triton, "jit", lambda fn: InterpretedFunction(fn))
    interpreting = _triton_common.for_devices(_round_kernel)
    assert interpreting("cuda") is interpreting.interpreted()
    assert kernel_for("cuda") is not kernel_for.interpreted()  # compiled where triton compiles
