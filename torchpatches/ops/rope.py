"""Rotary position embedding (RoPE) for q and k in one call: FlashInfer -> Triton -> PyTorch.

Usable without any patching. Four public entry points, two cos/sin forms times in-place/out-of-place::

    apply_rope_qk_inplace(q, k, cos, sin, *, interleaved=True, ...)                 -> None
    apply_rope_qk(q, k, cos, sin, *, interleaved=True, ...)                         -> (q_out, k_out)
    apply_rope_qk_with_cache_inplace(q, k, cos_sin_cache, positions, *, interleaved, ...) -> None
    apply_rope_qk_with_cache(q, k, cos_sin_cache, positions, *, interleaved, ...)   -> (q_out, k_out)

Layouts of q and k (``sequence_dim`` says where the tokens are; the head dim is the other one):

- ``[T, H, D]`` token-major (LLM serving), ``sequence_dim=0`` (the default for 3-D);
- ``[B, S, H, D]``, ``sequence_dim=1`` (the default for 4-D; diffusers' FLUX attention processor);
- ``[B, H, S, D]``, ``sequence_dim=2`` (diffusers' ``apply_rotary_emb`` default).

Any strides work as long as the last dim is unit-stride (views such as transposes or slices of a
fused qkv projection); a tensor whose last dim is strided is copied for the Triton tier (and written
back for in-place calls). q and k may have different head counts (GQA); ``k=None`` rotates q only.

Pair conventions (``interleaved``):

- ``True``: GPT-J pairs ``(x[2i], x[2i+1])``, diffusers ``use_real_unbind_dim=-1`` (FLUX);
- ``False``: NeoX/LLaMA halves ``(x[i], x[i + rotary_dim/2])``, diffusers ``use_real_unbind_dim=-2``.

Only the first ``rotary_dim`` elements of each head rotate; the rest pass through unchanged.
Math is fp32 whatever the input dtype (fp32, bf16, fp16), rounded once to the input dtype.

Tiers (``describe_tiers()`` says which exist and why not; ``last_tier()`` says which one ran):

- ``flashinfer``: ``flashinfer.rope.apply_rope_with_cos_sin_cache[_inplace]`` on CUDA for the cache
  form with token-major, fp16/bf16 q and k (both given), head dim 64/128/256;
- ``triton``: one launch for q and k, on CUDA (``torch.library.triton_op`` so Inductor sees the
  kernel), and on CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` (for CI);
- ``torch``: plain PyTorch ops, which Inductor fuses with neighbouring ops under torch.compile.

Choose a tier with ``tier=`` on a call or ``force_tier(...)`` for a block (tests, benchmarks).
Falling back from a tier whose software is missing warns once; the availability query runs
through ``torch.compiler.assume_constant_result``, so it costs no graph break.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
from typing import Any, Iterator, Optional, Tuple

import torch

from .._compat import assume_constant, emit_log_once, emit_warning_once, is_compiling, reset_once

__all__ = [
    "apply_rope_qk_inplace",
    "apply_rope_qk",
    "apply_rope_qk_with_cache_inplace",
    "apply_rope_qk_with_cache",
    "describe_tiers",
    "last_tier",
    "force_tier",
    "TIERS",
]

log = logging.getLogger("torchpatches")

TIERS = ("flashinfer", "triton", "torch")
_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLASHINFER_HEAD_DIMS = (64, 128, 256)

_FORCED_TIER: Optional[str] = None
_LAST_TIER: Optional[str] = None

#: What tier selection answers: ``(tier, None)``, or ``(None, why the requested tier cannot run the
#: call)``. Plain constants, because under torch.compile Dynamo folds the answer into the graph.
TierChoice = Tuple[Optional[str], Optional[str]]


# ---------------------------------------------------------------------------------------------
# Tier availability: facts that do not change while a program runs (cached once found).
# ---------------------------------------------------------------------------------------------


def _warn_fallback(message: str) -> None:
    """Log and warn (RuntimeWarning) once per message. Runs in Python: eager, or while Dynamo traces
    the constant-folded tier choice, so a message costs no graph break."""
    emit_log_once(log, logging.WARNING, message)
    emit_warning_once(message, RuntimeWarning, stacklevel=3)


@functools.cache
def _flashinfer_rope() -> tuple[Any, str]:
    """(flashinfer.rope module or None, reason). Imports flashinfer only when first asked."""
    if importlib.util.find_spec("flashinfer") is None:
        return None, "flashinfer is not installed"
    try:
        mod = importlib.import_module("flashinfer.rope")
    except Exception as e:  # a broken install must not break RoPE: fall back and say why
        return None, f"import flashinfer.rope failed: {type(e).__name__}: {e}"
    for name in ("apply_rope_with_cos_sin_cache_inplace", "apply_rope_with_cos_sin_cache"):
        if not hasattr(mod, name):
            return None, f"flashinfer.rope has no {name} (version too old?)"
    return mod, "available"


@functools.cache
def _triton_import() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        importlib.import_module("torchpatches.ops._rope_triton")
    except Exception as e:
        return False, f"importing the Triton kernel failed: {type(e).__name__}: {e}"
    return True, "available"


def _triton_status(device_type: str) -> tuple[bool, str]:
    ok, why = _triton_import()
    if not ok:
        return ok, why
    if device_type == "cuda":
        return True, "available (compiled)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "available (TRITON_INTERPRET=1: Triton's CPU interpreter, slow; for tests)"
    return False, f"no Triton backend for {device_type} (set TRITON_INTERPRET=1 to interpret on CPU)"


def describe_tiers(device_type: str = "cuda") -> dict[str, tuple[bool, str]]:
    """For each tier, (available for tensors on ``device_type``, why or why not)."""
    fi, why = _flashinfer_rope()
    if fi is not None and device_type != "cuda":
        fi, why = None, "flashinfer runs on CUDA only"
    return {
        "flashinfer": (fi is not None, why if fi is None else why + " (cache form, token-major only)"),
        "triton": _triton_status(device_type),
        "torch": (True, "always available"),
    }


def last_tier() -> Optional[str]:
    """The tier chosen by the most recent call (under torch.compile: when it was traced)."""
    return _LAST_TIER


@contextlib.contextmanager
def force_tier(tier: Optional[str]) -> Iterator[None]:
    """Use ``tier`` for every call inside the block (None: automatic). Set it before compiling."""
    global _FORCED_TIER
    if tier is not None and tier not in TIERS:
        raise ValueError(f"unknown RoPE tier {tier!r}; expected one of {TIERS}")
    old, _FORCED_TIER = _FORCED_TIER, tier
    try:
        yield
    finally:
        _FORCED_TIER = old


def _reset_caches() -> None:
    """For tests that inject or remove a stand-in flashinfer module."""
    global _LAST_TIER
    _flashinfer_rope.cache_clear()
    _triton_import.cache_clear()
    reset_once()
    _LAST_TIER = None


@assume_constant
def _select_tier(device_type: str, requested: str, cache_form: bool, flashinfer_fits: bool) -> TierChoice:
    """The tier for a call, or why a requested tier cannot run it (see :data:`TierChoice`).

    Only Python constants go in and out, so under torch.compile this runs once at trace time and
    its answer is baked into the graph (no graph break); the warning is emitted from here for the
    same reason.
    """
    global _LAST_TIER
    tier, refusal = _choose(device_type, requested, cache_form, flashinfer_fits)
    if tier == "triton" and device_type == "cuda":
        _ensure_triton_ops()
    if tier is not None:
        _LAST_TIER = tier
    return tier, refusal


def _choose(device_type: str, requested: str, cache_form: bool, flashinfer_fits: bool) -> TierChoice:
    if requested == "torch":
        return "torch", None
    if requested == "triton":
        ok, why = _triton_import()  # forcing Triton on CPU runs the interpreter
        return ("triton", None) if ok else (None, f"tier='triton' requested but {why}")
    if requested == "flashinfer":
        fi, why = _flashinfer_rope()
        if fi is None:
            return None, f"tier='flashinfer' requested but {why}"
        if not (cache_form and flashinfer_fits):
            return None, ("tier='flashinfer' requested but FlashInfer only takes the cos_sin_cache form "
                          "with token-major fp16/bf16 q and k (both given), last two dims dense, "
                          f"head dim in {_FLASHINFER_HEAD_DIMS}")
        return "flashinfer", None
    # automatic
    if device_type == "cuda" and cache_form and flashinfer_fits:
        fi, why = _flashinfer_rope()
        if fi is not None:
            return "flashinfer", None
        _warn_fallback(f"torchpatches RoPE: FlashInfer tier unavailable ({why}); falling back to the Triton tier")
    ok, why = _triton_status(device_type)
    if ok:
        return "triton", None
    if device_type == "cuda":
        _warn_fallback(f"torchpatches RoPE: Triton tier unavailable ({why}); falling back to plain PyTorch")
    else:
        log.debug("torchpatches RoPE on %s uses plain PyTorch: %s", device_type, why)
    return "torch", None


# ---------------------------------------------------------------------------------------------
# Validation: everything is checked before anything is written.
# ---------------------------------------------------------------------------------------------


def _seq_dim(x: torch.Tensor, sequence_dim: Optional[int]) -> int:
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


def _bshd(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """A [B, S, H, D] view of x (no copy)."""
    if x.dim() == 3:
        return x.unsqueeze(0)
    return x if seq_dim == 1 else x.transpose(1, 2)


def _check_qk(q: torch.Tensor, k: Optional[torch.Tensor], seq_dim: int) -> tuple[int, int, int]:
    """Returns (B, S, D) of the [B, S, H, D] view; raises ValueError on any mismatch."""
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; expected float32, bfloat16 or float16")
    B, S, H, D = _bshd(q, seq_dim).shape
    if H < 1 or D < 2:
        raise ValueError(f"q needs at least one head and head_dim >= 2, got shape {tuple(q.shape)}")
    _check_no_overlap(q, "q")
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
    kb, ks, kh, kd = _bshd(k, seq_dim).shape
    if (kb, ks, kd) != (B, S, D):
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch, "
                         "sequence length or head dim (only the head count may differ)")
    if kh < 1:
        raise ValueError(f"k needs at least one head, got shape {tuple(k.shape)}")
    _check_no_overlap(k, "k")
    return B, S, D


def _check_no_overlap(x: torch.Tensor, name: str) -> None:
    # An expanded tensor (stride 0 on a dim of size > 1) would have several outputs in one place.
    for size, stride in zip(x.shape, x.stride()):
        if stride == 0 and size > 1:
            raise ValueError(f"{name} has overlapping memory (an expanded view, stride 0); "
                             "pass a tensor that owns its elements (e.g. .contiguous())")


def _check_rotary_dim(rotary_dim: int, head_dim: int, given: Optional[int]) -> int:
    if given is not None and given != rotary_dim:
        raise ValueError(f"rotary_dim={given} does not match the cos/sin width {rotary_dim}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be positive and even, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} is larger than the head dim {head_dim}")
    return rotary_dim


def _check_table(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _check_per_token(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, S: int, D: int,
                     rotary_dim: Optional[int]) -> int:
    _check_table(cos, "cos", q)
    _check_table(sin, "sin", q)
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin shapes differ: {tuple(cos.shape)} vs {tuple(sin.shape)}")
    if cos.shape[0] != S:
        raise ValueError(f"cos/sin have {cos.shape[0]} rows but the sequence length is {S}; "
                         "expected cos, sin of shape [S, rotary_dim]")
    return _check_rotary_dim(cos.shape[1], D, rotary_dim)


def _check_cache(q: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, B: int, S: int,
                 D: int, rotary_dim: Optional[int]) -> int:
    _check_table(cache, "cos_sin_cache", q)
    r = _check_rotary_dim(cache.shape[1], D, rotary_dim)
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
    _check_positions_range(positions, cache.shape[0])
    return r


def _check_positions_range(positions: torch.Tensor, rows: int) -> None:
    # Only where it is cheap: CPU tensors in eager mode (a GPU check would synchronize, and a
    # data-dependent check would break a graph).
    if positions.device.type != "cpu" or positions.numel() == 0 or is_compiling():
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= rows:
        raise ValueError(f"positions range [{lo}, {hi}] is outside cos_sin_cache rows [0, {rows})")


def _positions_2d(positions: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[S] -> [1, S] (broadcast over batch), [B, S] unchanged."""
    if positions is None:
        return None
    return positions.unsqueeze(0) if positions.dim() == 1 else positions


