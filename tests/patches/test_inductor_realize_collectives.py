"""inductor_realize where vLLM reverted its byte rule: compiled tensor-parallel and sequence-parallel stretches.

vLLM's backport (vllm-project/vllm#42686) was reverted (#42913) after its AsyncTP and sequence-parallel
correctness tests failed: two compiled servers, one full graph with the SP / AsyncTP passes and one split at
attention, had to sample string-identical tokens from random bf16 weights. The programs below are those stretches
(a row-parallel GEMM's all-reduce, or a reduce-scatter, into a residual add that several consumers read, an
RMSNorm, an all-gather), compiled with Inductor on one gloo rank, with the patch and without:

- the collectives and their waits are the same ops in the same order (a realize decision is made at lowering, on
  pointwise values; a collective is an extern kernel it never recomputes);
- fp32 outputs are bit-identical;
- bf16 outputs move by roundings, and toward eager: a realized residual is rounded to bf16 where eager rounds it,
  an inlined one is recomputed in fp32 in every consumer. That moving rounding point, which differs between a full
  graph and a split one, is what flips a sampled token on random weights.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, List, Tuple

import pytest
import torch

import torchpatches

pytestmark = [pytest.mark.inductor_realize, pytest.mark.slow]

NAME = "inductor_realize"


def _rms_norm(r: torch.Tensor) -> torch.Tensor:
    return r * torch.rsqrt(r.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(r.dtype)


def _tensor_parallel(group: Any) -> Callable[..., Tuple[torch.Tensor, ...]]:
    from torch.distributed import _functional_collectives as fc

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, residual: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        r = residual + fc.all_reduce(x @ w1, "sum", group)  # read by four consumers below
        return r + _rms_norm(r) @ w2, (r * 2).sum(-1), r.abs().amax(-1)

    return block


def _sequence_parallel(group: Any) -> Callable[..., Tuple[torch.Tensor, ...]]:
    from torch.distributed import _functional_collectives as fc

    def block(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        r = residual + fc.reduce_scatter_tensor(x @ w, "sum", 0, group)
        return fc.all_gather_tensor(_rms_norm(r), 0, group), r + 1, r.sigmoid()

    return block


PROGRAMS = {"tensor parallel": (_tensor_parallel, 4), "sequence parallel": (_sequence_parallel, 3)}


def _inputs(n: int, dtype: torch.dtype) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 128), (128, 128), (128, 128), (64, 128)] if n == 4 else [(64, 128), (128, 128), (64, 128)]
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def _compiled(fn: Callable[..., Any], args: List[torch.Tensor], patched: bool) -> Tuple[Tuple[torch.Tensor, ...], str]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    off = contextlib.nullcontext() if patched else torchpatches.disabled(NAME)
    with off, torch._inductor.config.patch(fx_graph_cache=False):
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(code)


def _collectives(code: str) -> List[str]:
    """The functional collectives and waits the generated code calls, in order (buffer names left out)."""
    return re.findall(r"torch\.ops\._c10d_functional\.(\w+)\.default\(", code)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_collectives_kept_outputs_toward_eager(group: Any, program: str, dtype: torch.dtype) -> None:
    import torch._inductor.ir  # noqa: F401 - the target's module: the patch is pending until Inductor loads

    if torchpatches.status()[NAME].state.value != "applied":
        pytest.skip(f"{NAME} does not apply on torch {torch.__version__}: {torchpatches.status()[NAME].reason}")
    make, n = PROGRAMS[program]
    fn, args = make(group), _inputs(n, dtype)
    plain_out, plain_code = _compiled(fn, args, patched=False)
    out, code = _compiled(fn, args, patched=True)
    assert code != plain_code, "the patch changed no decision here: the test would prove nothing"
    assert _collectives(code) == _collectives(plain_code) and _collectives(code), _collectives(code)
    if dtype == torch.float32:
        assert all(torch.equal(a, b) for a, b in zip(out, plain_out))
        return
    eager = fn(*args)
    off_by = [int((o != e).sum()) for o, e in zip(out, eager)]
    plain_off_by = [int((o != e).sum()) for o, e in zip(plain_out, eager)]
    assert all(a <= b for a, b in zip(off_by, plain_off_by)), (off_by, plain_off_by)
    for a, b in zip(out, plain_out):  # roundings, not another computation: within 2 ulp of each output's largest value
        assert float((a.float() - b.float()).abs().max()) <= 2 * torch.finfo(dtype).eps * float(b.float().abs().max())
