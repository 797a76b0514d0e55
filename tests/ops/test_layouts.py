"""Every public op with a kernel tier, each tensor argument in turn given another layout with the same values: rows
padded, a gap between batch rows, a misaligned storage offset, a transposed (non-unit) last dim, an expanded
(stride-0) batch. The kernel tier (Triton: the interpreter on the CPU, compiled on a GPU) must give its own answer on the plain
arguments, bit for bit (cuBLAS tiers: within the op's bound, another algorithm may run), or refuse the layout with
``ValueError``: never a silent wrong number.

Padding and gaps hold NaN, so an op that reads them (wrong strides) cannot pass by luck. One call per case: the
values are what every layout shares; the other tests of each op draw the values.

On a GPU (``TORCHPATCHES_TEST_DEVICE=cuda``) the same table runs the compiled kernels, aligned calls first and the
misaligned one after them, as a cached launcher meets them; there ``lora`` and ``linear_gelu`` (cuBLASLt) join.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

from torchpatches.ops import (
    _linear_gelu as linear_gelu,
    _lora as lora,
    _lse_merge as lse_merge,
    _modulate as modulate,
    _rms_modulate as rms_modulate,
    _qk_norm_rope as qk_norm_rope,
    _rms_norm_rope as rms_norm_rope,
    _rope as rope,
    _rope_tables as rope_tables,
    _slices as slices,
    _swiglu as swiglu,
)

from _fused_checks import needs_triton, ulps

DEVICE = torch.device(os.environ.get("TORCHPATCHES_TEST_DEVICE", "cpu"))

Args = Dict[str, Any]


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def _tables(S: int, D: int, seed: int = 9) -> Tuple[torch.Tensor, torch.Tensor]:
    angles = _randn(S, D // 2, seed=seed, dtype=torch.float32)
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


# ---- the ops: (make the arguments, call with a tier -> a tuple of tensors, the layout-changeable arguments) ----


def _qk_args(dtype: torch.dtype) -> Args:
    B, S, T, H, D = 2, 5, 3, 2, 8
    cos, sin = _tables(T + S, D)
    w = lambda seed: 1 + 0.1 * _randn(D, seed=seed, dtype=dtype)  # noqa: E731
    return dict(q=_randn(B, S, H, D, seed=1, dtype=dtype), k=_randn(B, S, H, D, seed=2, dtype=dtype),
                v=_randn(B, S, H, D, seed=3, dtype=dtype), q_txt=_randn(B, T, H, D, seed=4, dtype=dtype),
                k_txt=_randn(B, T, H, D, seed=5, dtype=dtype), v_txt=_randn(B, T, H, D, seed=6, dtype=dtype),
                cos=cos, sin=sin, q_weight=w(7), k_weight=w(8), q_txt_weight=w(10), k_txt_weight=w(11))


def _qk_joint(a: Args, tier: str, text_first: bool = True) -> tuple:
    return qk_norm_rope.qk_norm_rope(
        a["q"], a["k"], a["cos"], a["sin"], q_weight=a["q_weight"], k_weight=a["k_weight"], eps_q=1e-6, eps_k=1e-5,
        v=a["v"], q_txt=a["q_txt"], k_txt=a["k_txt"], v_txt=a["v_txt"], q_txt_weight=a["q_txt_weight"],
        k_txt_weight=a["k_txt_weight"], eps_q_txt=1e-6, eps_k_txt=1e-5, text_first=text_first, tier=tier)


def _qk_image_only(a: Args, tier: str) -> tuple:
    S = a["q"].shape[1]
    return qk_norm_rope.qk_norm_rope(a["q"], a["k"], a["cos"][-S:], a["sin"][-S:], q_weight=a["q_weight"],
                                     k_weight=a["k_weight"], eps_q=1e-6, eps_k=1e-5, tier=tier)[:2]


def _qk_sd3(a: Args, tier: str) -> tuple:  # image rows first, no RoPE, diffusers' two roundings
    return qk_norm_rope.qk_norm_rope(
        a["q"], a["k"], q_weight=a["q_weight"], k_weight=a["k_weight"], eps_q=1e-6, eps_k=1e-5, v=a["v"],
        q_txt=a["q_txt"], k_txt=a["k_txt"], v_txt=a["v_txt"], q_txt_weight=a["q_txt_weight"],
        k_txt_weight=a["k_txt_weight"], eps_q_txt=1e-6, eps_k_txt=1e-5, text_first=False, rounding="each",
        tier=tier)


def _qk_ideogram_args(dtype: torch.dtype) -> Args:
    # Ideogram 4's form: self-attention, per-sample [B, S, D] tables of q's dtype, head dim 12 (D / 2 = 6: no
    # power of two), 3 heads.
    B, S, H, D = 2, 5, 3, 12
    angles = _randn(B, S, D, seed=9, dtype=torch.float32) * 5
    w = lambda seed: 1 + 0.1 * _randn(D, seed=seed, dtype=dtype)  # noqa: E731
    return dict(q=_randn(B, S, H, D, seed=1, dtype=dtype), k=_randn(B, S, H, D, seed=2, dtype=dtype),
                cos=angles.cos().to(dtype), sin=angles.sin().to(dtype), q_weight=w(7), k_weight=w(8))


def _qk_ideogram(a: Args, tier: str) -> tuple:  # half-split pairs, every op in q's dtype, diffusers' RMSNorm
    return qk_norm_rope.qk_norm_rope(a["q"], a["k"], a["cos"], a["sin"], q_weight=a["q_weight"],
                                     k_weight=a["k_weight"], eps_q=1e-6, eps_k=1e-5, rounding="each",
                                     rope="half_each", tier=tier)[:2]


def _wan_args(dtype: torch.dtype) -> Args:
    B, S, H, D = 2, 5, 2, 8
    cos, sin = _tables(S, D)
    return dict(q=_randn(B, S, H * D, seed=1, dtype=dtype), k=_randn(B, S, H * D, seed=2, dtype=dtype),
                q_weight=1 + 0.1 * _randn(H * D, seed=3, dtype=dtype),
                k_weight=1 + 0.1 * _randn(H * D, seed=4, dtype=dtype), cos=cos, sin=sin)


def _wan(a: Args, tier: str) -> tuple:
    return rms_norm_rope.rms_norm_rope(a["q"], a["k"], q_weight=a["q_weight"], k_weight=a["k_weight"], eps_q=1e-6,
                                       eps_k=1e-5, cos=a["cos"], sin=a["sin"], tier=tier)


def _mod_args(dtype: torch.dtype) -> Args:
    B, S, D = 2, 5, 16
    return dict(x=_randn(B, S, D, seed=1, dtype=dtype), y=_randn(B, S, D, seed=2, dtype=dtype),
                gate=_randn(B, D, seed=3, dtype=dtype), scale=0.1 * _randn(B, D, seed=4, dtype=dtype),
                shift=_randn(B, D, seed=5, dtype=dtype), weight=1 + 0.1 * _randn(D, seed=6, dtype=dtype),
                bias=0.1 * _randn(D, seed=7, dtype=dtype), table_gate=_randn(B, S, D, seed=8, dtype=dtype))


def _rms_mod(a: Args, tier: str) -> tuple:
    return rms_modulate.gate_rms_norm_residual_scale(a["x"], a["gate"], a["y"], a["weight"], a["weight"],
                                                     1 + a["scale"], tier=tier)


def _lnmod(a: Args, tier: str) -> tuple:
    return (modulate.layer_norm_modulate(a["x"], a["scale"], a["shift"], tier=tier),)


def _gate_res(a: Args, tier: str) -> tuple:
    return (modulate.gate_residual(a["x"], a["gate"], a["y"], tier=tier),)


def _gate_res_tokens(a: Args, tier: str) -> tuple:  # a per-token gate [B, S, D] (Wan 2.2's per-token timesteps)
    return (modulate.gate_residual(a["x"], a["table_gate"], a["y"], rounding="once", tier=tier),)


def _gate_res_lnmod(a: Args, tier: str) -> tuple:
    return modulate.gate_residual_layer_norm_modulate(a["x"], a["gate"], a["y"], a["scale"], a["shift"], tier=tier)


def _res_lnmod(a: Args, tier: str) -> tuple:
    return modulate.residual_layer_norm_modulate(a["x"], a["y"], a["scale"], a["shift"], tier=tier)


def _gate_res_ln(a: Args, tier: str) -> tuple:
    return modulate.gate_residual_layer_norm(a["x"], a["gate"], a["y"], a["weight"], a["bias"], rounding="once",
                                             tier=tier)


def _swiglu_args(dtype: torch.dtype) -> Args:
    return dict(x=_randn(2, 5, 16, seed=1, dtype=dtype))


def _swiglu(a: Args, tier: str) -> tuple:
    return (swiglu.swiglu(a["x"], tier=tier),)


def _swiglu_two_args(dtype: torch.dtype) -> Args:
    return dict(x=_randn(2, 5, 8, seed=1, dtype=dtype), up=_randn(2, 5, 8, seed=2, dtype=dtype))


def _swiglu_two(a: Args, tier: str) -> tuple:
    return (swiglu.swiglu(a["x"], a["up"], tier=tier),)


def _slices_args(dtype: torch.dtype) -> Args:
    return dict(x=_randn(2, 5, 8, seed=1, dtype=dtype))


def _gelu_into(a: Args, tier: str) -> tuple:
    x = a["x"]
    out = torch.zeros(*x.shape[:-1], x.shape[-1] + 4, dtype=x.dtype, device=x.device)
    slices.gelu_tanh_into(x, out[..., 4:], tier=tier)
    return (out,)


def _copy_into(a: Args, tier: str) -> tuple:
    x = a["x"]
    out = torch.zeros(*x.shape[:-1], x.shape[-1] + 4, dtype=x.dtype, device=x.device)
    slices.copy_into(x, out[..., :-4], tier=tier)
    return (out,)


def _lse_args(dtype: torch.dtype) -> Args:
    B, S, H, D = 2, 5, 2, 8
    return dict(out_a=_randn(B, S, H, D, seed=1, dtype=dtype), out_b=_randn(B, S, H, D, seed=2, dtype=dtype),
                lse_a=_randn(B, S, H, seed=3, dtype=torch.float32), lse_b=_randn(B, S, H, seed=4, dtype=torch.float32))


def _lse(a: Args, tier: str) -> tuple:
    return lse_merge.lse_merge(a["out_a"], a["lse_a"], a["out_b"], a["lse_b"], tier=tier)


def _tables_args(dtype: torch.dtype) -> Args:
    return dict(ids=(_randn(7, 3, seed=1, dtype=torch.float32) * 8).round())


def _rope_tables(a: Args, tier: str) -> tuple:
    return rope_tables.rope_tables(a["ids"], (4, 6, 6), 10000.0, tier=tier)


def _rope_args(dtype: torch.dtype) -> Args:
    B, S, H, D = 2, 5, 2, 8
    cos, sin = _tables(S, D)
    return dict(q=_randn(B, S, H, D, seed=1, dtype=dtype), k=_randn(B, S, H, D, seed=2, dtype=dtype), cos=cos,
                sin=sin)


def _rope(a: Args, tier: str) -> tuple:
    return rope.apply_rope_qk(a["q"], a["k"], a["cos"], a["sin"], tier=tier)


def _lora_args(dtype: torch.dtype) -> Args:
    return dict(x=_randn(2, 5, 16, seed=1, dtype=dtype), weight=_randn(12, 16, seed=2, dtype=dtype),
                bias=_randn(12, seed=3, dtype=dtype), A=_randn(4, 16, seed=4, dtype=dtype),
                B=_randn(12, 4, seed=5, dtype=dtype))


def _lora(a: Args, tier: str) -> tuple:  # a power-of-two scaling: the epilogue tier's products are exact
    return (lora.lora_linear(a["x"], a["weight"], a["bias"], [(a["A"], a["B"], 0.5)], tier=tier),)


def _linear_gelu(a: Args, tier: str) -> tuple:
    return (linear_gelu.linear_gelu_tanh(a["x"], a["weight"], a["bias"], tier=tier),)


#: name -> (arguments for a dtype, the call, the arguments whose layout the sweep changes).
OPS: Dict[str, Tuple[Callable[[torch.dtype], Args], Callable[[Args, str], tuple], Tuple[str, ...]]] = {
    "qk_norm_rope joint": (_qk_args, _qk_joint, ("q", "k", "v", "q_txt", "k_txt", "v_txt", "cos", "sin",
                                                 "q_weight", "k_txt_weight")),
    "qk_norm_rope image only": (_qk_args, _qk_image_only, ("q", "k", "cos")),
    "qk_norm_rope sd3": (_qk_args, _qk_sd3, ("q", "k", "v", "q_txt", "k_txt", "v_txt")),
    "qk_norm_rope ideogram": (_qk_ideogram_args, _qk_ideogram, ("q", "k", "cos", "sin")),
    "rms_norm_rope": (_wan_args, _wan, ("q", "k", "q_weight", "cos", "sin")),
    "layer_norm_modulate": (_mod_args, _lnmod, ("x", "scale", "shift")),
    "gate_residual": (_mod_args, _gate_res, ("x", "gate", "y")),
    "gate_residual per token": (_mod_args, _gate_res_tokens, ("x", "table_gate", "y")),
    "gate_residual_layer_norm_modulate": (_mod_args, _gate_res_lnmod, ("x", "gate", "y", "scale", "shift")),
    "residual_layer_norm_modulate": (_mod_args, _res_lnmod, ("x", "y", "scale")),
    "gate_residual_layer_norm": (_mod_args, _gate_res_ln, ("x", "gate", "y", "weight", "bias")),
    "rms_modulate": (_mod_args, _rms_mod, ("x", "gate", "y", "scale")),
    "swiglu": (_swiglu_args, _swiglu, ("x",)),
    "swiglu two": (_swiglu_two_args, _swiglu_two, ("x", "up")),
    "gelu_tanh_into": (_slices_args, _gelu_into, ("x",)),
    "copy_into": (_slices_args, _copy_into, ("x",)),
    "lse_merge": (_lse_args, _lse, ("out_a", "lse_a", "out_b", "lse_b")),
    "rope_tables": (_tables_args, _rope_tables, ("ids",)),
    "rope": (_rope_args, _rope, ("q", "k", "cos", "sin")),
    "lora_linear": (_lora_args, _lora, ("x", "weight", "bias", "A", "B")),
}
if DEVICE.type == "cuda":  # cuBLASLt's epilogue: CUDA only
    OPS["linear_gelu"] = (_lora_args, _linear_gelu, ("x", "weight", "bias"))
#: The kernel tier of each op that is not Triton.
KERNEL_TIERS = {"lora_linear": "epilogue", "linear_gelu": "cublaslt"}


# ---- the layouts: the same values in another view ----------------------------------------------------------


def _nan_like(t: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    fill = float("nan") if t.is_floating_point() else 0
    return torch.full(shape, fill, dtype=t.dtype, device=t.device)


def padded_rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    big = _nan_like(t, (*t.shape[:-1], t.shape[-1] + 5))
    big[..., : t.shape[-1]] = t
    return big[..., : t.shape[-1]]


def gapped_batch(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t.dim() < 2:
        return None
    big = _nan_like(t, (2 * t.shape[0], *t.shape[1:]))
    big[::2] = t
    return big[::2]


def misaligned(t: torch.Tensor) -> Optional[torch.Tensor]:
    flat = _nan_like(t, (t.numel() + 7,))
    view = flat[7:].view(t.shape)  # 7 elements in: the data pointer is no multiple of 16 bytes
    view.copy_(t)
    return view


def transposed(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t.dim() < 2:
        return None
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def expanded(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t.dim() < 2 or t.shape[0] < 2:
        return None
    return t[:1].expand(t.shape)  # the values of an expanded batch: the first row everywhere (see _case_args)


LAYOUTS = {"padded rows": padded_rows, "gapped batch": gapped_batch, "misaligned": misaligned,
           "transposed": transposed, "expanded": expanded}


def _tolerance(dtype: torch.dtype) -> float:
    # The ops' stated bounds against their PyTorch tier at each row's largest value (one ulp of a rounding where
    # fp32 statistics differ; fp32: summation order).
    return 8.0 if dtype == torch.float32 else 2.0


def _check_outputs(got: tuple, want: tuple, dtype: torch.dtype, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: output {i}"
        assert torch.isnan(g).equal(torch.isnan(w)), f"{what}: output {i} has NaN where the plain call has none"
        u = ulps(g, w, w.abs().amax(-1, keepdim=True) if w.dim() and w.is_floating_point() else None)
        assert u <= _tolerance(dtype), f"{what}: output {i} is {u} ulp from the plain call's"


CASES = [pytest.param(op, arg, layout, id=f"{op}-{arg}-{layout}")
         for op, (_, _, changeable) in OPS.items() for arg in changeable for layout in LAYOUTS]


def _case_args(op: str, arg: str, layout: str, dtype: torch.dtype) -> Tuple[Args, Args]:
    """(plain arguments, the same with ``arg`` in ``layout``), or skip where the layout does not apply."""
    make = OPS[op][0]
    plain = make(dtype)
    t = plain[arg]
    if layout == "expanded" and t.dim() >= 2 and t.shape[0] >= 2:
        plain[arg] = t[:1].expand(t.shape).clone()  # what the expanded view holds
    view = LAYOUTS[layout](plain[arg])
    if view is None:
        pytest.skip(f"{layout} does not apply to a {plain[arg].dim()}-D {arg}")
    assert view.equal(plain[arg]) or torch.isnan(plain[arg]).any()
    return plain, {**plain, arg: view}


def _run_case(op: str, arg: str, layout: str, dtype: torch.dtype) -> None:
    call, tier = OPS[op][1], KERNEL_TIERS.get(op, "triton")
    plain, changed = _case_args(op, arg, layout, dtype)
    # the kernel on the plain arguments first: a launcher cached for the aligned, dense case meets the other layout
    want = call(plain, tier)
    try:
        got = call(changed, tier)
    except ValueError as e:  # refused clearly: the fused patterns hand such a call to diffusers
        assert arg in str(e) or "overlap" in str(e) or "stride" in str(e), f"refusal does not name {arg}: {e}"
        return
    what = f"{op}, {arg} {layout}"
    if tier == "triton":  # the same program on the same values: a layout changes addresses, not one bit
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: output {i}"
            assert torch.equal(torch.nan_to_num(g), torch.nan_to_num(w)) and torch.isnan(g).equal(torch.isnan(w)), \
                f"{what}: output {i} differs from the plain call's by {ulps(g, w)} ulp"
    else:  # cuBLAS may pick another algorithm for other strides: the op's bound at each row's largest value
        _check_outputs(got, want, dtype, what)
    # the PyTorch tier on the plain arguments against the kernel's: tests/ops/test_dtype_switch.py


@needs_triton
@pytest.mark.once  # about 45 s on the CPU interpreter: one session of the matrix
@pytest.mark.parametrize("op, arg, layout", CASES)
def test_layout_matches_plain_call(op: str, arg: str, layout: str) -> None:
    _run_case(op, arg, layout, torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("op", ["qk_norm_rope joint", "qk_norm_rope sd3", "qk_norm_rope ideogram", "rms_norm_rope",
                                "gate_residual_layer_norm"])
@pytest.mark.parametrize("layout", ["padded rows", "misaligned"])
def test_layout_fp32_and_fp16(op: str, layout: str) -> None:
    """fp32 (where a wrong read of padding shows as 1e16 rather than NaN in bf16) and fp16, first argument and the
    last changeable one."""
    for dtype in (torch.float32, torch.float16):
        for arg in (OPS[op][2][0], OPS[op][2][-1]):
            _run_case(op, arg, layout, dtype)


def test_every_kernel_op_is_swept() -> None:
    """A new public op with a Triton tier joins the table (its module's name, or its function's, in OPS)."""
    from pathlib import Path

    ops_dir = Path(qk_norm_rope.__file__).parent
    kernels = {p.stem[1:].rsplit("_triton", 1)[0] for p in ops_dir.glob("_*_triton.py")} - {"rows", "rope_library"}
    covered = {name.split()[0] for name in OPS} | {"modulate", "swiglu", "rope"}
    missing: List[str] = sorted(k for k in kernels if k not in covered)
    assert not missing, f"ops with a Triton tier missing from OPS: {missing}"