def _flashinfer_fits(q: torch.Tensor, k: Optional[torch.Tensor], seq_dim: int, D: int,
                     positions: torch.Tensor) -> bool:
    """FlashInfer takes (nnz, H*D) views of q and k with one stride between tokens."""
    if k is None or q.dtype not in (torch.float16, torch.bfloat16) or D not in _FLASHINFER_HEAD_DIMS:
        return False
    if q.dim() == 4 and seq_dim != 1:
        return False
    if q.dim() == 4 and positions.dim() == 1 and q.shape[0] != 1:
        return False  # [S] positions shared across a batch would need a gathered copy
    return all(_tokens_flat(x) for x in (q, k))


def _tokens_flat(x: torch.Tensor) -> bool:
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        return False
    if x.dim() == 4 and x.shape[0] > 1 and x.stride(0) != x.shape[1] * x.stride(1):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# torch.library ops. The Triton tier is a triton_op (Inductor sees and schedules the kernel) on
# CUDA; on CPU (interpreter) and on torch without triton_op it is an opaque custom op with a fake.
# ---------------------------------------------------------------------------------------------


def _triton_body(kernel: Any, q: torch.Tensor, k: Optional[torch.Tensor], q_out: torch.Tensor,
                 k_out: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 positions: Optional[torch.Tensor], sequence_dim: int, interleaved: bool,
                 cos_half: bool) -> None:
    qv = _bshd(q, sequence_dim)
    if qv.shape[0] * qv.shape[1] == 0:
        return
    rotary_dim = cos.shape[1] * (2 if cos_half else 1)
    kv = _bshd(k, sequence_dim) if k is not None else None
    # Same view object for input and output means in place (the launcher checks identity).
    qov = qv if q_out is q else _bshd(q_out, sequence_dim)
    kov = None if k_out is None else (kv if k_out is k else _bshd(k_out, sequence_dim))
    _triton_module().launch(
        kernel, qv, kv, qov, kov, cos, sin, _positions_2d(positions),
        interleaved=interleaved, cos_half=cos_half, rotary_dim=rotary_dim,
    )


