"""``cp_ulysses_qkv``: diffusers' Ulysses attention exchanges q, k and v in one all-to-all, with the original's values.

Two ranks in two threads of this process, exchanging through a stand-in for diffusers' ``_all_to_all_single``
(each rank receives chunk r of every rank's flattened tensor, as the collective delivers it): batch 1 and 2, 4 local
heads of 8, two dtypes, with and without the log-sum-exp. On each rank the attention op receives the q, k and v the
original forward gives it, bit for bit and laid out alike (contiguous ``[B, S, H_LOCAL, D]``), the output equals the
original's, and the forward makes 2 exchanges (3 with the log-sum-exp) instead of 4 (5). What the patch hands back to
diffusers' forward (torch.compile -- also a real ``fullgraph`` trace --, forward AD, a dispatch mode, a tensor
subclass, a key length other than the query's, heads that do not split over the ranks) makes the original's
exchanges; revert puts back the registry's original (a ``staticmethod``). The tiny FLUX models under real two-rank
gloo context parallelism, and a training step through diffusers' backward, run in ``test_fused_context_parallel.py``.
"""
from __future__ import annotations

import threading
import types
from typing import Any, Dict, List, Tuple

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is needed", allow_module_level=True)

import torchpatches  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from torchpatches._slot import MARK_ORIGINAL  # noqa: E402
from torchpatches.patches import cp_ulysses_qkv  # noqa: E402


@pytest.fixture
def dispatch() -> Any:
    torchpatches.apply(["cp_ulysses_qkv"])
    from diffusers.models import attention_dispatch

    return attention_dispatch


class ThreadExchange:
    """``_all_to_all_single(x, group)`` for ``world`` ranks that are threads: rank r gets chunk r of each rank's
    flattened ``x``, in rank order (equal splits of dim 0, as ``all_to_all_single`` without split sizes)."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.calls = world, [None] * world, [0] * world
        self.barrier = threading.Barrier(world)
        self.rank = threading.local()

    def __call__(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        rank = self.rank.value
        self.calls[rank] += 1
        self.slots[rank] = x.contiguous()
        self.barrier.wait()
        out = torch.cat([slot.chunk(self.world)[rank] for slot in self.slots])
        self.barrier.wait()  # every rank has read the slots before any rank writes its next tensor
        return out.view(x.shape)


def _config(world: int) -> Any:
    """The part of diffusers' ``ParallelConfig`` Ulysses' forward reads."""
    cp = types.SimpleNamespace(_ulysses_mesh=types.SimpleNamespace(get_group=lambda: "group"), ulysses_degree=world)
    return types.SimpleNamespace(context_parallel_config=cp)


def _recording_attention(seen: List[Tuple[torch.Tensor, ...]]) -> Any:
    """A forward op of diffusers' template ([B, S, H, D] in and out, log-sum-exp [B, S, H]) that keeps its inputs."""

    def forward_op(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                   dropout_p: float, is_causal: bool, scale: Any, enable_gqa: bool, return_lse: bool,
                   _save_ctx: bool = True, _parallel_config: Any = None) -> Any:
        seen.append((query.clone(), key.clone(), value.clone(),
                     query.is_contiguous(), key.is_contiguous(), value.is_contiguous()))
        q, k, v = (x.transpose(1, 2).float() for x in (query, key, value))
        weights = (q @ k.transpose(-1, -2)).mul(q.shape[-1] ** -0.5)
        out = (weights.softmax(-1) @ v).transpose(1, 2).to(query.dtype)
        lse = weights.logsumexp(-1).transpose(1, 2).contiguous()
        return (out, lse) if return_lse else out

    return forward_op


def _inputs(rank: int, batch: int, dtype: torch.dtype, heads: int = 8, tokens: int = 3,
            kv_tokens: int = 3) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    q = torch.randn(batch, tokens, heads, 4, generator=generator).to(dtype)
    k, v = (torch.randn(batch, kv_tokens, heads, 4, generator=generator).to(dtype) for _ in range(2))
    return [q, k, v]


def _run_ranks(dispatch: Any, exchange: ThreadExchange, inputs: List[List[torch.Tensor]],
               return_lse: bool) -> Dict[int, Any]:
    """Each rank's (output, what its attention op saw), the ranks running together in threads."""
    results: Dict[int, Any] = {}
    errors: List[BaseException] = []

    def rank_main(rank: int) -> None:
        exchange.rank.value = rank
        seen: List[Tuple[torch.Tensor, ...]] = []
        try:
            out = dispatch.TemplatedUlyssesAttention.apply(
                *inputs[rank], None, 0.0, False, None, False, return_lse, _recording_attention(seen), None,
                _config(exchange.world))
            results[rank] = (out, seen)
        except BaseException as error:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(error)
            exchange.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(exchange.world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2])
