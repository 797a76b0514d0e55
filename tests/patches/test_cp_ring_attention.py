"""``cp_ring_attention``: diffusers' ring attention gathers keys and values through c10d, with the original's values.

Two ranks emulated in this process (a two-rank group to the predicate, c10d's gather and the functional one each
giving both ranks' buffers in rank order): on each rank the patched forward's output, log-sum-exp and what it
leaves on ``ctx`` equal the original forward's, through ``all_gather_single`` and, as on a torch before 2.13,
``all_gather_into_tensor``; the gather is asked for twice the buffer. Over a real one-rank gloo group: the patched
``TemplatedRingAttention`` gives the original's output and log-sum-exp bit for bit (two dtypes, with and without
the log-sum-exp returned), calls no functional collective and warns nothing (the functional gather's
``FutureWarning`` is an error under ``-W error``); what the patch hands back (torch.compile -- also a real
``fullgraph`` trace --, forward AD, a dispatch mode, a tensor subclass, a group that is not a ``ProcessGroup``)
reaches the functional gather; the predicate refuses a group inside ``_coalescing_manager``; revert puts back the
registry's original (a ``staticmethod``). Two real ranks (gloo) gathering inside tiny FLUX models, and a training
step through diffusers' own backward, run in ``test_fused_context_parallel.py``. The uneven form
(``TemplatedRingAnythingAttention``, ``ring_anything``): two and three emulated ranks of unequal lengths, batch 2,
equal to the original, with the merges and the one length exchange per call counted; diffusers' merge where
``lse_merge`` does not fit; a mask (the original's error), compiling and a dispatch mode handed back; revert puts
both forwards back.
"""
from __future__ import annotations

import os
import types
import warnings
from typing import Any, List

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

import torchpatches  # noqa: E402

from _collectives import PassThrough, Sub, counted_calls  # noqa: E402
from torchpatches._core.slot import MARK_ORIGINAL  # noqa: E402
from torchpatches.patches._bodies import cp_ring_attention  # noqa: E402


@pytest.fixture
def ring() -> Any:
    torchpatches.apply(["cp_ring_attention"])
    from diffusers.models.attention_dispatch import TemplatedRingAttention

    return TemplatedRingAttention


@pytest.fixture
def gathers(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """One entry per ``funcol.all_gather_tensor`` call (what diffusers' ring forward makes)."""
    return counted_calls(monkeypatch, funcol, "all_gather_tensor")


#: Where the emulated-rank tests run (the gloo group's tests stay on the CPU): ``TORCHPATCHES_TEST_DEVICE=cuda`` puts
#: them on the GPU, where the merge is ``lse_merge``'s compiled Triton kernel.
DEVICE = torch.device("cuda" if os.environ.get("TORCHPATCHES_TEST_DEVICE") == "cuda" else "cpu")


def _attention_with_lse(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                        dropout_p: float, is_causal: bool, scale: Any, enable_gqa: bool, return_lse: bool,
                        _save_ctx: bool = True, _parallel_config: Any = None) -> Any:
    """A forward op of diffusers' template ([B, S, H, D] in and out, the log-sum-exp [B, S, H]): torch's CPU flash
    kernel, and on a GPU the same attention written out (its output a strided view, as some backends return)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                              scale=scale)
        return out.transpose(1, 2), lse.transpose(1, 2)
    scores = (q.float() @ k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    out = (scores.softmax(-1) @ v.float()).to(query.dtype)
    return out.transpose(1, 2), scores.logsumexp(-1).transpose(1, 2)


def _config(group: Any) -> Any:
    """The part of diffusers' ``ParallelConfig`` the ring forward reads."""
    cp = types.SimpleNamespace(_ring_mesh=types.SimpleNamespace(get_group=lambda: group), _ring_local_rank=0,
                               ring_degree=1, convert_to_fp32=True)
    return types.SimpleNamespace(context_parallel_config=cp)


def _qkv(dtype: torch.dtype = torch.float32) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, 6, 2, 8, generator=generator).to(dtype) for _ in range(3)]


