"""Validation of RoPE calls, and the ``[B, S, H, D]`` view every tier works on.

Everything is checked before anything is written: a bad call raises ``ValueError`` naming the
problem and leaves q and k untouched. Shapes, dtypes and devices are static under Dynamo, so these
checks cost no graph break.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .._compat import is_compiling

Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sequence_dim_of(x: torch.Tensor, sequence_dim: Optional[int]) -> int:
    """The dim of ``x`` that holds the tokens (``sequence_dim`` checked, or the default for its rank)."""
    rank = x.dim()
    if rank not in (3, 4):
        raise ValueError(f"q must be 3-D [T, H, D] or 4-D [B, S, H, D] / [B, H, S, D], got shape "
                         f"{tuple(x.shape)} (rank {rank})")
    if sequence_dim is None:
        return 0 if rank == 3 else 1
    allowed = (0,) if rank == 3 else (1, 2)
    sd = sequence_dim + rank if sequence_dim < 0 else sequence_dim
    if sd not in allowed:
        raise ValueError(f"sequence_dim={sequence_dim} is invalid for a {rank}-D q; expected one "
                         f"of {allowed}")
    return sd


def bshd(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """A [B, S, H, D] view of x (no copy)."""
    if x.dim() == 3:
        return x.unsqueeze(0)
    return x if seq_dim == 1 else x.transpose(1, 2)


def check_qk(q: torch.Tensor, k: Optional[torch.Tensor], seq_dim: int) -> tuple[int, int, int]:
    """Returns (B, S, D) of the [B, S, H, D] view; raises ValueError on any mismatch."""
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; expected float32, bfloat16 or float16")
    B, S, H, D = bshd(q, seq_dim).shape
    if H < 1 or D < 2:
        raise ValueError(f"q needs at least one head and head_dim >= 2, got shape {tuple(q.shape)}")
    check_no_overlap(q, "q")
    if k is None:
        return B, S, D
    if not isinstance(k, torch.Tensor):
        raise ValueError(f"k must be a torch.Tensor or None, got {type(k).__name__}")
    if k is q:
        raise ValueError("q and k are the same tensor: it would be rotated twice")
    if k.dtype != q.dtype:
        raise ValueError(f"q and k dtypes differ: {q.dtype} vs {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"q and k are on different devices: {q.device} vs {k.device}")
    if k.dim() != q.dim():
        raise ValueError(f"q and k ranks differ: {tuple(q.shape)} vs {tuple(k.shape)}")
    kb, ks, kh, kd = bshd(k, seq_dim).shape
    if (kb, ks, kd) != (B, S, D):
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch, "
                         "sequence length or head dim (only the head count may differ)")
    if kh < 1:
        raise ValueError(f"k needs at least one head, got shape {tuple(k.shape)}")
    check_no_overlap(k, "k")
    return B, S, D


def check_no_overlap(x: torch.Tensor, name: str) -> None:
    # An expanded tensor (stride 0 on a dim of size > 1) would have several outputs in one place.
    for size, stride in zip(x.shape, x.stride()):
        if stride == 0 and size > 1:
            raise ValueError(f"{name} has overlapping memory (an expanded view, stride 0); "
                             "pass a tensor that owns its elements (e.g. .contiguous())")


def check_rotary_dim(rotary_dim: int, head_dim: int, given: Optional[int]) -> int:
    if given is not None and given != rotary_dim:
        raise ValueError(f"rotary_dim={given} does not match the cos/sin width {rotary_dim}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be positive and even, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} is larger than the head dim {head_dim}")
    return rotary_dim


def check_table(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_per_token(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, S: int, D: int,
                    rotary_dim: Optional[int]) -> int:
    check_table(cos, "cos", q)
    check_table(sin, "sin", q)
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin shapes differ: {tuple(cos.shape)} vs {tuple(sin.shape)}")
    if cos.shape[0] != S:
        raise ValueError(f"cos/sin have {cos.shape[0]} rows but the sequence length is {S}; "
                         "expected cos, sin of shape [S, rotary_dim]")
    return check_rotary_dim(cos.shape[1], D, rotary_dim)


def check_cache(q: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, B: int, S: int,
                D: int, rotary_dim: Optional[int]) -> int:
    check_table(cache, "cos_sin_cache", q)
    r = check_rotary_dim(cache.shape[1], D, rotary_dim)
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    if positions.device != q.device:
        raise ValueError(f"positions is on {positions.device} but q is on {q.device}")
    ok_shapes = [(S,)] if q.dim() == 3 else [(S,), (B, S)]
    if tuple(positions.shape) not in ok_shapes:
        raise ValueError(f"positions shape {tuple(positions.shape)} does not match q: expected one "
                         f"of {ok_shapes}")
    check_positions_range(positions, cache.shape[0])
    return r


def check_positions_range(positions: torch.Tensor, rows: int) -> None:
    # Only where it is cheap: CPU tensors in eager mode (a GPU check would synchronize, and a
    # data-dependent check would break a graph).
    if positions.device.type != "cpu" or positions.numel() == 0 or is_compiling():
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= rows:
        raise ValueError(f"positions range [{lo}, {hi}] is outside cos_sin_cache rows [0, {rows})")


def positions_2d(positions: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[S] -> [1, S] (broadcast over batch), [B, S] unchanged."""
    if positions is None:
        return None
    return positions.unsqueeze(0) if positions.dim() == 1 else positions