_RT: Any = None


def _triton_module() -> Any:
    """torchpatches.ops._rope_triton, imported on first use (it imports triton)."""
    global _RT
    if _RT is None:
        from torchpatches.ops import _rope_triton

        _RT = _rope_triton
    return _RT


def _kernel(device_type: str, wrap: bool) -> Any:
    kernel = _triton_module().kernel_for(device_type)
    if wrap:
        from torch.library import wrap_triton

        return wrap_triton(kernel)
    return kernel


def _triton_inplace_impl(wrap: bool):
    def impl(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             positions: Optional[torch.Tensor], sequence_dim: int, interleaved: bool,
             cos_half: bool) -> None:
        _triton_body(_kernel(q.device.type, wrap), q, k, q, k, cos, sin, positions,
                     sequence_dim, interleaved, cos_half)
    return impl


def _triton_out_impl(wrap: bool):
    def impl(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
             positions: Optional[torch.Tensor], sequence_dim: int, interleaved: bool,
             cos_half: bool) -> list[torch.Tensor]:
        q_out = torch.empty_like(q)
        k_out = torch.empty_like(k) if k is not None else None
        _triton_body(_kernel(q.device.type, wrap), q, k, q_out, k_out, cos, sin, positions,
                     sequence_dim, interleaved, cos_half)
        return [q_out] if k_out is None else [q_out, k_out]
    return impl