def _call(ring: Any, group: Any, qkv: List[torch.Tensor], return_lse: bool = True, config: Any = None) -> Any:
    config = _config(group) if config is None else config
    return ring.apply(*qkv, None, 0.0, False, None, False, return_lse, _attention_with_lse, None, config)


@pytest.mark.parametrize("return_lse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c10d_gather_gives_the_original_output(group: Any, ring: Any, gathers: List[int], dtype: torch.dtype,
                                                   return_lse: bool) -> None:
    qkv = _qkv(dtype)
    with torchpatches.disabled("cp_ring_attention"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the functional gather's deprecation, torch >= 2.13
        expected = _call(ring, group, qkv, return_lse)
    assert len(gathers) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the patched eager call warns nothing
        got = _call(ring, group, qkv, return_lse)
    assert len(gathers) == 1  # the patched call gathered through c10d
    expected, got = (x if return_lse else (x,) for x in (expected, got))
    for e, g in zip(expected, got):
        assert type(g) is torch.Tensor and g.dtype == e.dtype and torch.equal(g, e)


class NotAGroup:
    """What a mesh dimension's name or a rank list would be to c10d: not a ``ProcessGroup``."""

    def __init__(self, group: Any) -> None:
        self.group = group


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the functional gather's deprecation, torch >= 2.13
@pytest.mark.parametrize("case", ["compiling", "forward AD", "dispatch mode", "subclass", "not a process group"])
def test_the_functional_gather_runs_for_what_c10d_does_not_cover(group: Any, ring: Any, gathers: List[int],
                                                                 monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    qkv = _qkv()
    if case == "compiling":  # what Dynamo's constant-folded check reads while it traces: the original forward
        monkeypatch.setattr(cp_ring_attention, "is_compiling", lambda: True)
        _call(ring, group, qkv)
    elif case == "forward AD":
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            _call(ring, group, qkv)
    elif case == "dispatch mode":
        with PassThrough():
            _call(ring, group, qkv)
    elif case == "subclass":  # the functional collective's own answer to a plain subclass
        with pytest.raises(RuntimeError, match="subclass Sub"):
            _call(ring, group, [x.as_subclass(Sub) for x in qkv])
    else:  # c10d's collective would refuse the object; the functional one is handed what diffusers hands it
        with pytest.raises(Exception):
            _call(ring, NotAGroup(group), qkv)
    assert len(gathers) == 1, case


def test_dynamo_traces_the_original_in_one_graph(group: Any, ring: Any) -> None:
    """Under torch.compile the replacement hands Dynamo diffusers' own forward: one graph, no break, same values."""
    import torch._dynamo

    qkv, config = _qkv(), _config(group)
    expected = _call(ring, group, qkv)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Dynamo traces the original's functional gather
        compiled = torch.compile(lambda q, k, v: _call(ring, group, [q, k, v], config=config), backend="eager",
                                 fullgraph=True)
        got = compiled(*qkv)
    torch._dynamo.reset()
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


class FakeGroup:
    """A group of ``size`` ranks to the predicate (``process_group`` is this class in these tests): only ``size``
    is read."""

    def __init__(self, size: int = 2) -> None:
        self.ranks = size

    def size(self) -> int:
        return self.ranks


def _kv_buffer(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return torch.cat([key.flatten(), value.flatten()])


def _rank_config(rank: int, group: Any, convert_to_fp32: bool = True) -> Any:
    cp = types.SimpleNamespace(_ring_mesh=types.SimpleNamespace(get_group=lambda: group), _ring_local_rank=rank,
                               ring_degree=group.size(), convert_to_fp32=convert_to_fp32)
    return types.SimpleNamespace(context_parallel_config=cp)


def _with_trailing_lse(*args: Any, **kwargs: Any) -> Any:
    """A backend whose log-sum-exp keeps a trailing 1 (``[B, S, H, 1]``, diffusers PR 12693)."""
    out, lse = _attention_with_lse(*args, **kwargs)
    return out, lse.unsqueeze(-1)


def _ring_call(forward: Any, inputs: List[torch.Tensor], config: Any, op: Any = _attention_with_lse) -> Any:
    """``forward`` (a ``TemplatedRingAttention.forward`` function) as the rank ``config`` says: (out, lse, ctx)."""
    ctx = types.SimpleNamespace()
    out, lse = forward(ctx, *inputs, None, 0.0, False, None, False, True, op, None, config)
    return out, lse, ctx


def _emulated_ranks(ring: Any, monkeypatch: pytest.MonkeyPatch, ranks: int, dtype: torch.dtype,
                    torch_release: str = "all_gather_single") -> Any:
    """``ranks`` ranks emulated in this process: each rank's (q, k, v), the original and the patched forward
    functions, the group, and the c10d gathers seen. c10d's gather (``all_gather_single``, or
    ``all_gather_into_tensor`` on a torch before 2.13) and the functional one both give every rank's buffer in
    rank order."""
    generator = torch.Generator().manual_seed(ranks)
    inputs = [[torch.randn(1, 6, 2, 8, generator=generator).to(DEVICE, dtype) for _ in range(3)]
              for _ in range(ranks)]
    buffers = [_kv_buffer(*qkv[1:]) for qkv in inputs]
    seen: List[Any] = []

    def c10d_gather(out: torch.Tensor, kv: torch.Tensor, group: Any = None) -> None:
        seen.append((out.shape, kv.dtype, group))
        out.copy_(torch.cat(buffers))

    def functional_gather(kv: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
        assert gather_dim == 0
        return torch.cat(buffers)

    original = getattr(ring.__dict__["forward"], MARK_ORIGINAL).__func__
    monkeypatch.setattr(dist, "ProcessGroup", FakeGroup)
    if torch_release == "all_gather_into_tensor":
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, torch_release, c10d_gather, raising=False)  # torch 2.11 has no all_gather_single
    monkeypatch.setattr(funcol, "all_gather_tensor", functional_gather)
    patched = cp_ring_attention._replacement(getattr(ring.__dict__["forward"], MARK_ORIGINAL)).__func__
    return types.SimpleNamespace(inputs=inputs, buffers=buffers, seen=seen, original=original, patched=patched,
                                 group=FakeGroup(ranks))


def _same_as_the_original(got: Any, expected: Any) -> None:
    for e, g in zip(expected[:2], got[:2]):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
    assert {k: v for k, v in vars(got[2]).items() if not isinstance(v, torch.Tensor)} == \
        {k: v for k, v in vars(expected[2]).items() if not isinstance(v, torch.Tensor)}
    assert torch.equal(got[2].ring_out, expected[2].ring_out) and torch.equal(got[2].ring_lse, expected[2].ring_lse)


class _Merges(list):
    def __init__(self) -> None:
        super().__init__()
        self.tiers: List[str] = []


@pytest.fixture
def merges(monkeypatch: pytest.MonkeyPatch) -> List[Any]:
    """The ``out_dtype`` of every ``lse_merge`` call the patched forward makes (its body, whichever tier), and in
    ``merges.tiers`` the tier each ran."""
    from torchpatches.ops import _lse_merge as op

    calls = _Merges()
    real = op._impl

    def counted(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any, out_dtype: torch.dtype, tier: str) -> Any:
        calls.append(out_dtype)
        calls.tiers.append(tier)
        return real(out_a, lse_a, out_b, lse_b, out_dtype, tier)

    monkeypatch.setattr(op, "_impl", counted)
    return calls


@pytest.mark.parametrize("torch_release", ["all_gather_single", "all_gather_into_tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_ranks_merge_the_gathered_keys_and_values_as_the_original(ring: Any, monkeypatch: pytest.MonkeyPatch,
                                                                     merges: List[Any], dtype: torch.dtype,
                                                                     torch_release: str) -> None:
    """The ring loop reads the other rank's chunk of the c10d gather and merges the log-sum-exps in one
    ``lse_merge`` call (PyTorch tier on CPU: diffusers' ops; on a GPU the Triton kernel); output, log-sum-exp and
    what the forward leaves on ``ctx`` equal the original's; the gather is asked for twice the buffer."""
    world = _emulated_ranks(ring, monkeypatch, 2, dtype, torch_release)
    for rank in range(2):
        config = _rank_config(rank, world.group)
        _same_as_the_original(_ring_call(world.patched, world.inputs[rank], config),
                              _ring_call(world.original, world.inputs[rank], config))
    assert world.seen == [(torch.Size([2 * world.buffers[0].numel()]), dtype, world.group)] * 2
    assert merges == [dtype, dtype]  # one merge per rank, writing the query's dtype
    assert merges.tiers == ["triton" if DEVICE.type == "cuda" else "torch"] * 2  # the automatic tier


def _bf16_out(*args: Any, **kwargs: Any) -> Any:
    """A backend whose output is bf16 and log-sum-exp fp32 whatever the query's dtype (the forward casts the output
    back to the query's)."""
    out, lse = _attention_with_lse(*args, **kwargs)
    return out.to(torch.bfloat16), lse.float()


@pytest.mark.parametrize("case", ["three ranks", "trailing lse dim", "no fp32 merge", "one rank", "float64 query"])
def test_the_ring_merges_as_the_original_in_every_form(ring: Any, monkeypatch: pytest.MonkeyPatch,
                                                       merges: List[Any], case: str) -> None:
    """Three ranks: two merges, the first one's result fp32 (as diffusers' running output), the last in the
    query's dtype. A backend with a ``[B, S, H, 1]`` log-sum-exp: fused too. ``convert_to_fp32=False``, one rank, and
    a query of a dtype ``lse_merge`` does not write (float64, a bf16 output from the backend): diffusers' own merge
    (no ``lse_merge`` call). Every case bit-equal to the original."""
    ranks = {"three ranks": 3, "one rank": 1}.get(case, 2)
    world = _emulated_ranks(ring, monkeypatch, ranks, torch.float64 if case == "float64 query" else torch.bfloat16)
    op = {"trailing lse dim": _with_trailing_lse, "float64 query": _bf16_out}.get(case, _attention_with_lse)
    for rank in range(ranks):
        config = _rank_config(rank, world.group, convert_to_fp32=case != "no fp32 merge")
        _same_as_the_original(_ring_call(world.patched, world.inputs[rank], config, op),
                              _ring_call(world.original, world.inputs[rank], config, op))
    expected = {"three ranks": [torch.float32, torch.bfloat16] * 3, "trailing lse dim": [torch.bfloat16] * 2}
    assert merges == expected.get(case, [])


def test_the_kernel_merge_inside_the_ring_is_the_original_within_fp32_rounding(
        ring: Any, monkeypatch: pytest.MonkeyPatch, merges: List[Any]) -> None:
    """The Triton tier (CPU interpreter: numpy's exp / log, where CUDA's libdevice calls give torch's bits) inside
    the patched forward, three ranks so an fp32 running output passes between merges: the log-sum-exp within
    fp32 rounding, the fp32 output within 1e-6, what the backward reads on ``ctx`` the returned tensors."""
    pytest.importorskip("triton")
    from torchpatches.ops import _lse_merge as op

    world = _emulated_ranks(ring, monkeypatch, 3, torch.float32)
    for rank in range(3):
        config = _rank_config(rank, world.group)
        expected = _ring_call(world.original, world.inputs[rank], config)
        with op.force_tier("triton"):
            got = _ring_call(world.patched, world.inputs[rank], config)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-6)
        assert torch.equal(got[2].ring_out, got[0]) and torch.equal(got[2].ring_lse, got[1])
    assert len(merges) == 6 and merges.tiers == ["triton"] * 6


def test_the_predicate_refuses_a_coalescing_group(group: Any) -> None:
    """Inside ``_coalescing_manager`` c10d defers the collective to the block's end: the functional one runs."""
    from torchpatches.patches._direct_collectives import direct_fits

    x = torch.ones(4)
    assert direct_fits(x, group, dist.ProcessGroup)
    with dist._coalescing_manager(group):
        assert not direct_fits(x, group, dist.ProcessGroup)
    assert direct_fits(x, group, dist.ProcessGroup)


def test_revert_puts_the_original_staticmethod_back(ring: Any) -> None:
    patched = ring.__dict__["forward"]
    original = getattr(patched, MARK_ORIGINAL)  # what the registry found in diffusers' class
    assert isinstance(patched, staticmethod) and isinstance(original, staticmethod) and original is not patched
    assert original.__func__.__code__.co_filename.endswith("attention_dispatch.py")
    torchpatches.revert("cp_ring_attention")
    try:
        assert ring.__dict__["forward"] is original
    finally:
        torchpatches.apply(["cp_ring_attention"])
    assert ring.__dict__["forward"] is patched


# ---- TemplatedRingAnythingAttention: shards of any length (``ring_anything``) ----------------------------------


@pytest.fixture
def ring_anything() -> Any:
    torchpatches.apply(["cp_ring_attention"])
    from diffusers.models.attention_dispatch import TemplatedRingAnythingAttention

    return TemplatedRingAnythingAttention


def _uneven_ranks(ring_anything: Any, monkeypatch: pytest.MonkeyPatch, lengths: List[int],
                  dtype: torch.dtype) -> Any:
    """Ranks of ``lengths`` local tokens each, emulated as ``_emulated_ranks`` does: diffusers' size gather gives every
    rank's length, c10d's gather and the functional one every rank's padded key/value buffer in rank order."""
    from diffusers.models import attention_dispatch

    generator = torch.Generator().manual_seed(len(lengths))
    inputs = [[torch.randn(2, n, 2, 8, generator=generator).to(DEVICE, dtype) for _ in range(3)] for n in lengths]
    longest = max(lengths)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((t.shape[0], longest - t.shape[1], *t.shape[2:]))], dim=1)

    buffers = [_kv_buffer(padded(k), padded(v)) for _, k, v in inputs]
    seen: List[Any] = []

    def c10d_gather(out: torch.Tensor, kv: torch.Tensor, group: Any = None) -> None:
        seen.append(out.shape)
        out.copy_(torch.cat(buffers))

    exchanged: List[Any] = []

    def lengths_of_every_rank(local: Any, group: Any) -> List[List[int]]:
        exchanged.append(tuple(local))
        return [[n] for n in lengths]

    monkeypatch.setattr(attention_dispatch, "gather_size_by_comm", lambda size, group: list(lengths))
    monkeypatch.setattr(cp_ring_attention, "ints_of_every_rank", lengths_of_every_rank)
    monkeypatch.setattr(dist, "ProcessGroup", FakeGroup)
    monkeypatch.setattr(dist, "all_gather_single", c10d_gather, raising=False)
    monkeypatch.setattr(funcol, "all_gather_tensor", lambda kv, gather_dim, group: torch.cat(buffers))
    original = getattr(ring_anything.__dict__["forward"], MARK_ORIGINAL)
    patched = cp_ring_attention._anything_replacement(original).__func__
    return types.SimpleNamespace(inputs=inputs, seen=seen, original=original.__func__, patched=patched,
                                 group=FakeGroup(len(lengths)), buffer_numel=buffers[0].numel(), exchanged=exchanged)


@pytest.mark.parametrize("lengths", [[5, 4], [4, 5], [3, 4, 2]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uneven_ranks_merge_as_the_original(ring_anything: Any, monkeypatch: pytest.MonkeyPatch,
                                            merges: List[Any], lengths: List[int], dtype: torch.dtype) -> None:
    """Each rank's own keys unpadded, the others' cut to their true lengths from the padded c10d gather, every step
    merged by ``lse_merge``: output, log-sum-exp and ``ctx`` equal the original's (batch 2, so the slices are
    strided as the original's are)."""
    world = _uneven_ranks(ring_anything, monkeypatch, lengths, dtype)
    for rank in range(len(lengths)):
        config = _rank_config(rank, world.group)
        _same_ring_result(_ring_call(world.patched, world.inputs[rank], config),
                          _ring_call(world.original, world.inputs[rank], config))
    assert world.seen == [torch.Size([len(lengths) * world.buffer_numel])] * len(lengths)
    assert world.exchanged == [(n,) for n in lengths]  # each rank's own key length, one exchange per call
    steps = len(lengths) - 1
    assert merges == ([torch.float32] * (steps - 1) + [dtype]) * len(lengths)


def _same_ring_result(got: Any, expected: Any) -> None:
    for e, g in zip(expected[:2], got[:2]):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
    assert {k: v for k, v in vars(got[2]).items()} == {k: v for k, v in vars(expected[2]).items()}


@pytest.mark.parametrize("case", ["no fp32 merge", "float64 query"])
def test_uneven_ranks_keep_diffusers_merge_where_the_op_does_not_fit(
        ring_anything: Any, monkeypatch: pytest.MonkeyPatch, merges: List[Any], case: str) -> None:
    world = _uneven_ranks(ring_anything, monkeypatch, [5, 4],
                          torch.float64 if case == "float64 query" else torch.bfloat16)
    op = _bf16_out if case == "float64 query" else _attention_with_lse
    for rank in range(2):
        config = _rank_config(rank, world.group, convert_to_fp32=case != "no fp32 merge")
        _same_ring_result(_ring_call(world.patched, world.inputs[rank], config, op),
                          _ring_call(world.original, world.inputs[rank], config, op))
    assert merges == []


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the functional gather's deprecation, torch >= 2.13
@pytest.mark.parametrize("case", ["a mask", "compiling", "dispatch mode"])
def test_uneven_ranks_hand_back_what_the_patch_does_not_cover(ring_anything: Any, monkeypatch: pytest.MonkeyPatch,
                                                              merges: List[Any], case: str) -> None:
    """A mask: the original's own ValueError. Under torch.compile: the original forward (functional gather,
    diffusers' merge). A dispatch mode: the functional gather, as the even ring's."""
    world = _uneven_ranks(ring_anything, monkeypatch, [5, 4], torch.float32)
    gathers = counted_calls(monkeypatch, funcol, "all_gather_tensor")
    config = _rank_config(0, world.group)
    q, k, v = world.inputs[0]
    if case == "a mask":
        with pytest.raises(ValueError, match="does not support non-None attn_mask"):
            world.patched(types.SimpleNamespace(), q, k, v, torch.ones(1, dtype=torch.bool), 0.0, False, None, False,
                          True, _attention_with_lse, None, config)
        return
    expected = _ring_call(world.original, world.inputs[0], config)
    if case == "compiling":
        monkeypatch.setattr(cp_ring_attention, "is_compiling", lambda: True)
        got = _ring_call(world.patched, world.inputs[0], config)
        assert merges == []
    else:
        with PassThrough():
            got = _ring_call(world.patched, world.inputs[0], config)
    _same_ring_result(got, expected)
    assert len(gathers) == 2 and world.seen == []  # the original's gather, then the patched call's


def test_revert_puts_both_ring_forwards_back(ring: Any, ring_anything: Any) -> None:
    patched = [cls.__dict__["forward"] for cls in (ring, ring_anything)]
    torchpatches.revert("cp_ring_attention")
    try:
        for cls, p in zip((ring, ring_anything), patched):
            assert cls.__dict__["forward"] is getattr(p, MARK_ORIGINAL)
    finally:
        torchpatches.apply(["cp_ring_attention"])
    assert [cls.__dict__["forward"] for cls in (ring, ring_anything)] == patched
