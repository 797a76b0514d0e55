"""Host cost of the Python around the fused kernels, per call and projected to one FLUX.1-dev step.

The fused path's own Python, apart from the kernels, the module calls diffusers makes anyway and the
launches (``benchmarks/launch_overhead.py``):

- the wrapper of every fused replacement (``fused(...)``: compiling / jit.trace / forward AD / functorch /
  global hooks, the assumed globals): a replacement built by ``fused`` around a body that returns at
  once, minus that body called directly;
- the eligibility predicates each pattern's body runs before it does anything (the patterns' own
  guard functions, on the tiny FLUX.1's modules and tensors of its shapes);
- each op's entry (argument and memory checks, tier choice, dispatch) with the op body replaced by one
  that returns at once.

Tensors are tiny (16 tokens x 32): the numbers are Python and the C++ dispatch of attribute reads,
independent of the tensor sizes. Each figure is the best of 7 repeats of a batch (microseconds per call);
the projection multiplies it by the calls one FLUX.1-dev step makes (19 double + 38 single blocks,
``STEP_CALLS``). Run it on the GPU host for the figures that matter; on a 2-core CI machine under load
they are 2-3x larger.

    python benchmarks/host_overhead.py [--json out.json] [--number 20000]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import timeit
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' harness

#: Calls per FLUX.1-dev step (19 double blocks, 38 single blocks, one norm_out), by what is called.
STEP_CALLS = {
    # fused replacements (the wrapper runs once per call)
    "wrapper AdaLayerNormZero": 38, "wrapper AdaLayerNormZeroSingle": 38, "wrapper AdaLayerNormContinuous": 1,
    "wrapper FluxAttnProcessor": 57, "wrapper FluxTransformerBlock": 19, "wrapper FluxSingleTransformerBlock": 38,
    "wrapper GELU": 38,
    # eligibility predicates
    "guard adaln": 77, "guard double block": 19, "guard single block": 38, "guard processor joint": 19,
    "guard processor single": 38, "guard modulated": 77, "guard residual_modulated": 38, "guard residual": 76,
    # op entries
    "op layer_norm_modulate": 77, "op gate_residual_layer_norm_modulate": 38, "op gate_residual": 76,
    "op qk_norm_rope joint": 19, "op qk_norm_rope single": 38, "op gelu_tanh_into": 38, "op copy_into": 38,
}


def _best_us(fn: Callable[[], Any], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def _wrapper_cases() -> Dict[str, Callable[[], Any]]:
    """Each target's replacement wrapper around a body that returns at once (the body's own call subtracted)."""
    from diffusers.models import activations, normalization
    from diffusers.models.transformers import transformer_flux

    from torchpatches.patches._fused_common import GELU, LAYER_NORM, RMS_NORM, CAT, fused

    def body(self: Any, *args: Any, **kwargs: Any) -> int:
        return 0

    targets = {
        "AdaLayerNormZero": (normalization.AdaLayerNormZero, "forward", LAYER_NORM),
        "AdaLayerNormZeroSingle": (normalization.AdaLayerNormZeroSingle, "forward", LAYER_NORM),
        "AdaLayerNormContinuous": (normalization.AdaLayerNormContinuous, "forward", LAYER_NORM),
        "FluxAttnProcessor": (transformer_flux.FluxAttnProcessor, "__call__", RMS_NORM + CAT),
        "FluxTransformerBlock": (transformer_flux.FluxTransformerBlock, "forward", LAYER_NORM + CAT),
        "FluxSingleTransformerBlock": (transformer_flux.FluxSingleTransformerBlock, "forward", LAYER_NORM + CAT + GELU),
        "GELU": (activations.GELU, "forward", GELU),
    }
    cases = {}
    for name, (cls, attr, assumes) in targets.items():
        original = getattr(vars(cls)[attr], "__torchpatches_original__", vars(cls)[attr])
        method = fused("bench", body, assumes)(original)
        obj = object()
        cases[f"wrapper {name}"] = (lambda m=method, o=obj: m(o, 1, x=2), lambda o=obj: body(o, 1, x=2))
    return cases


def _guard_cases(model: torch.nn.Module) -> Dict[str, Callable[[], Any]]:
    """The predicates each body runs before it computes, on the tiny FLUX.1's modules."""
    from torchpatches.patches import _modulate_calls as calls
    from torchpatches.patches import adaln, gate_residual, qk_norm_rope

    block, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    D = block.norm2.normalized_shape[0]
    g = torch.Generator().manual_seed(0)
    x, text, emb, vec = (torch.randn(1, 16, D, generator=g), torch.randn(1, 8, D, generator=g),
                         torch.randn(1, D, generator=g), torch.randn(1, D, generator=g))
    heads, head_dim = block.attn.heads, block.attn.head_dim
    q = torch.randn(1, 16, heads, head_dim, generator=g)
    rotary = (torch.randn(24, head_dim, generator=g), torch.randn(24, head_dim, generator=g))
    single_rotary = rotary
    joint_q = torch.randn(1, 24, D, generator=g)
    processor, single_processor = block.attn.processor, single.attn.processor
    flux = sys.modules[type(processor).__module__]

    def double_guard() -> bool:
        return (gate_residual._block_ok(block, x, text, emb)
                and type(block.attn.processor) is flux.FluxAttnProcessor)

    def single_guard() -> bool:
        act = single.act_mlp
        return (gate_residual._block_ok(single, joint_q, text, emb) and gate_residual.stock(act, torch.nn.GELU)
                and act.approximate == "tanh")

    def processor_guard(attn: Any, proc: Any, h: torch.Tensor, text_states: Any, rot: Any, rows: int) -> bool:
        joint = qk_norm_rope._joint_ok(attn, text_states)
        return (joint is not None and qk_norm_rope._common_ok(proc, attn, h, rot, text_states)
                and qk_norm_rope._rotary_fits(rot, q, rows) and qk_norm_rope._norms_ok(attn, q, joint))

    def residual_modulated_guard() -> bool:
        return (calls._vectors_fit(x, vec, vec, vec) and calls._rows_fit(x, x)
                and calls.pattern_on("adaln") and calls.plain_layer_norm(block.norm2, D))

    return {
        "guard adaln": lambda: adaln._covered(block.norm1, x, emb),
        "guard double block": double_guard,
        "guard single block": single_guard,
        "guard processor joint": lambda: processor_guard(block.attn, processor, x, text, rotary, 24),
        "guard processor single": lambda: processor_guard(single.attn, single_processor, joint_q, None,
                                                          single_rotary, 24),
        "guard modulated": lambda: calls.plain_layer_norm(block.norm2, D) and calls._vectors_fit(x, vec, vec),
        "guard residual_modulated": residual_modulated_guard,
        "guard residual": lambda: calls._vectors_fit(x, vec) and calls._rows_fit(x, x),
    }


