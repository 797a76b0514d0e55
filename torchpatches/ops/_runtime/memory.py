"""Memory checks shared by the ops that write: can a tensor be written, and does a write change an element
that is still to be read. Made before anything is written; a problem raises ``ValueError`` naming it.

- in place (RoPE's ``*_inplace``): every output can be written, and no write changes an element another
  read needs (:func:`check_inplace`);
- ``out=`` (``swiglu``, ``slices``): ``out`` writable, its indices address distinct elements, and it shares
  no memory with ``x`` unless an elementwise op writes ``x`` itself, nor with the other inputs named
  (:func:`check_out`);
- an expanded input (stride 0) would make several outputs of one element (:func:`check_no_overlap`).

Addresses are checked in eager only (plain tensors): under torch.compile aliasing is functionalization's
job and FakeTensors have no addresses; functorch's wrapped tensors (vmap, grad, jvp) have none either.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..._core.compat import is_compiling
from .tiers import transforms_active

__all__ = ["expanded", "check_no_overlap", "check_inplace", "check_writable", "check_out", "elements_distinct",
           "may_share_elements"]


def expanded(x: torch.Tensor) -> bool:
    """An expanded view (stride 0 on a dim of size > 1): written to, several outputs would land in one place."""
    strides = x.stride()
    return 0 in strides and any(stride == 0 and size > 1 for size, stride in zip(x.shape, strides))


def check_no_overlap(x: torch.Tensor, name: str) -> None:
    if expanded(x):
        raise ValueError(f"{name} has overlapping memory (an expanded view, stride 0); "
                             "pass a tensor that owns its elements (e.g. .contiguous())")


def check_inplace(q: torch.Tensor, k: Optional[torch.Tensor], tables: "dict[str, torch.Tensor]") -> None:
    """Raise ValueError, before anything is written, if q or k cannot be written in place, or if a
    write would change an element that is read afterwards (q and k sharing elements, a tensor with
    overlapping elements of its own, a cos/sin/cache/positions table inside q or k)."""
    if is_compiling():
        return  # traced: AOTAutograd's functionalization sees the writes (and Dynamo cannot trace is_inference)
    outputs = [("q", q)] + ([("k", k)] if k is not None else [])
    for name, x in outputs:
        check_writable(x, name)
    if any(type(x) is not torch.Tensor for _, x in outputs) or transforms_active():
        return
    for name, x in outputs:
        if not elements_distinct(x):
            raise ValueError(f"{name} has overlapping memory (several indices address one element): "
                             "an in-place rotation would write those elements twice; pass .contiguous()")
    if k is not None and may_share_elements(q, k):
        raise ValueError("q and k overlap in memory (views sharing elements): in place, the shared "
                         "elements would be rotated twice; nothing was written")
    for name, x in outputs:
        for table_name, table in tables.items():
            if type(table) is torch.Tensor and may_share_elements(x, table):
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


def elements_distinct(x: torch.Tensor) -> bool:
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


def may_share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
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


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def check_out(x: torch.Tensor, out: torch.Tensor, *, elementwise_in_place: bool,
              also: "Optional[dict[str, torch.Tensor]]" = None) -> None:
    """Raise ValueError if ``out`` cannot be written safely by an op reading ``x`` (nothing is written); ``also``:
    more inputs by name, which ``out`` must not share memory with at all (``swiglu``'s ``up``)."""
    if is_compiling():
        return
    check_writable(out, "out")
    if type(out) is not torch.Tensor or type(x) is not torch.Tensor or transforms_active():
        return
    if not elements_distinct(out):
        raise ValueError("out has overlapping memory (several indices address one element, e.g. an expanded "
                         "view): the writes would race; nothing was written (pass a contiguous out)")
    if not (elementwise_in_place and _same_view(x, out)) and may_share_elements(x, out):
        raise ValueError("out overlaps x in memory: elements of x would be overwritten before they are read; "
                         "nothing was written (pass an out that does not share memory with x"
                         + (", or x itself)" if elementwise_in_place else ")"))
    if also is None:
        return
    for name, t in also.items():
        if type(t) is torch.Tensor and may_share_elements(t, out):
            raise ValueError(f"out overlaps {name} in memory: elements of {name} would be overwritten before they "
                             f"are read; nothing was written (pass an out that does not share memory with {name})")