def test_one_exchange_gives_the_attention_the_original_inputs(dispatch: Any, monkeypatch: pytest.MonkeyPatch,
                                                              batch: int, dtype: torch.dtype,
                                                              return_lse: bool) -> None:
    inputs = [_inputs(rank, batch, dtype) for rank in range(2)]
    runs = []
    for patched in (False, True):
        exchange = ThreadExchange(2)
        monkeypatch.setattr(dispatch, "_all_to_all_single", exchange)
        if patched:
            runs.append((_run_ranks(dispatch, exchange, inputs, return_lse), exchange.calls))
        else:
            with torchpatches.disabled("cp_ulysses_qkv"):
                runs.append((_run_ranks(dispatch, exchange, inputs, return_lse), exchange.calls))
    (original, original_calls), (got, calls) = runs
    assert original_calls == [5 if return_lse else 4] * 2 and calls == [3 if return_lse else 2] * 2
    for rank in range(2):
        (out0, seen0), (out1, seen1) = original[rank], got[rank]
        assert len(seen0) == len(seen1) == 1
        for a, b in zip(seen0[0][:3], seen1[0][:3]):
            assert a.shape == b.shape == (batch, 6, 4, 4) and torch.equal(a, b), rank
        assert seen1[0][3:] == seen0[0][3:] == (True, True, True)  # contiguous, as diffusers' copies are
        for a, b in zip(out0 if return_lse else (out0,), out1 if return_lse else (out1,)):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), rank


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class Sub(torch.Tensor):
    pass


class CountingIdentity:
    """One rank's exchange (the identity), counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        self.calls += 1
        return x.clone()


@pytest.mark.parametrize("case", ["compiling", "forward AD", "dispatch mode", "subclass", "key length",
                                  "uneven heads"])
def test_the_original_forward_runs_for_what_one_exchange_does_not_cover(dispatch: Any,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        case: str) -> None:
    exchange = CountingIdentity()
    monkeypatch.setattr(dispatch, "_all_to_all_single", exchange)
    world, q, k, v = 1, *_inputs(0, 2, torch.float32)
    if case == "compiling":  # what Dynamo's constant-folded check reads while it traces
        monkeypatch.setattr(cp_ulysses_qkv, "is_compiling", lambda: True)
    elif case == "subclass":
        k = k.as_subclass(Sub)
    elif case == "key length":  # cross-attention: the key has other tokens than the query
        k, v = (torch.randn(2, 5, 8, 4) for _ in range(2))
    elif case == "uneven heads":  # 8 heads over 3 ranks: diffusers' reshape says so
        world = 3

    def call() -> Any:
        return dispatch.TemplatedUlyssesAttention.apply(q, k, v, None, 0.0, False, None, False, False,
                                                        _recording_attention([]), None, _config(world))

    if case == "forward AD":
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            call()
    elif case == "dispatch mode":
        with PassThrough():
            call()
    elif case == "uneven heads":
        with pytest.raises(RuntimeError, match="shape"):
            call()
        assert exchange.calls == 0
        return
    else:
        call()
    assert exchange.calls == 4, case  # q, k, v and the output, each on its own


def test_dynamo_traces_the_original_in_one_graph(dispatch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile the replacement hands Dynamo diffusers' own forward: one graph, no break, same values."""
    import torch._dynamo

    monkeypatch.setattr(dispatch, "_all_to_all_single", lambda x, group: x.clone())
    q, k, v = _inputs(0, 2, torch.float32)
    config, op = _config(1), _recording_attention([])

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return dispatch.TemplatedUlyssesAttention.apply(q, k, v, None, 0.0, False, None, False, False, op, None,
                                                        config)

    expected = call(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(call, backend="eager", fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(got, expected)


def test_revert_puts_the_original_staticmethod_back(dispatch: Any) -> None:
    ulysses = dispatch.TemplatedUlyssesAttention
    patched = ulysses.__dict__["forward"]
    original = getattr(patched, MARK_ORIGINAL)  # what the registry found in diffusers' class
    assert isinstance(patched, staticmethod) and isinstance(original, staticmethod) and original is not patched
    assert original.__func__.__code__.co_filename.endswith("attention_dispatch.py")
    torchpatches.revert("cp_ulysses_qkv")
    try:
        assert ulysses.__dict__["forward"] is original
    finally:
        torchpatches.apply(["cp_ulysses_qkv"])
    assert ulysses.__dict__["forward"] is patched