def _op_cases(D: int, heads: int, head_dim: int) -> Tuple[Dict[str, Callable[[], Any]], Callable[[], None]]:
    """Each op's public entry with its body (``_impl``) returning at once; and the function restoring them."""
    from torchpatches.ops import _modulate as modulate, _qk_norm_rope as qk_norm_rope, _slices as slices

    g = torch.Generator().manual_seed(0)
    x, y, vec = torch.randn(1, 16, D, generator=g), torch.randn(1, 16, D, generator=g), torch.randn(1, D, generator=g)
    q, k, v = (torch.randn(1, 16, heads, head_dim, generator=g) for _ in range(3))
    qt, kt, vt = (torch.randn(1, 8, heads, head_dim, generator=g) for _ in range(3))
    w = torch.ones(head_dim)
    cos, sin = torch.randn(24, head_dim, generator=g), torch.randn(24, head_dim, generator=g)
    cos16, sin16 = cos[:16].contiguous(), sin[:16].contiguous()
    buf = torch.empty(1, 16, 2 * D)
    saved = {m: m._impl for m in (modulate, qk_norm_rope, slices)}
    modulate._impl = lambda *a: [x, x] if a[1] is not None and a[3] is not None else [x]
    qk_norm_rope._impl = lambda *a: [q, k, v]
    slices._impl = lambda *a: None

    def restore() -> None:
        for module, impl in saved.items():
            module._impl = impl

    cases = {
        "op layer_norm_modulate": lambda: modulate.layer_norm_modulate(x, vec, vec, eps=1e-6),
        "op gate_residual_layer_norm_modulate": lambda: modulate.gate_residual_layer_norm_modulate(
            x, vec, y, vec, vec, eps=1e-6),
        "op gate_residual": lambda: modulate.gate_residual(x, vec, y),
        "op qk_norm_rope joint": lambda: qk_norm_rope.qk_norm_rope(
            q, k, cos, sin, q_weight=w, k_weight=w, eps_q=1e-6, eps_k=1e-6, v=v, q_txt=qt, k_txt=kt, v_txt=vt,
            q_txt_weight=w, k_txt_weight=w, eps_q_txt=1e-6, eps_k_txt=1e-6),
        "op qk_norm_rope single": lambda: qk_norm_rope.qk_norm_rope(q, k, cos16, sin16, q_weight=w, k_weight=w,
                                                                    eps_q=1e-6, eps_k=1e-6),
        "op gelu_tanh_into": lambda: slices.gelu_tanh_into(y, buf[..., D:]),
        "op copy_into": lambda: slices.copy_into(x, buf[..., :D]),
    }
    return cases, restore