# Plain-function versions, used outside torch.compile (no dispatcher overhead).
_eager_triton_inplace = _triton_inplace_impl(False)
_eager_triton_out = _triton_out_impl(False)

_HAS_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")

# Opaque versions: always registered (CPU interpreter, older torch).
_rope_qk_triton_opaque_ = torch.library.custom_op(
    "torchpatches::rope_qk_triton_opaque_", mutates_args=("q", "k"))(_triton_inplace_impl(False))
_rope_qk_triton_opaque = torch.library.custom_op(
    "torchpatches::rope_qk_triton_opaque", mutates_args=())(_triton_out_impl(False))


@_rope_qk_triton_opaque_.register_fake
def _(q, k, cos, sin, positions, sequence_dim, interleaved, cos_half) -> None:
    return None


@_rope_qk_triton_opaque.register_fake
def _(q, k, cos, sin, positions, sequence_dim, interleaved, cos_half) -> list[torch.Tensor]:
    return [torch.empty_like(q)] + ([torch.empty_like(k)] if k is not None else [])


_TRITON_OPS: Optional[tuple[Any, Any]] = None


def _ensure_triton_ops() -> tuple[Any, Any]:
    """(in-place op, out-of-place op) for the Triton tier on CUDA, registered on first need.

    ``torch.library.triton_op`` imports triton and torch._inductor when it registers (it scans
    the function for kernels), so registering at import time would make ``import`` slow. This runs
    from ``_select_tier``, i.e. outside Dynamo's tracing, before any traced code uses the ops.
    The op body runs under FakeTensor mode to build the graph; ``wrap_triton`` records the launch
    so Inductor schedules (and CUDA graphs capture) the kernel itself.
    """
    global _TRITON_OPS
    if _TRITON_OPS is None:
        if _HAS_TRITON_OP:
            _TRITON_OPS = (
                torch.library.triton_op("torchpatches::rope_qk_triton_", mutates_args=("q", "k"))(
                    _triton_inplace_impl(True)),
                torch.library.triton_op("torchpatches::rope_qk_triton", mutates_args=())(
                    _triton_out_impl(True)),
            )
        else:  # pragma: no cover - torch < 2.6: opaque to Inductor, still compiles
            _TRITON_OPS = (_rope_qk_triton_opaque_, _rope_qk_triton_opaque)
    return _TRITON_OPS


