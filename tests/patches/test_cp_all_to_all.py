"""``cp_all_to_all``: diffusers' Ulysses ``_all_to_all_single`` through c10d, the same values as the functional path.

In this process, a one-rank gloo group (the exchange is then the identity, and the original returns the same):
the direct path's output equals the original's bit for bit (contiguous and transposed inputs, three dtypes; an
input that requires grad under ``no_grad``, as inside diffusers' ``autograd.Function``) and calls no functional
collective; the cases the patch hands back to diffusers (autograd recording, forward AD, a tensor subclass, a group
given by name, Dynamo -- also a real ``fullgraph`` trace --, a strided 1-D view, complex, a dispatch mode, a
``torch.device`` context) reach the functional collective; the predicate refuses empty and unevenly split tensors
and, on a GPU, CUDA-graph capture; revert puts back the object the registry found. Two ranks
exchanging real shards inside FLUX.1 / FLUX.2 run in ``test_fused_context_parallel.py``.
"""
from __future__ import annotations

from typing import Any, List

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

import torch.distributed._functional_collectives as funcol  # noqa: E402

import torchpatches  # noqa: E402

from _collectives import PassThrough, Sub, counted_calls  # noqa: E402
from torchpatches._core.slot import MARK_ORIGINAL  # noqa: E402
from torchpatches.patches._bodies import cp_all_to_all  # noqa: E402


@pytest.fixture
def dispatch() -> Any:
    torchpatches.apply(["cp_all_to_all"])
    from diffusers.models import attention_dispatch

    return attention_dispatch


@pytest.fixture
def functional_calls(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """One entry per ``funcol.all_to_all_single`` call (what diffusers' own ``_all_to_all_single`` makes)."""
    return counted_calls(monkeypatch, funcol, "all_to_all_single")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_direct_path_equals_the_functional_one(group: Any, dispatch: Any, functional_calls: List[int],
                                               dtype: torch.dtype, layout: str) -> None:
    x = (torch.randn(2, 3, 4, 5) * 100).to(dtype)
    if layout == "transposed":
        x = x.transpose(1, 2)
    with torchpatches.disabled("cp_all_to_all"):
        expected = dispatch._all_to_all_single(x, group)
    assert len(functional_calls) == 1
    got = dispatch._all_to_all_single(x, group)
    assert len(functional_calls) == 1  # the patched call made c10d's collective, not the functional one
    assert type(got) is torch.Tensor and got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got, expected) and got.data_ptr() != x.data_ptr()


def test_an_input_that_requires_grad_under_no_grad_takes_the_direct_path(group: Any, dispatch: Any,
                                                                        functional_calls: List[int]) -> None:
    """What diffusers' Ulysses ``autograd.Function`` passes in training: grad is off inside its forward/backward."""
    x = torch.randn(4, 6, requires_grad=True)
    with torch.no_grad():
        got = dispatch._all_to_all_single(x, group)
    assert functional_calls == [] and torch.equal(got, x) and not got.requires_grad


def test_dynamo_traces_the_functional_collective_in_one_graph(group: Any, dispatch: Any) -> None:
    """Under torch.compile the replacement hands Dynamo diffusers' own code: one graph, no break, same values."""
    import torch._dynamo

    torch._dynamo.reset()
    x = torch.randn(4, 6)
    compiled = torch.compile(lambda t: dispatch._all_to_all_single(t, group) * 2, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x * 2)
    torch._dynamo.reset()


@pytest.mark.parametrize("case", ["grad", "forward AD", "subclass", "group by name", "compiling", "strided 1-D",
                                  "complex", "dispatch mode", "default device"])
def test_the_original_runs_for_what_the_direct_path_does_not_cover(group: Any, dispatch: Any,
                                                                   functional_calls: List[int],
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   case: str) -> None:
    x = torch.randn(4, 6)
    by = group
    if case == "grad":
        x.requires_grad_(True)
    elif case == "subclass":
        x = x.as_subclass(Sub)
    elif case == "group by name":
        by = group.group_name
    elif case == "compiling":  # what Dynamo's constant-folded check reads while it traces
        monkeypatch.setattr(cp_all_to_all, "is_compiling", lambda: True)
    elif case == "strided 1-D":  # flattening it is a view, not a copy: no contiguous buffer to send
        x = torch.randn(48)[::2]
    if case == "forward AD":
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            dispatch._all_to_all_single(x, by)
    elif case == "subclass":  # the functional collective's own answer to a plain subclass
        with pytest.raises(RuntimeError, match="subclass Sub"):
            dispatch._all_to_all_single(x, by)
    elif case == "complex":  # the functional collective refuses it; c10d would send it as real pairs
        with pytest.raises(RuntimeError):
            dispatch._all_to_all_single(torch.randn(4, 6, dtype=torch.complex64), by)
    elif case == "dispatch mode":
        with PassThrough():
            dispatch._all_to_all_single(x, by)
    elif case == "default device":  # torch.device as a context is a torch-function mode (set_default_device's)
        with torch.device("cpu"):
            dispatch._all_to_all_single(x, by)
    elif case == "strided 1-D":  # c10d's would refuse it ("Tensors must be contiguous"); the functional path's answer
        # depends on torch's release (2.13 sends it, 2.11 refuses it): the patched call gives that same answer
        with torchpatches.disabled("cp_all_to_all"):
            expected = _outcome(lambda: dispatch._all_to_all_single(x, by))
        functional_calls.clear()
        assert _outcome(lambda: dispatch._all_to_all_single(x, by)) == expected
    else:
        dispatch._all_to_all_single(x, by)
    assert len(functional_calls) == 1, case


def _outcome(call: Any) -> Any:
    """("value", the result as a list) or ("error", its type and message)."""
    try:
        return "value", call().tolist()
    except Exception as error:  # noqa: BLE001 (the error is the outcome)
        return "error", type(error).__name__, str(error)


class FakeGroup:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("numel, ranks, direct", [(24, 4, True), (24, 5, False), (0, 2, False)])
def test_only_an_even_nonempty_split_takes_the_direct_path(numel: int, ranks: int, direct: bool) -> None:
    assert cp_all_to_all._direct_fits(torch.zeros(numel), FakeGroup(ranks), FakeGroup) is direct


def test_revert_puts_the_original_back(dispatch: Any) -> None:
    patched = dispatch._all_to_all_single
    original = getattr(patched, MARK_ORIGINAL)  # what the registry found in diffusers' module
    assert original is not patched and original.__code__.co_filename.endswith("attention_dispatch.py")
    torchpatches.revert("cp_all_to_all")
    try:
        assert dispatch._all_to_all_single is original
    finally:
        torchpatches.apply(["cp_all_to_all"])
    assert dispatch._all_to_all_single is patched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
def test_the_predicate_refuses_cuda_graph_capture() -> None:
    """While a CUDA graph is captured the original runs (a graph of c10d's collective held the host at replay)."""
    x = torch.ones(8, device="cuda")
    assert cp_all_to_all._direct_fits(x, FakeGroup(2), FakeGroup)
    graph, seen = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        seen.append(cp_all_to_all._direct_fits(x, FakeGroup(2), FakeGroup))
        x.add_(1)
    assert seen == [False]