def measure(number: int) -> List[Dict[str, Any]]:
    import torchpatches
    from harness import build_model
    from torchpatches.ops import force_tier

    torchpatches.apply(["adaln", "qk_norm_rope", "gate_residual", "gelu_gemm"])
    model = build_model("flux1-fused")
    block = model.transformer_blocks[0]
    rows = []
    with torch.no_grad(), force_tier("torch"):
        for name, (call, baseline) in _wrapper_cases().items():
            rows.append(dict(name=name, us=max(0.0, _best_us(call, number) - _best_us(baseline, number))))
        for name, call in _guard_cases(model).items():
            assert call(), f"{name}: the tiny model's call must be eligible"
            rows.append(dict(name=name, us=_best_us(call, number)))
        cases, restore = _op_cases(block.norm2.normalized_shape[0], block.attn.heads, block.attn.head_dim)
        try:
            for name, call in cases.items():
                rows.append(dict(name=name, us=_best_us(call, number)))
        finally:
            restore()
    for row in rows:
        row["calls_per_step"] = STEP_CALLS[row["name"]]
        row["ms_per_step"] = row["us"] * row["calls_per_step"] / 1e3
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20000, help="calls per timed batch")
    parser.add_argument("--json", help="write the rows and totals here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.number)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.processor() or platform.machine()}")
    print(f"{'what':40s} {'us/call':>8s} {'calls/step':>10s} {'ms/step':>8s}")
    totals: Dict[str, float] = {}
    for row in rows:
        print(f"{row['name']:40s} {row['us']:8.2f} {row['calls_per_step']:10d} {row['ms_per_step']:8.2f}")
        kind = row["name"].split()[0]
        totals[kind] = totals.get(kind, 0.0) + row["ms_per_step"]
    for kind, ms in totals.items():
        print(f"{'total ' + kind:40s} {'':8s} {'':10s} {ms:8.2f}")
    print(f"{'total':40s} {'':8s} {'':10s} {sum(totals.values()):8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(torch=torch.__version__, rows=rows, totals=totals), indent=1))


if __name__ == "__main__":
    main()