def _flashinfer_inplace(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                        positions: torch.Tensor, interleaved: bool) -> None:
    fi, why = _flashinfer_rope()
    if fi is None:
        raise RuntimeError(f"FlashInfer tier called but {why}")
    fi.apply_rope_with_cos_sin_cache_inplace(
        positions=positions.reshape(-1), query=_flat_tokens(q), key=_flat_tokens(k),
        head_size=q.shape[-1], cos_sin_cache=cos_sin_cache, is_neox=not interleaved)


def _flashinfer_out(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                    positions: torch.Tensor, interleaved: bool) -> list[torch.Tensor]:
    fi, why = _flashinfer_rope()
    if fi is None:
        raise RuntimeError(f"FlashInfer tier called but {why}")
    q_out, k_out = fi.apply_rope_with_cos_sin_cache(
        positions=positions.reshape(-1), query=_flat_tokens(q), key=_flat_tokens(k),
        head_size=q.shape[-1], cos_sin_cache=cos_sin_cache, is_neox=not interleaved)
    # FlashInfer returns fresh (nnz, H*D) tensors; a custom op may not return views of its inputs.
    return [q_out.view(q.shape), k_out.view(k.shape)]


# FlashInfer's own functions are not all registered ops in every version: wrap them in ours.
_rope_qk_flashinfer_ = torch.library.custom_op(
    "torchpatches::rope_qk_flashinfer_", mutates_args=("q", "k"))(_flashinfer_inplace)
_rope_qk_flashinfer = torch.library.custom_op(
    "torchpatches::rope_qk_flashinfer", mutates_args=())(_flashinfer_out)


@_rope_qk_flashinfer_.register_fake
def _(q, k, cos_sin_cache, positions, interleaved) -> None:
    return None


@_rope_qk_flashinfer.register_fake
def _(q, k, cos_sin_cache, positions, interleaved) -> list[torch.Tensor]:
    return [torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device)]


