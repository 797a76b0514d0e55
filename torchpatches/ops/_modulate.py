"""adaLN-style fused ops for DiTs: LayerNorm + modulate, gate + residual, and both in one pass.

Usable without any patching::

    out = layer_norm_modulate(x, scale, shift, eps=1e-6)          # LN(x) * (1 + scale) + shift
    h = gate_residual(residual, gate, y)                          # residual + gate * y
    h = gate_residual(residual, gate, y, y2=y2)                   # residual + gate * (y + y2): FLUX.3's attn + ff
    h, out = gate_residual_layer_norm_modulate(residual, gate, y, scale, shift, eps=1e-6)
    h, out = residual_layer_norm_modulate(residual, y, scale, shift, eps=1e-6)  # residual + y, no gate
    h, out = gate_residual_layer_norm(residual, gate, y, weight, bias, eps=1e-6)  # affine LN(h)
    out = rms_norm_modulate(x, weight, scale, shift, eps=1e-5)    # (1 + scale) * RMSNorm0(x) + shift
    h, out = gate_residual_rms_norm_modulate(residual, gate, y, weight, scale, shift, eps=1e-5)

``x``/``residual``/``y`` are ``[B, S, D]`` (last dim unit-stride; other strides free); ``scale``,
``shift`` and ``gate`` are ``[B, D]`` (one vector per sample, diffusers' adaLN-Zero chunks),
``[B, 1, D]`` (FLUX.2's modulation) or ``[B, S, D]`` (per-token, FLUX.2's KV-cache blend). The
LayerNorm has no affine parameters (diffusers' ``elementwise_affine=False``), except in
``gate_residual_layer_norm``: a LayerNorm with ``[D]`` weight and bias and no modulation (Wan's
``cross_attn_norm``), ``round(LN(h) * weight + bias)`` computed in fp32 and rounded once, as torch's
LayerNorm kernel. All tensors share one device; outputs are new contiguous tensors of ``x``'s dtype
(fp32, bf16, fp16).

``rms_norm_modulate`` / ``gate_residual_rms_norm_modulate`` put Krea 2's zero-centered RMSNorm
(``Krea2RMSNorm``: ``F.rms_norm(h.float(), weight=weight + 1.0).to(h.dtype)``, a ``[D]`` weight of any float
dtype, ``1 + weight`` rounded to it) where the LayerNorm is, with the ``"each"`` rounding around it; ``weight=None``
puts diffusers' weightless ``RMSNorm`` there (``elementwise_affine=False``, LTX-2's block norms: ``round(x * rstd)``).

Two rounding modes (``rounding=``):

- ``"each"`` (default; diffusers' FLUX blocks): the vectors have ``x``'s dtype and every op rounds, as
  below;
- ``"once"`` (Wan's ``(norm(x.float()) * (1 + scale) + shift).type_as(x)``): the vectors may have any
  float dtype (Wan: an fp32 ``scale_shift_table``), everything is computed in fp32 and rounded once to
  ``x``'s dtype (``h`` of the gated form too: ``(x.float() + y * gate).type_as(x)``).

Numerics: what diffusers computes, rounded where diffusers rounds. In bf16 diffusers runs
``LN(x)`` (fp32 statistics, one rounding), ``1 + scale``, ``* ``, ``+`` and ``gate * y``,
``residual + ...`` as separate bf16 ops, each rounding its fp32 result; the fused kernel rounds at
the same points (``_triton_common._round_to``), so results are bit-identical except where the fp32
LayerNorm statistics differ in their last bit (another summation order) and that crosses a rounding
boundary: then one ulp of the LayerNorm output, carried through the modulation. ``clip_fp16=True``
applies diffusers' fp16 ``clip(-65504, 65504)`` to the residual output.

Tiers (``_tiers``): Triton on CUDA (one program per token row), PyTorch elsewhere (the reference) and
for every call autograd records (the kernel has no backward; ``tier="triton"`` then raises
``ValueError``). Traced, each function is one ``torchpatches::modulate`` custom op with a fake
(``_dispatch``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .._core.lazy import lazy_module
from ._runtime import args as _args, dispatch as _dispatch
from . import _modulate_torch
from ._runtime.tiers import FLOAT_DTYPES, choose_tier, force_tier, needs_grad

__all__ = ["layer_norm_modulate", "gate_residual", "gate_residual_layer_norm_modulate",
           "residual_layer_norm_modulate", "gate_residual_layer_norm", "rms_norm_modulate",
           "gate_residual_rms_norm_modulate", "force_tier", "ROUNDINGS"]

#: ``"each"``: diffusers' rounding after every op; ``"once"``: fp32 compute rounded once (Wan's ``.type_as``).
ROUNDINGS = ("each", "once")


def _vector(t: Optional[torch.Tensor], name: str, ref: torch.Tensor, once: bool) -> Optional[torch.Tensor]:
    """[B, D], [B, 1, D] or [B, S, D] as is (both tiers broadcast a [B, D] vector over the tokens; no
    ``unsqueeze`` view per call: host time); ValueError for anything else."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    B, S, D = ref.shape
    shape = t.shape
    if not (len(shape) == 2 and shape[0] == B and shape[1] == D) and (
            len(shape) != 3 or shape[0] != B or shape[2] != D or shape[1] not in (1, S)):
        raise ValueError(f"{name} must be [B, D], [B, 1, D] or [B, S, D] for input {tuple(ref.shape)}, "
                         f"got {tuple(t.shape)}")
    if t.device != ref.device or (t.dtype not in FLOAT_DTYPES if once else t.dtype != ref.dtype):
        want = "a float dtype" if once else f"{ref.dtype} (rounding='once' takes other float dtypes)"
        raise ValueError(f"{name} is {t.dtype} on {t.device}; expected {want} on {ref.device}")
    return t if t.stride(-1) == 1 or D == 1 else t.contiguous()


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    _args.float_tensor(t, name, 3, "[B, S, D]")
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _affine(t: torch.Tensor, name: str, ref: torch.Tensor, once: bool) -> torch.Tensor:
    """A LayerNorm's ``[D]`` weight or bias (x's dtype, or any float dtype with rounding='once')."""
    if not isinstance(t, torch.Tensor) or t.shape != ref.shape[-1:]:
        raise ValueError(f"{name} must be a [{ref.shape[-1]}] tensor, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.device != ref.device or (t.dtype not in FLOAT_DTYPES if once else t.dtype != ref.dtype):
        raise ValueError(f"{name} is {t.dtype} on {t.device}; expected a float dtype on {ref.device}")
    return t.contiguous()


def _like_residual(y: torch.Tensor, name: str, residual: torch.Tensor) -> torch.Tensor:
    y = _rows(y, name)
    if y.shape != residual.shape or y.dtype != residual.dtype or y.device != residual.device:
        raise ValueError(f"{name} {tuple(y.shape)} {y.dtype} on {y.device} does not match residual "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    return y


def _prepare(residual, gate, y, scale, shift, once, affine=False):
    residual = _rows(residual, "x" if y is None else "residual")
    if y is not None:
        y = _like_residual(y, "y", residual)
    if affine:
        return (residual, _vector(gate, "gate", residual, once), y, _affine(scale, "weight", residual, once),
                _affine(shift, "bias", residual, once))
    return (residual, _vector(gate, "gate", residual, once), y, _vector(scale, "scale", residual, once),
            _vector(shift, "shift", residual, once))


def _impl(residual: torch.Tensor, gate: Optional[torch.Tensor], y: Optional[torch.Tensor],
          scale: Optional[torch.Tensor], shift: Optional[torch.Tensor], eps: float, clip: bool,
          once: bool, tier: str, affine: bool = False, norm_weight: Optional[torch.Tensor] = None,
          y2: Optional[torch.Tensor] = None, addends: Optional[tuple] = None,
          norm_out: Optional[torch.Tensor] = None, select: Optional[torch.Tensor] = None,
          rms: bool = False) -> list[torch.Tensor]:
    """The op body: [h] (residual only), [out] (norm only) or [h, out]. ``y`` without ``gate``: a plain
    residual add; ``affine``: ``scale``/``shift`` are a LayerNorm's [D] weight and bias; ``addends``
    (``prechecked`` only): the second terms ``(gate2, scale2, shift2)`` of two-term vectors (see there);
    ``norm_weight``: a zero-centered RMSNorm's [D] weight (Krea 2's) in place of the LayerNorm; ``rms`` without it:
    diffusers' weightless RMSNorm there (LTX-2's); ``y2``: a second branch output, ``y + y2`` rounded to the dtype
    before the gate (FLUX.3's ``attn_output + ff_output``); ``norm_out`` (``prechecked`` only): where the norm's
    output goes (a ``[B, S, D]`` view, e.g. rows of a joint buffer that ``torch.cat`` would fill); ``select``
    (``prechecked`` only): a bool [S] token mask choosing each token's vector row (see there)."""
    if tier == "torch":
        if select is not None:  # QwenImage 2.1's _select_modulation_rows, per vector
            gate, scale, shift = (None if v is None else _modulate_torch.select_rows(v, select)
                                  for v in (gate, scale, shift))
        if y2 is not None:  # diffusers: attn_output + ff_output, in their dtype
            y = y + y2
        if addends is not None:  # Wan: (scale_shift_table + temb.float()), the fp32 sum; Krea 2: temb + table
            gate, scale, shift = (None if v is None else _modulate_torch.tokens(v) + (w.float() if once else w)
                                  for v, w in zip((gate, scale, shift), addends))
        h, out = _modulate_torch.apply(residual, gate, y, scale, shift, eps, clip, once, affine, norm_weight, rms)
        if norm_out is not None and out is not None:
            out = norm_out.copy_(out)
    else:
        # empty_like: a third of torch.empty(shape, dtype=, device=)'s host time (its arguments are parsed in C++)
        h = torch.empty_like(residual, memory_format=torch.contiguous_format) if y is not None else None
        out = None if scale is None else norm_out if norm_out is not None else \
            torch.empty_like(residual, memory_format=torch.contiguous_format)
        _triton_tier().launch(residual, gate, y, scale, shift, h, out, eps=eps, clip=clip, once=once, affine=affine,
                              addends=addends, norm_weight=norm_weight, y2=y2, select=select, rms=rms)
    return [t for t in (h, out) if t is not None]


#: The Triton tier's module, imported at its first call (it imports triton).
_triton_tier = lazy_module(f"{__package__}._modulate_triton")


@torch.library.custom_op("torchpatches::modulate", mutates_args=())
def _modulate_op(residual: torch.Tensor, gate: Optional[torch.Tensor], y: Optional[torch.Tensor],
                 scale: Optional[torch.Tensor], shift: Optional[torch.Tensor], eps: float, clip: bool,
                 once: bool, tier: str, affine: bool = False, norm_weight: Optional[torch.Tensor] = None,
                 y2: Optional[torch.Tensor] = None, rms: bool = False) -> list[torch.Tensor]:
    return _impl(residual, gate, y, scale, shift, eps, clip, once, tier, affine, norm_weight, y2, rms=rms)


@_modulate_op.register_fake
def _(residual, gate, y, scale, shift, eps, clip, once, tier, affine=False, norm_weight=None, y2=None, rms=False):
    n = int(y is not None) + int(scale is not None)
    return [torch.empty_like(residual, memory_format=torch.contiguous_format) for _ in range(n)]


def _op_body(*args):
    """:func:`_impl` with the custom op's arguments (``rms`` last, after ``y2``; no ``addends`` or ``norm_out``)."""
    return _impl(*args[:12], rms=args[12])


@_dispatch.public
def _run(residual, gate, y, scale, shift, eps, clip, tier, gated, rounding, affine=False, norm_weight=None,
         y2=None, rms=False):
    if gated and gate is None:
        raise ValueError("gate must be a torch.Tensor, got None")
    if y is None and gate is not None:
        raise ValueError("gate needs y")
    if scale is not None and (shift is None or eps is None):
        raise ValueError("scale needs shift and eps")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    once = rounding == "once"
    eps = None if eps is None else _args.number(eps, "eps")
    residual, gate, y, scale, shift = _prepare(residual, gate, y, scale, shift, once, affine)
    if norm_weight is not None:
        norm_weight = _affine(norm_weight, "weight", residual, True)  # any float dtype: 1 + weight rounds to it
    if y2 is not None:
        y2 = _like_residual(y2, "y2", residual)
    grad = needs_grad(residual, gate, y, scale, shift, norm_weight, y2)
    chosen = choose_tier(residual.device.type, tier, grad)
    return _dispatch.run(residual, grad, _op_body, _modulate_op, residual, gate, y, scale, shift,
                         float(eps or 0.0), bool(clip), once, chosen, bool(affine), norm_weight, y2, bool(rms))


def prechecked(residual: torch.Tensor, gate: Optional[torch.Tensor], y: Optional[torch.Tensor],
               scale: Optional[torch.Tensor], shift: Optional[torch.Tensor], eps: float, *, clip: bool = False,
               once: bool = False, addends: Optional[tuple] = None, norm_weight: Optional[torch.Tensor] = None,
               y2: Optional[torch.Tensor] = None, norm_out: Optional[torch.Tensor] = None,
               select: Optional[torch.Tensor] = None, rms: bool = False) -> list[torch.Tensor]:
    """The op (``[h]``, ``[out]`` or ``[h, out]``, as :func:`_impl`) for a caller that has already checked what the
    public entries check: the fusion patterns (``patches/_modulate_calls``), which test the same conditions before
    they choose the fused path. Skipped: the argument checks (plain ``torch.Tensor``s of a served dtype on one
    device, ``[B, S, D]`` rows, vectors of a shape and dtype that fit, ``eps`` a number, no ``gate`` without ``y``),
    the ``torch.jit.trace`` / torch.compile / functorch handling (the patterns step aside for all of them) -- tens
    of microseconds of host time per call on a slow host, 191 calls per FLUX.1 step. Kept: everything that decides
    the result without costing much: unit-stride copies, a forced tier, the PyTorch tier when autograd records.
    Not the affine form. Wrong arguments here are the caller's bug: they may fail inside the kernel.

    ``addends``: ``(gate2, scale2, shift2)``, each vector given (not None) then the sum of its two terms, added in
    the kernel as torch adds them: ``once``, Wan 2.2 TI2V's fp32 ``scale_shift_table + temb.float()`` without its
    ``[B, S, 6, D]`` fp32 tensor; else Krea 2's ``temb + scale_shift_table`` (one dtype, the sum rounded). Each term
    ``[B, D]`` (the table row, expanded: batch stride 0) or ``[B, S or 1, D]`` (a temb chunk, any row strides).
    ``norm_weight``: Krea 2's zero-centered RMSNorm (``1 + weight``, any float dtype) in place of the LayerNorm;
    ``rms`` without it: diffusers' weightless RMSNorm there (LTX-2's).

    ``y2``: a second branch output of ``y``'s shape and dtype, ``h = residual + gate * (y + y2)`` (FLUX.3's
    ``attn_output + ff_output``, rounded as torch rounds it). ``norm_out``: a ``[B, S, D]`` view of x's dtype and
    device (unit-stride rows, not overlapping an input) that receives the norm's output, returned in its place: the
    rows of a joint buffer (FLUX.3's ``torch.cat([text, image])``) written without the cat's pass.
    ``select``: a bool ``[S]`` tensor on x's device (any stride), every vector then ``[B + 1, D]`` (unit-stride rows,
    any row stride; not with ``addends``): token ``s`` of sample ``b`` reads row ``b`` where ``select[s]``, else row
    ``B``, as QwenImage 2.1's ``_select_modulation_rows`` selects them (the target image's tokens their sample's
    timestep, the text and condition images ``t = 0``), without its ``[B, S, D]`` tensors."""
    # Unit-stride rows, as _prepare makes them; written out: five calls of a helper cost more than the rest here.
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    if y is not None and y.stride(-1) != 1:
        y = y.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    if scale is not None and scale.stride(-1) != 1:
        scale = scale.contiguous()
    if shift is not None and shift.stride(-1) != 1:
        shift = shift.contiguous()
    if y2 is not None and y2.stride(-1) != 1:
        y2 = y2.contiguous()
    # Inference runs without grad mode: then nothing else is read.
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (residual, gate, y, scale, shift, norm_weight, y2))
    if addends is not None:
        addends = tuple(t if t is None or t.stride(-1) == 1 else t.contiguous() for t in addends)
        grad = grad or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in addends))
    tier = choose_tier(residual.device.type, None, grad)
    return _impl(residual, gate, y, scale, shift, float(eps or 0.0), clip, once, tier, False, norm_weight=norm_weight,
                 y2=y2, addends=addends, norm_out=norm_out, select=select, rms=rms)


