"""One body for diffusers' table-modulated blocks (``scale_shift_table + temb``), each model's differences as data.

Wan 2.1 / 2.2's ``WanTransformerBlock``, Krea 2's ``Krea2TransformerBlock`` and each stream of LTX-2's
``LTX2VideoTransformerBlock`` run the same glue
between their module calls: a residual (``x + gate * y`` or ``x + y``) followed by the next norm and its modulation
(``norm(x) * (1 + scale) + shift``, or the norm alone), every vector a row of the block's learned table plus a chunk
of the timestep projection. A :class:`Table` row says how a model computes that glue (rounding, norm kind, its
unmodulated norm); :class:`Stream` runs one residual and the norm after it in one ``ops.modulate`` call, or
diffusers' expressions where a tensor does not fit; :func:`run` is the single-stream block (norm, module call,
gated residual, per sublayer). LTX-2 interleaves two streams and its cross-modal attentions read both streams'
norms before either residual, so it sequences :meth:`Stream.step` itself.

A vector is a ``(term, addend)`` pair whose sum is diffusers' vector (the kernel adds the two in its loads, without
a ``[B, S, D]`` tensor of the sum), or ``(vector, None)``: one already formed (Wan 2.1's fp32 chunks). A stream's
vectors are of one form (an op call takes one). The callers check beforehand whether they fit ``x`` (plain tensors
on its device, of its dtype, or any float dtype with ``once``; ``[B, D]`` or ``[B, 1 or S, D]``) and which norms are
stock.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from ._modulate_calls import _rows_fit, _vectors_fit, modulate_ops
from ._fused_common import stock

Vector = Tuple[torch.Tensor, Optional[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Table:
    """How one table-modulated block computes its glue (diffusers 0.42.1).

    - ``once``: fp32 arithmetic rounded once to x's dtype (Wan's ``(x.float() + y * gate).type_as(x)`` and
      ``(norm(x.float()) * (1 + scale) + shift).type_as(x)``), not diffusers' rounding after each op (LTX-2);
    - ``rms``: the norms are diffusers' weightless ``RMSNorm`` (LTX-2) rather than ``FP32LayerNorm`` without affine;
    - ``zero_centered``: the norms are zero-centered RMSNorms with a ``[D]`` weight (Krea 2's ``x * (1 + weight)``);
    - ``affine_plain``: the unmodulated norm is an affine ``FP32LayerNorm`` (Wan's ``norm2``, fused with the gated
      residual before it where it is stock), rather than the block's norm kind computed as a modulation by zero
      and negative zero (LTX-2's ``norm2``: ``n * (1 + 0) + (-0.0)`` is ``n`` exactly, signs of zeros included)."""

    once: bool
    rms: bool = False
    zero_centered: bool = False
    affine_plain: bool = False


def _sum(v: Vector, once: bool) -> torch.Tensor:
    """A vector as diffusers forms it: ``table + temb`` (``+ temb.float()`` with ``once``; the same sum whatever
    the order of the terms)."""
    term, addend = v
    if addend is None:
        return term
    if term.dim() == 2:  # a [B, D] table row: diffusers' [:, None]
        term = term[:, None]
    if addend.dim() == 2:
        addend = addend[:, None]
    return term + (addend.float() if once else addend)


#: ``[D]`` zeros and negative zeros per (device, dtype, width): ``n * (1 + 0) + (-0.0)`` is ``n`` exactly (also for
#: ``n = -0.0``, NaN and infinities), so the modulate op's norm + modulation computes a plain norm with them.
_IDENTITY: dict = {}


def identity(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``([B, 1, D] zeros, [B, 1, D] negative zeros)`` for x (expanded views of cached ``[D]`` tensors)."""
    key = (x.device, x.dtype, x.shape[-1])
    pair = _IDENTITY.get(key)
    if pair is None:
        with torch.inference_mode(False):
            zero = torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device)
            pair = _IDENTITY[key] = (zero, torch.full_like(zero, -0.0))
    B = x.shape[0]
    return pair[0].expand(B, 1, x.shape[-1]), pair[1].expand(B, 1, x.shape[-1])


def _fp32_layer_norm() -> type:
    return sys.modules["diffusers.models.normalization"].FP32LayerNorm  # loaded with the targets' modules


def plain_fp32_layer_norm(norm: Any, width: int) -> bool:
    """A stock ``FP32LayerNorm(width)`` without weight and bias (Wan's norm1 and norm3)."""
    return stock(norm, _fp32_layer_norm()) and norm.weight is None and norm.bias is None \
        and tuple(norm.normalized_shape) == (width,)


def _affine(norm: Any, x: torch.Tensor) -> bool:
    """A stock affine ``FP32LayerNorm(D)`` (Wan's ``cross_attn_norm``) with plain weight and bias on x's device."""
    if not stock(norm, _fp32_layer_norm()) or tuple(norm.normalized_shape) != (x.shape[-1],):
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype in (torch.float32, torch.bfloat16,
                                                                             torch.float16)
               and t.shape == (x.shape[-1],) and t.device == x.device for t in (norm.weight, norm.bias))


class Stream:
    """One stream's activations ``x`` through a block of :class:`Table` ``row``; ``fits``: its vectors fit x (else
    every step computes diffusers' expressions); ``two``: they are two-term pairs (else formed vectors)."""

    __slots__ = ("row", "x", "fits", "two")

    def __init__(self, row: Table, x: torch.Tensor, fits: bool = True, two: bool = True) -> None:
        self.row, self.x, self.fits, self.two = row, x, fits, two

    def _residual(self, gate: Optional[Vector], y: Any, float_y: bool) -> torch.Tensor:
        """diffusers' residual: ``x + y * gate`` (``x + y`` without gate), in fp32 rounded once with ``once``
        (``float_y``: Wan's ``y.float() * gate`` after the feed-forward)."""
        x = self.x
        if gate is None:
            return x + y
        if self.row.once:
            return (x.float() + (y.float() if float_y else y) * _sum(gate, True)).type_as(x)
        return x + y * _sum(gate, False)

    def _normed(self, norm: Any, scale: Optional[Vector], shift: Optional[Vector]) -> torch.Tensor:
        """diffusers' ``norm(x) * (1 + scale) + shift`` (the norm alone without scale), around ``x.float()`` and
        rounded once with ``once``."""
        x, once = self.x, self.row.once
        out = norm(x.float()) if once else norm(x)
        if scale is not None:
            out = out * (1 + _sum(scale, once)) + _sum(shift, once)
        return out.type_as(x) if once else out

    def step(self, gate: Optional[Vector], y: Any, scale: Optional[Vector] = None, shift: Optional[Vector] = None,
             norm: Any = None, norm_fits: bool = True, float_y: bool = False) -> Optional[torch.Tensor]:
        """``x = x + gate * y`` (``x + y`` without gate; nothing without ``y``), then with ``norm``
        ``norm(x) * (1 + scale) + shift`` (the plain norm for ``scale`` None), returned: one kernel where ``y`` and
        the vectors fit and the norm is stock (``norm_fits``), else diffusers' expressions for what does not."""
        x = self.x
        if not (self.fits and norm_fits) or (y is not None and not (  # _rows_fit, inlined: hot
                type(y) is torch.Tensor and y.shape == x.shape and y.dtype == x.dtype and y.device == x.device)):
            return self._unfused(gate, y, scale, shift, norm, norm_fits, float_y)
        row = self.row
        g = g2 = s = s2 = h = h2 = eps = weight = None
        if gate is not None:
            g, g2 = gate
        if norm is not None:
            if scale is None:
                if row.affine_plain:
                    return self._affine_norm(gate, y, norm)
                s, h = identity(x)  # the plain norm: a modulation by zero and negative zero
                s2, h2 = (s, h) if self.two else (None, None)
            else:
                (s, s2), (h, h2) = scale, shift
            eps = norm.eps
            if row.zero_centered:
                weight = norm.weight
        outs = modulate_ops().prechecked(x, g, y, s, h, eps, once=row.once, rms=row.rms, norm_weight=weight,
                                         addends=(g2, s2, h2) if self.two else None)
        if y is not None:
            self.x = outs[0]
        return outs[-1] if norm is not None else None

    def _unfused(self, gate: Optional[Vector], y: Any, scale: Optional[Vector], shift: Optional[Vector], norm: Any,
                 norm_fits: bool, float_y: bool) -> Optional[torch.Tensor]:
        """:meth:`step` in diffusers' expressions; after a branch of another form the norm still in one kernel
        where it fits."""
        x = self.x
        if y is not None:
            self.x = self._residual(gate, y, float_y)
            if norm is None:
                return None
            if not _rows_fit(x, self.x):  # promoted or broadcast: diffusers' expressions from here on
                self.fits = False
            elif self.fits and norm_fits:
                return self.step(None, None, scale, shift, norm)
        return self._normed(norm, scale, shift)

    def _affine_norm(self, gate: Optional[Vector], y: Any, norm: Any) -> torch.Tensor:
        """The gated residual and an unmodulated affine ``FP32LayerNorm`` in one pass where the norm is stock
        (the gate then formed: the affine form takes one-term vectors); else the residual fused alone and the norm
        called as diffusers calls it."""
        x = self.x
        if gate is not None and _affine(norm, x):
            g = _sum(gate, True)
            if _vectors_fit(x, g, rounding="once"):
                self.x, out = modulate_ops().gate_residual_layer_norm(x, g, y, norm.weight, norm.bias, eps=norm.eps,
                                                                      rounding="once")
                return out
        if y is not None:
            self.step(gate, y)
        return self._normed(norm, None, None)


#: One sublayer of a single-stream block: its norm, whether that norm is stock (else diffusers' norm expression),
#: its ``(scale, shift)`` (None: an unmodulated norm), what is called on the norm's output (a module, or a function
#: taking it first) with the arguments after it, and the gate of its residual (None: ``x + out``).
Sublayer = Tuple[Any, bool, Optional[Tuple[Vector, Vector]], Callable[..., Any], tuple, Optional[Vector]]


def run(stream: Stream, sublayers: Sequence[Sublayer], float_y: bool = False) -> torch.Tensor:
    """A single-stream block: per sublayer the previous residual fused with this norm and its modulation, the
    module call, and last the final residual (``float_y``: diffusers' ``y.float() * gate`` there)."""
    gate = out = None
    for norm, norm_fits, modulation, module, args, next_gate in sublayers:
        scale, shift = modulation if modulation is not None else (None, None)
        out = module(stream.step(gate, out, scale, shift, norm, norm_fits), *args)
        gate = next_gate
    stream.step(gate, out, float_y=float_y)
    return stream.x