# ---------------------------------------------------------------------------------------------
# In place: every output can be written, and no write changes an element another read needs.
# Checked in eager only (plain tensors): under torch.compile aliasing is functionalization's job and
# FakeTensors have no addresses.
# ---------------------------------------------------------------------------------------------


def check_inplace(q: torch.Tensor, k: Optional[torch.Tensor], tables: "dict[str, torch.Tensor]") -> None:
    """Raise ValueError, before anything is written, if q or k cannot be written in place, or if a
    write would change an element that is read afterwards (q and k sharing elements, a tensor with
    overlapping elements of its own, a cos/sin/cache/positions table inside q or k)."""
    if is_compiling():
        return  # traced: AOTAutograd's functionalization sees the writes (and Dynamo cannot trace is_inference)
    outputs = [("q", q)] + ([("k", k)] if k is not None else [])
    for name, x in outputs:
        check_writable(x, name)
    if any(type(x) is not torch.Tensor for _, x in outputs):
        return
    for name, x in outputs:
        if not _elements_distinct(x):
            raise ValueError(f"{name} has overlapping memory (several indices address one element): "
                             "an in-place rotation would write those elements twice; pass .contiguous()")
    if k is not None and _may_share_elements(q, k):
        raise ValueError("q and k overlap in memory (views sharing elements): in place, the shared "
                         "elements would be rotated twice; nothing was written")
    for name, x in outputs:
        for table_name, table in tables.items():
            if type(table) is torch.Tensor and _may_share_elements(x, table):
                raise ValueError(f"{table_name} overlaps {name} in memory: writing {name} in place would "
                                 f"change the {table_name} values still to be read; nothing was written")


def check_writable(x: torch.Tensor, name: str) -> None:
    """The conditions under which autograd refuses an in-place write, checked before any write."""
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name} is an inference tensor (made under torch.inference_mode()) and cannot be "
                         "written in place outside inference mode; nothing was written (pass a clone, "
                         "or call inside torch.inference_mode())")
    if not (torch.is_grad_enabled() and x.requires_grad):
        return
    if x.is_leaf:
        raise ValueError(f"{name} is a leaf tensor that requires grad: autograd forbids writing it in place; "
                         "nothing was written (use the out-of-place function)")
    base = x._base
    if base is not None and base.is_leaf and base.requires_grad:
        raise ValueError(f"{name} is a view of a leaf tensor that requires grad: autograd forbids writing "
                         "it in place; nothing was written (use the out-of-place function)")
    meta = getattr(torch._C._autograd, "_get_creation_meta", None)
    if base is not None and meta is not None and str(meta(x)).rsplit(".", 1)[-1] != "DEFAULT":
        raise ValueError(f"{name} is a view autograd forbids writing in place (created in no_grad mode, by a "
                         "function returning several views, or in inference mode); nothing was written "
                         "(use the out-of-place function)")