def layer_norm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    eps: float = 1e-6,
    rounding: str = "each",
    tier: Optional[str] = None,
) -> torch.Tensor:
    """``LayerNorm(x) * (1 + scale) + shift`` (LayerNorm without affine), rounded per ``rounding``.

    Raises:
        ValueError: on shapes, dtypes or devices that do not fit (see the module docstring).
    """
    return _run(x, None, None, scale, shift, eps, False, tier, False, rounding)[0]


def gate_residual(
    residual: torch.Tensor,
    gate: torch.Tensor,
    y: torch.Tensor,
    *,
    clip_fp16: bool = False,
    rounding: str = "each",
    y2: Optional[torch.Tensor] = None,
    tier: Optional[str] = None,
) -> torch.Tensor:
    """``residual + gate * y`` (``gate`` broadcast over tokens), rounded per ``rounding``; with ``y2`` (of y's
    shape, dtype and device), ``residual + gate * (y + y2)``, ``y + y2`` rounded to the dtype first as torch adds
    them (FLUX.3's ``hidden_states + mod_gate * (attn_output + ff_output)``)."""
    return _run(residual, gate, y, None, None, None, clip_fp16, tier, True, rounding, y2=y2)[0]


def gate_residual_layer_norm_modulate(
    residual: torch.Tensor,
    gate: torch.Tensor,
    y: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    eps: float = 1e-6,
    clip_fp16: bool = False,
    rounding: str = "each",
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * y`` and ``LayerNorm(h) * (1 + scale) + shift`` in one pass: ``(h, out)``."""
    h, out = _run(residual, gate, y, scale, shift, eps, clip_fp16, tier, True, rounding)
    return h, out


def residual_layer_norm_modulate(
    residual: torch.Tensor,
    y: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    eps: float = 1e-6,
    clip_fp16: bool = False,
    rounding: str = "each",
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + y`` (no gate: Wan's cross-attention residual) and ``LayerNorm(h) * (1 + scale) + shift``
    in one pass: ``(h, out)``. ``h`` rounds once in both modes (one add)."""
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"y must be a torch.Tensor, got {type(y).__name__}")
    h, out = _run(residual, None, y, scale, shift, eps, clip_fp16, tier, False, rounding)
    return h, out


