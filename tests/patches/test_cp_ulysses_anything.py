"""``cp_ulysses_anything``: diffusers' uneven-shard Ulysses attention with one length exchange per attention call.

Two and three ranks run as threads of this process (``Ranks``): the collectives diffusers' and the patch's code call
(c10d's and the functional all-to-all with split sizes, the list all-gather of a mask, the gather of lengths) meet
at a barrier and give each rank what the real ones would. On every rank the patched forward's output (and
log-sum-exp) equals the original's bit for bit -- unequal lengths, queries and keys of different lengths, heads the
ranks cannot split evenly (diffusers pads them), a key mask, fp32 and bf16 -- while it exchanges the lengths once per
call where the original did four to six times, and its all-to-alls go through c10d. What it hands back (compiling,
a tensor subclass) runs the original. Two real gloo ranks inside tiny FLUX.1 / FLUX.2 / QwenImage (with its text
mask) run in ``test_fused_context_parallel.py``.
"""
from __future__ import annotations

import collections
import threading
import types
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is needed", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

import torchpatches  # noqa: E402

from _collectives import Sub  # noqa: E402
from torchpatches._core.slot import MARK_ORIGINAL  # noqa: E402
from torchpatches.patches import _direct_collectives  # noqa: E402
from torchpatches.patches._bodies import cp_ulysses_anything  # noqa: E402


class Group:
    """What the patch and diffusers read of a process group here: its size (``dist.ProcessGroup`` is this class)."""

    def __init__(self, size: int) -> None:
        self.ranks = size

    def size(self) -> int:
        return self.ranks