def _layout(x: torch.Tensor) -> "tuple[int, list[tuple[int, int]]]":
    """(byte offset in its storage, [(size, byte stride)] of dims with size > 1, largest stride first)."""
    item = x.element_size()
    dims = sorted(((size, stride * item) for size, stride in zip(x.shape, x.stride()) if size > 1),
                  key=lambda d: -abs(d[1]))
    return x.storage_offset() * item, dims


def _extent(dims: "list[tuple[int, int]]", item: int) -> int:
    return sum((size - 1) * abs(stride) for size, stride in dims) + item


def _elements_distinct(x: torch.Tensor) -> bool:
    """Whether every index of ``x`` addresses its own element (sufficient check: each stride clears
    the extent of the smaller ones; every layout a view of a dense tensor can have passes)."""
    if x.numel() <= 1:
        return True
    _, dims = _layout(x)
    item = x.element_size()
    for i, (_, stride) in enumerate(dims):
        if stride == 0 or abs(stride) < _extent(dims[i + 1:], item):
            return False
    return True


def _may_share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have a byte in common. Exact for views of one buffer with the same
    strides (a fused QKV projection split into q, k, v); otherwise true whenever their byte ranges
    in a shared storage intersect (conservative)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    try:
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return False
    except (RuntimeError, NotImplementedError):  # storage without a data pointer (meta, subclasses)
        return False
    off_a, dims_a = _layout(a)
    off_b, dims_b = _layout(b)
    end_a, end_b = off_a + _extent(dims_a, a.element_size()), off_b + _extent(dims_b, b.element_size())
    if end_a <= off_b or end_b <= off_a:
        return False
    if a.element_size() != b.element_size():
        return True
    # Align the dims by stride (a dim one of them lacks has size 1 there: GQA with one KV head).
    sizes_a, sizes_b = {st: n for n, st in dims_a}, {st: n for n, st in dims_b}
    if len(sizes_a) != len(dims_a) or len(sizes_b) != len(dims_b) or any(st <= 0 for st in (*sizes_a, *sizes_b)):
        return True
    strides = sorted(set(sizes_a) | set(sizes_b), reverse=True)
    aligned_a = [(sizes_a.get(st, 1), st) for st in strides]
    aligned_b = [(sizes_b.get(st, 1), st) for st in strides]
    return _boxes_meet(off_b - off_a, aligned_a, aligned_b, a.element_size(), budget=[4096])


def _boxes_meet(delta: int, dims_a: "list[tuple[int, int]]", dims_b: "list[tuple[int, int]]", item: int,
                budget: "list[int]") -> bool:
    """Whether some element of A (origin 0) and of B (origin ``delta``), both with the same strides
    (largest first), overlap in bytes. At each dim only outer indices whose blocks can meet are tried."""
    if not dims_a:
        return -item < delta < item
    (n_a, stride), (n_b, _) = dims_a[0], dims_b[0]
    inner_a, inner_b = _extent(dims_a[1:], item), _extent(dims_b[1:], item)
    # Block i of A covers [i*stride, i*stride + inner_a); block j of B covers
    # [delta + j*stride, ... + inner_b). They meet when -inner_b < delta + (j - i)*stride < inner_a.
    lo = -((inner_b + delta) // stride) - 1
    hi = (inner_a - delta) // stride + 1
    for shift in range(max(lo, -(n_a - 1)), min(hi, n_b - 1) + 1):  # shift = j - i
        budget[0] -= 1
        if budget[0] < 0:
            return True  # too many cases to decide cheaply: say they may meet
        rel = delta + shift * stride
        if -inner_b < rel < inner_a and _boxes_meet(rel, dims_a[1:], dims_b[1:], item, budget):
            return True
    return False


def needs_grad(*tensors: Any) -> bool:
    """Whether autograd records this call: grad mode on and any tensor given requires grad.
    (Static under Dynamo: it guards on both.)"""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