def gate_residual_layer_norm(
    residual: torch.Tensor,
    gate: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    eps: float = 1e-6,
    clip_fp16: bool = False,
    rounding: str = "each",
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * y`` and ``LayerNorm(h)`` with ``[D]`` ``weight`` and ``bias`` (no modulation)
    in one pass: ``(h, out)``. Wan's ``cross_attn_norm``: ``rounding="once"``, weight and bias of any float
    dtype (``FP32LayerNorm`` computes in fp32: ``norm2(h.float()).type_as(h)``)."""
    if weight is None or bias is None:
        raise ValueError("weight and bias must both be tensors")
    h, out = _run(residual, gate, y, weight, bias, eps, clip_fp16, tier, True, rounding, affine=True)
    return h, out


def rms_norm_modulate(x: torch.Tensor, weight: Optional[torch.Tensor], scale: torch.Tensor, shift: torch.Tensor, *,
                      eps: float = 1e-5, tier: Optional[str] = None) -> torch.Tensor:
    """``(1 + scale) * RMSNorm0(x) + shift`` with Krea 2's zero-centered RMSNorm (``weight``: its ``[D]`` weight,
    any float dtype), rounded as diffusers' ``Krea2TransformerBlock``; ``weight=None``: diffusers' weightless
    ``RMSNorm`` (LTX-2's ``norm(x) * (1 + scale) + shift``)."""
    if weight is not None and not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
    return _run(x, None, None, scale, shift, eps, False, tier, False, "each", norm_weight=weight, rms=True)[0]


def gate_residual_rms_norm_modulate(
    residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, weight: Optional[torch.Tensor], scale: torch.Tensor,
    shift: torch.Tensor, *, eps: float = 1e-5, tier: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * y`` and ``(1 + scale) * RMSNorm0(h) + shift`` (Krea 2's zero-centered RMSNorm; ``weight``
    None: diffusers' weightless RMSNorm) in one pass: ``(h, out)``."""
    if weight is not None and not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
    h, out = _run(residual, gate, y, scale, shift, eps, False, tier, True, "each", norm_weight=weight, rms=True)
    return h, out