def _flat_tokens(x: torch.Tensor) -> torch.Tensor:
    """(nnz, H*D) view of a token-major [T, H, D] or [B, S, H, D] tensor (checked by _tokens_flat)."""
    hd = x.shape[-2] * x.shape[-1]
    return x.as_strided((x.numel() // hd, hd), (x.stride(-3), 1))


# ---------------------------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------------------------


def _tier_for(q: torch.Tensor, tier: Optional[str], cache_form: bool, fits: bool) -> str:
    requested = tier if tier is not None else (_FORCED_TIER or "auto")
    if requested not in TIERS + ("auto",):
        raise ValueError(f"unknown RoPE tier {requested!r}; expected one of {TIERS} or None")
    chosen, refusal = _select_tier(q.device.type, requested, cache_form, bool(fits))
    if chosen is None:
        raise ValueError(refusal)
    return chosen


def _run(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
         positions: Optional[torch.Tensor], seq_dim: int, interleaved: bool, cos_half: bool,
         rotary_dim: int, tier: str, inplace: bool):
    """Run the Triton or PyTorch tier on validated inputs."""
    if tier == "triton":
        return _run_triton(q, k, cos, sin, positions, seq_dim, interleaved, cos_half, inplace)
    from torchpatches.ops import _rope_reference as ref

    c, s = ref.full_cos_sin(cos, sin, _positions_2d(positions), interleaved=interleaved,
                            cos_half=cos_half)
    outs = []
    for x in (q, k):
        if x is None:
            outs.append(None)
            continue
        xv = _bshd(x, seq_dim)
        if inplace:
            ref.rope_inplace(xv, c, s, rotary_dim, interleaved)
        else:
            o = ref.rope_out(xv, c, s, rotary_dim, interleaved)
            outs.append(o.squeeze(0) if x.dim() == 3 else (o if seq_dim == 1 else o.transpose(1, 2)))
    return None if inplace else (outs[0], outs[1])


def _plain_eager(q: torch.Tensor) -> bool:
    """True outside any tracing: not Dynamo, and not make_fx/export (fake or functional tensors)."""
    return not is_compiling() and type(q) is torch.Tensor


def _run_triton(q, k, cos, sin, positions, seq_dim, interleaved, cos_half, inplace):
    # Kernel loads assume a unit-stride head dim; anything else goes through a documented copy.
    qs = q if q.stride(-1) == 1 else q.contiguous()
    ks = k if (k is None or k.stride(-1) == 1) else k.contiguous()
    on_cuda = q.device.type == "cuda"
    args = (cos, sin, positions, seq_dim, interleaved, cos_half)
    if _plain_eager(q):
        # Eager: launch directly. The torch.library ops exist for tracing; their dispatch costs
        # tens of microseconds of host time per call, more than the kernel itself on small inputs.
        op = _eager_triton_inplace if inplace else _eager_triton_out
    elif on_cuda:
        ops = _TRITON_OPS if _TRITON_OPS is not None else _ensure_triton_ops()
        op = ops[0] if inplace else ops[1]
    else:
        op = _rope_qk_triton_opaque_ if inplace else _rope_qk_triton_opaque
    if inplace:
        op(qs, ks, *args)
        if qs is not q:
            q.copy_(qs)
        if ks is not k:
            k.copy_(ks)
        return None
    outs = op(qs, ks, *args)
    return outs[0], (outs[1] if k is not None else None)


def _nothing_to_do(q: torch.Tensor, k: Optional[torch.Tensor], inplace: bool):
    """Result for inputs without tokens (validated already)."""
    if inplace:
        return None
    return q.clone(), (k.clone() if k is not None else None)


def _per_token(q, k, cos, sin, interleaved, rotary_dim, sequence_dim, tier, inplace):
    seq_dim = _seq_dim(q, sequence_dim)
    B, S, D = _check_qk(q, k, seq_dim)
    r = _check_per_token(q, cos, sin, S, D, rotary_dim)
    chosen = _tier_for(q, tier, cache_form=False, fits=False)
    if B * S == 0:
        return _nothing_to_do(q, k, inplace)
    return _run(q, k, cos, sin, None, seq_dim, interleaved, False, r, chosen, inplace)


def _with_cache(q, k, cache, positions, interleaved, rotary_dim, sequence_dim, tier, inplace):
    seq_dim = _seq_dim(q, sequence_dim)
    B, S, D = _check_qk(q, k, seq_dim)
    r = _check_cache(q, cache, positions, B, S, D, rotary_dim)
    fits = cache.dtype == torch.float32 and _flashinfer_fits(q, k, seq_dim, D, positions)
    chosen = _tier_for(q, tier, cache_form=True, fits=fits)
    if B * S == 0:
        return _nothing_to_do(q, k, inplace)
    if chosen == "flashinfer":
        eager = _plain_eager(q)  # skip the dispatcher outside tracing
        if inplace:
            (_flashinfer_inplace if eager else _rope_qk_flashinfer_)(q, k, cache, positions, interleaved)
            return None
        q_out, k_out = (_flashinfer_out if eager else _rope_qk_flashinfer)(
            q, k, cache, positions, interleaved)
        return q_out, k_out
    half = r // 2
    return _run(q, k, cache[:, :half], cache[:, half:r], positions, seq_dim, interleaved, True, r,
                chosen, inplace)


# ---------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------


def apply_rope_qk_inplace(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = True,
    rotary_dim: Optional[int] = None,
    sequence_dim: Optional[int] = None,
    tier: Optional[str] = None,
) -> None:
    """Rotate q and k in place with per-token cos/sin (diffusers' form).

    Args:
        q, k: ``[T, H, D]``, ``[B, S, H, D]`` or ``[B, H, S, D]`` (see ``sequence_dim``); fp32, bf16 or
            fp16, same dtype, same B/S/D; head counts may differ. ``k=None`` rotates q only.
        cos, sin: ``[S, rotary_dim]`` floating (fp32 in diffusers), one value per element of the
            rotary span, indexed by the token's sequence index (shared across the batch). For
            ``interleaved=True`` diffusers repeats each frequency for both elements of a pair; for
            NeoX halves the row is ``[f, f]``. Values are used per element as given, so results
            match diffusers' ``apply_rotary_emb`` (``use_real=True``) for any cos/sin.
        interleaved: GPT-J pairs (FLUX, ``use_real_unbind_dim=-1``) if True, NeoX halves if False.
        rotary_dim: optional check; the rotary width is ``cos.shape[1]`` (<= head dim, even).
        sequence_dim: where S is: 0 for 3-D (default), 1 (default for 4-D) or 2 for 4-D.
        tier: ``"triton"``, ``"torch"`` or None (automatic); ``"flashinfer"`` needs the cache form.

    Raises:
        ValueError: on any invalid input, before q or k is modified.
    """
    _per_token(q, k, cos, sin, interleaved, rotary_dim, sequence_dim, tier, inplace=True)


def apply_rope_qk(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = True,
    rotary_dim: Optional[int] = None,
    sequence_dim: Optional[int] = None,
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Out-of-place :func:`apply_rope_qk_inplace`: returns new ``(q_out, k_out)``; q, k untouched.

    ``k_out`` is None when ``k`` is None. Outputs have q's shape and dtype (the Triton tier keeps a
    dense input's strides; the PyTorch tier lets PyTorch pick them).
    """
    return _per_token(q, k, cos, sin, interleaved, rotary_dim, sequence_dim, tier, inplace=False)


def apply_rope_qk_with_cache_inplace(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: Optional[int] = None,
    sequence_dim: Optional[int] = None,
    tier: Optional[str] = None,
) -> None:
    """Rotate q and k in place with a ``cos_sin_cache`` indexed by ``positions`` (vLLM/FlashInfer).

    Args:
        q, k: as in :func:`apply_rope_qk_inplace`.
        cos_sin_cache: ``[max_position, rotary_dim]`` floating (fp32 for FlashInfer); the first
            ``rotary_dim // 2`` columns are cos, the rest sin, one value per pair.
        positions: int32/int64 row of the cache for each token: ``[T]`` for 3-D q, ``[S]`` (shared
            across the batch) or ``[B, S]`` for 4-D q. Out-of-range rows are only detected for
            CPU tensors outside torch.compile; elsewhere they are the caller's responsibility.
        interleaved: required. GPT-J pairs if True (FlashInfer ``is_neox=False``), NeoX halves if
            False (``is_neox=True``).
        rotary_dim: optional check against ``cos_sin_cache.shape[1]``.
        sequence_dim, tier: as in :func:`apply_rope_qk_inplace`.

    Raises:
        ValueError: on any invalid input, before q or k is modified.
    """
    _with_cache(q, k, cos_sin_cache, positions, interleaved, rotary_dim, sequence_dim, tier,
                inplace=True)


def apply_rope_qk_with_cache(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: Optional[int] = None,
    sequence_dim: Optional[int] = None,
    tier: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Out-of-place :func:`apply_rope_qk_with_cache_inplace`: returns new ``(q_out, k_out)``."""
    return _with_cache(q, k, cos_sin_cache, positions, interleaved, rotary_dim, sequence_dim, tier,
                       inplace=False)