class Ranks:
    """``n`` ranks as threads; each collective is every rank's contribution swapped at a barrier."""

    def __init__(self, n: int) -> None:
        self.n, self.group = n, Group(n)
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: List[Any] = [None] * n
        self.local = threading.local()
        self.calls: Dict[str, int] = collections.Counter()
        self.lock = threading.Lock()

    def rank(self) -> int:
        return self.local.rank

    def count(self, what: str) -> None:
        with self.lock:
            self.calls[what] += 1

    def everyone(self, mine: Any, collective: str) -> List[Any]:
        """Every rank's ``mine``; every rank must be in the same collective (else the real ones would hang)."""
        self.slots[self.rank()] = (collective, mine)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        assert {name for name, _ in got} == {collective}, f"ranks in different collectives: {got}"
        return [value for _, value in got]

    def exchanged(self, x: torch.Tensor, output_split_sizes: List[int], input_split_sizes: List[int]) -> torch.Tensor:
        everyone = self.everyone((x, input_split_sizes), "all_to_all")
        parts = [src.split(splits)[self.rank()] for src, splits in everyone]
        assert [p.shape[0] for p in parts] == list(output_split_sizes)  # the splits every rank gave agree
        return torch.cat(parts)

    # the collectives, as the code under test calls them
    def c10d_all_to_all(self, out: torch.Tensor, x: torch.Tensor, output_split_sizes: List[int],
                        input_split_sizes: List[int], group: Any = None) -> None:
        self.count("c10d all_to_all")
        out.copy_(self.exchanged(x, output_split_sizes, input_split_sizes))

    def functional_all_to_all(self, x: torch.Tensor, output_split_sizes: List[int], input_split_sizes: List[int],
                              group: Any) -> torch.Tensor:
        self.count("functional all_to_all")
        return self.exchanged(x, output_split_sizes, input_split_sizes)

    def all_gather(self, tensors: List[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
        self.count("all_gather")
        for out, got in zip(tensors, self.everyone(tensor.clone(), "all_gather")):
            out.copy_(got)

    def gather_into(self, out: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
        self.count("patch length exchanges")
        out.copy_(torch.cat(self.everyone(tensor.clone(), "lengths")))

    def gather_size_by_comm(self, size: int, group: Any) -> List[int]:
        self.count("diffusers length exchanges")
        return [int(s) for s in self.everyone(size, "lengths")]

    def run(self, fn: Callable[[int], Any]) -> List[Any]:
        results: List[Any] = [None] * self.n
        errors: List[BaseException] = []

        def one(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def ulysses_anything() -> Any:
    torchpatches.apply(["cp_ulysses_anything"])
    from diffusers.models.attention_dispatch import TemplatedUlyssesAnythingAttention

    return TemplatedUlyssesAnythingAttention


def _threaded(monkeypatch: pytest.MonkeyPatch, cls: Any, n: int) -> Any:
    """``n`` thread ranks wired in for diffusers' module and the patch; the original and the patched forwards."""
    from diffusers.models import attention_dispatch

    ranks = Ranks(n)
    monkeypatch.setattr(dist, "ProcessGroup", Group)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: n)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: ranks.rank())
    # a CPU backend in the group: the lengths are exchanged on the CPU, whatever accelerator this torch was built for
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "all_to_all_single", ranks.c10d_all_to_all)
    monkeypatch.setattr(dist, "all_gather", ranks.all_gather)
    monkeypatch.setattr(dist, "all_gather_single", ranks.gather_into, raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", ranks.gather_into)
    monkeypatch.setattr(funcol, "all_to_all_single", ranks.functional_all_to_all)
    monkeypatch.setattr(attention_dispatch, "gather_size_by_comm", ranks.gather_size_by_comm)
    original = getattr(cls.__dict__["forward"], MARK_ORIGINAL)
    ranks.original = original.__func__
    ranks.patched = cp_ulysses_anything._replacement(original).__func__
    return ranks


def _attention(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
               dropout_p: float, is_causal: bool, scale: Any, enable_gqa: bool, return_lse: bool,
               _save_ctx: bool = True, _parallel_config: Any = None) -> Any:
    """A forward op of diffusers' template ([B, S, H, D] in and out; a boolean key mask; the log-sum-exp
    [B, S, H])."""
    q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    out = (scores.softmax(-1) @ v).to(query.dtype).transpose(1, 2)
    return (out, scores.logsumexp(-1).transpose(1, 2)) if return_lse else out


def _config(group: Group) -> Any:
    cp = types.SimpleNamespace(_ulysses_mesh=types.SimpleNamespace(get_group=lambda: group))
    return types.SimpleNamespace(context_parallel_config=cp)


def _key_mask(length: int, generator: torch.Generator) -> torch.Tensor:
    mask = torch.rand(2, 1, 1, length, generator=generator) > 0.3
    mask[..., 0] = True  # no query without a key
    return mask


def _inputs(q_lengths: List[int], kv_lengths: List[int], heads: int, dtype: torch.dtype,
            mask: str) -> List[List[Optional[torch.Tensor]]]:
    """Each rank's q, k, v and mask: none, ``local`` (the rank's own keys: diffusers gathers it) or ``global`` (all
    keys, the same on every rank: passed on as it is)."""
    generator = torch.Generator().manual_seed(len(q_lengths) * 10 + heads)
    every_key = _key_mask(sum(kv_lengths), generator) if mask == "global" else None
    per_rank = []
    for sq, skv in zip(q_lengths, kv_lengths):
        q = torch.randn(2, sq, heads, 8, generator=generator).to(dtype)
        k, v = (torch.randn(2, skv, heads, 8, generator=generator).to(dtype) for _ in range(2))
        per_rank.append([q, k, v, _key_mask(skv, generator) if mask == "local" else every_key])
    return per_rank


def _forward(ranks: Ranks, fn: Callable[..., Any], inputs: List[List[Any]], return_lse: bool) -> List[Any]:
    config = _config(ranks.group)

    def one(rank: int) -> Any:
        q, k, v, mask = inputs[rank]
        return fn(types.SimpleNamespace(), q, k, v, mask, 0.0, False, None, False, return_lse, _attention, None,
                  config)

    return ranks.run(one)


CASES = {
    # name: (query lengths per rank, key lengths per rank, heads, mask)
    "two ranks": ([5, 4], [5, 4], 4, ""),
    "keys of other lengths": ([5, 4], [3, 6], 4, ""),
    "three ranks, heads padded": ([3, 4, 2], [6, 1, 4], 5, ""),
    "a key mask": ([5, 4], [5, 4], 4, "local"),
    "a key mask, keys of other lengths": ([5, 4], [3, 6], 4, "local"),
    "a mask over every key": ([5, 4], [3, 6], 4, "global"),
    "a rank without tokens": ([4, 0], [4, 0], 4, ""),
}


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_length_exchange_per_call_gives_the_original_result(ulysses_anything: Any,
                                                                monkeypatch: pytest.MonkeyPatch, case: str,
                                                                dtype: torch.dtype, return_lse: bool) -> None:
    q_lengths, kv_lengths, heads, mask = CASES[case]
    ranks = _threaded(monkeypatch, ulysses_anything, len(q_lengths))
    inputs = _inputs(q_lengths, kv_lengths, heads, dtype, mask)
    expected = _forward(ranks, ranks.original, inputs, return_lse)
    original_calls = dict(ranks.calls)
    ranks.calls.clear()
    got = _forward(ranks, ranks.patched, inputs, return_lse)
    for rank, (e, g) in enumerate(zip(expected, got)):
        e, g = (x if return_lse else (x,) for x in (e, g))
        for a, b in zip(e, g):
            assert type(b) is torch.Tensor and b.dtype == a.dtype and b.shape == a.shape, rank
            assert torch.equal(b, a), rank
    n, exchanges, gathers_mask = len(q_lengths), 4 + return_lse, mask == "local"
    # the original asks for the lengths once per exchange (and once for a local mask), the patch once per call
    assert original_calls.get("diffusers length exchanges") == n * (exchanges + gathers_mask)
    assert original_calls.get("functional all_to_all") == n * exchanges
    # c10d for every exchange but the empty ones (q, k, v of a rank without tokens): the functional collective
    empty = 3 * q_lengths.count(0)
    assert dict(ranks.calls) == {"patch length exchanges": n, "c10d all_to_all": n * exchanges - empty,
                                 **({"functional all_to_all": empty} if empty else {}),
                                 **({"all_gather": n} if gathers_mask else {})}


@pytest.mark.parametrize("case", ["compiling", "subclass"])
def test_what_the_patch_hands_back_runs_the_original(ulysses_anything: Any, monkeypatch: pytest.MonkeyPatch,
                                                     case: str) -> None:
    """Under torch.compile (what Dynamo's constant-folded check reads) and for tensor subclasses: the original
    forward, its four length exchanges per call included."""
    ranks = _threaded(monkeypatch, ulysses_anything, 2)
    inputs = _inputs([5, 4], [5, 4], 4, torch.float32, "")
    if case == "compiling":
        monkeypatch.setattr(cp_ulysses_anything, "is_compiling", lambda: True)
    else:
        inputs = [[t.as_subclass(Sub) for t in qkv[:3]] + [None] for qkv in inputs]
    got = _forward(ranks, ranks.patched, inputs, False)
    assert ranks.calls["diffusers length exchanges"] == 8 and ranks.calls["patch length exchanges"] == 0
    assert all(g.shape == (2, n, 4, 8) for g, n in zip(got, (5, 4)))


def test_through_apply_with_inputs_that_require_grad(ulysses_anything: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As diffusers calls it (``TemplatedUlyssesAnythingAttention.apply``, grad mode, inputs requiring grad): the
    forward runs with grad off, so the patch serves it; the output and its autograd node are the original's (whose
    backward diffusers has not implemented)."""
    ranks = _threaded(monkeypatch, ulysses_anything, 2)
    inputs = [[t.requires_grad_() for t in qkv[:3]] + [None] for qkv in _inputs([5, 4], [3, 6], 4, torch.float32, "")]
    config = _config(ranks.group)

    def call(rank: int) -> torch.Tensor:
        q, k, v, _ = inputs[rank]
        return ulysses_anything.apply(q, k, v, None, 0.0, False, None, False, False, _attention, None, config)

    with torchpatches.disabled("cp_ulysses_anything"):
        expected = ranks.run(call)
    assert ranks.calls["diffusers length exchanges"] == 8 and ranks.calls["patch length exchanges"] == 0
    ranks.calls.clear()
    got = ranks.run(call)
    assert ranks.calls["patch length exchanges"] == 2 and ranks.calls["diffusers length exchanges"] == 0
    for e, g in zip(expected, got):
        assert torch.equal(g, e) and g.requires_grad and type(g.grad_fn) is type(e.grad_fn)
    with pytest.raises(NotImplementedError):
        got[0].sum().backward()


def test_the_lengths_are_written_on_the_device_without_a_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each length is a fill (a kernel argument): ``t[i] = value`` would be a copy from a CPU scalar tensor, which on a
    GPU is a blocking host-to-device copy (the wait the patch is there to remove)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: List[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    before_gather: List[str] = []

    def gather(out: torch.Tensor, mine: torch.Tensor, group: Any = None) -> None:
        before_gather.extend(ops.seen)
        out.copy_(torch.cat([mine, mine]))

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(_direct_collectives, "gather_into_tensor", lambda: gather)
    with Ops() as ops:
        assert _direct_collectives.ints_of_every_rank((5, 7, 9), None) == [[5, 7, 9], [5, 7, 9]]
    assert before_gather.count("aten.fill_.Scalar") == 3
    assert not [op for op in before_gather if "copy" in op or "lift_fresh" in op], before_gather


def test_the_lengths_are_exchanged_where_diffusers_exchanges_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU when the group has a CPU backend (``cpu:gloo,cuda:nccl``), else on the accelerator torch names
    (``torch.accelerator.current_accelerator()``), as ``gather_size_by_comm`` does; one collective, read back once."""
    asked: List[str] = []

    def accelerator() -> torch.device:
        asked.append("accelerator")
        return torch.device("cpu")  # stands in for the GPU this host may not have

    def gather(out: torch.Tensor, mine: torch.Tensor, group: Any = None) -> None:
        asked.append(f"gather on {mine.device.type}")
        out.copy_(torch.cat([mine, mine + 10]))

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", accelerator)
    monkeypatch.setattr(_direct_collectives, "gather_into_tensor", lambda: gather)
    for backend in ("cpu:gloo,cuda:nccl", "nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert _direct_collectives.ints_of_every_rank((5, 7, 7), None) == [[5, 7, 7], [15, 17, 17]]
    assert asked == ["gather on cpu", "accelerator", "gather on cpu"]


def test_revert_puts_the_original_staticmethod_back(ulysses_anything: Any) -> None:
    patched = ulysses_anything.__dict__["forward"]
    original = getattr(patched, MARK_ORIGINAL)
    assert isinstance(patched, staticmethod) and original.__func__.__code__.co_filename.endswith(
        "attention_dispatch.py")
    torchpatches.revert("cp_ulysses_anything")
    try:
        assert ulysses_anything.__dict__["forward"] is original
    finally:
        torchpatches.apply(["cp_ulysses_anything"])
    assert ulysses_anything.__dict__["forward"] is patched
