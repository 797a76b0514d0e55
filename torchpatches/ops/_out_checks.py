"""Checks on an ``out=`` tensor of the fused ops (``swiglu``, ``slices``), made before anything is written.

The Triton kernels write ``out`` behind autograd's back and read ``x`` while they write, so what the
PyTorch tier would refuse (or silently get wrong) must be refused for every tier, with a ``ValueError``
naming the problem, as the RoPE op does for its in-place form (``_rope_checks``):

- ``out`` cannot be written: an inference tensor outside inference mode, a leaf requiring grad (or a
  view of one), a view autograd forbids writing;
- ``out`` has several indices addressing one element (an expanded view): the writes would race;
- ``out`` shares memory with ``x``, unless ``elementwise_in_place`` and ``out`` is exactly ``x`` (same
  elements in the same order: each element is read before it is written, by the same program).

Skipped while traced (AOTAutograd's functionalization sees the writes; FakeTensors have no addresses)
and for tensor subclasses.
"""
from __future__ import annotations

import torch

from .._compat import is_compiling
from ._rope_checks import _elements_distinct, _may_share_elements, check_writable

__all__ = ["check_out"]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def check_out(x: torch.Tensor, out: torch.Tensor, *, elementwise_in_place: bool) -> None:
    """Raise ValueError if ``out`` cannot be written safely by an op reading ``x`` (nothing is written)."""
    if is_compiling():
        return
    check_writable(out, "out")
    if type(out) is not torch.Tensor or type(x) is not torch.Tensor:
        return
    if not _elements_distinct(out):
        raise ValueError("out has overlapping memory (several indices address one element, e.g. an expanded "
                         "view): the writes would race; nothing was written (pass a contiguous out)")
    if elementwise_in_place and _same_view(x, out):
        return
    if _may_share_elements(x, out):
        raise ValueError("out overlaps x in memory: elements of x would be overwritten before they are read; "
                         "nothing was written (pass an out that does not share memory with x"
                         + (", or x itself)" if elementwise_in_place else ")"))
