"""Fused DiT ops on the GPU at FLUX shapes: correctness against diffusers' own code, then timings.

For each op (``torchpatches.ops.modulate``, ``qk_norm_rope``, ``swiglu``, ``linear_gelu``, ``lse_merge``) at FLUX.1-dev
and FLUX.2-dev shapes (4096 image + 512 text tokens, batch 1, bf16):

- correctness: the op against the diffusers code it replaces (same inputs, fresh random data, outputs
  NaN-poisoned through the caching allocator first): fraction of bit-identical elements, largest
  difference in output ulps, NaNs; for the GELU epilogue also the error against float64 tanh- and
  erf-GELU (which form cuBLASLt computes);
- the two numbers: bytes the op must move (each input read once, each output written once) and the
  floor at the device-to-device copy rate measured in the same run;
- GPU time of diffusers' code and of the op, each from CUDA-graph replays (no Python / launch cost).

    python benchmarks/fused.py --json out.json      # GPU
    python benchmarks/fused.py --tiny               # CPU smoke test (PyTorch tier, tiny shapes)
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import _bench

SHAPES = {
    "flux1": dict(D=3072, H=24, Dh=128, S_img=4096, S_txt=512, mlp=12288),
    "flux2": dict(D=6144, H=48, Dh=128, S_img=4096, S_txt=512, mlp=18432),
}
TINY = {"tiny": dict(D=64, H=4, Dh=16, S_img=24, S_txt=8, mlp=256)}


# ----------------------------------------------------------------------------------------- helpers


def poison(device: torch.device) -> None:
    """Fill the caching allocator's free memory with NaN, so an output element nobody writes shows up."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info()
    n = max(0, int(free * 0.6) // 4)
    if n:
        block = torch.full((n,), float("nan"), device=device)
        del block


def compare(out: torch.Tensor, ref: torch.Tensor, scale: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """Bit-identical fraction, largest |diff| in ulps of the output dtype, NaNs.

    The ulp is taken at max(|out|, |ref|, scale): ``scale`` is the magnitude of the last rounded
    intermediate (e.g. ``|n * (1 + scale)|`` before ``+ shift``), so a one-ulp difference there that
    cancels to a tiny output reads as one ulp, not thousands.
    """
    a, b = out.float(), ref.float()
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[out.dtype]
    mag = torch.maximum(a.abs(), b.abs())
    if scale is not None:
        mag = torch.maximum(mag, scale.float().abs())
    mag = mag.clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - mant)
    diff = (a - b).abs()
    return {
        "identical_frac": float((out == ref).float().mean()),
        "differing": int((out != ref).sum()),
        "max_ulp": float((diff / ulp).max()),
        "max_abs": float(diff.max()),
        "nan": int(torch.isnan(out).sum()),
        "ref_nan": int(torch.isnan(ref).sum()),
    }


def graph_us(fn: Callable[[], Any], device: torch.device, reps: int = 10, iters: int = 30) -> float:
    """Median GPU microseconds per call from CUDA-graph replays (``reps`` calls per graph)."""
    if device.type != "cuda":
        import time

        fn()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t) / 3 * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def copy_rate(device: torch.device) -> float:
    """Device-to-device copy, GB/s counting bytes read plus written (outside a graph: SM copy kernel)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times) / 1e9


# ----------------------------------------------------------------------------------------- cases


def rnd(*shape: int, device: torch.device, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def cases(shape: Dict[str, int], device: torch.device) -> List[Dict[str, Any]]:
    """Each case: name, diffusers' callable, the op's callable, bytes, and inputs kept alive."""
    from diffusers.models import embeddings
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    from torchpatches.ops import (
        _lse_merge as lse_merge,
        _modulate as modulate,
        _qk_norm_rope as qk_norm_rope,
        _slices as slices,
        _swiglu as swiglu,
    )
    from torchpatches.ops._linear_gelu import linear_gelu_tanh

    def apply_rotary_emb(*a: Any, **k: Any) -> torch.Tensor:  # looked up per call: unpatched under disabled()
        return embeddings.apply_rotary_emb(*a, **k)

    D, H, Dh, Si, St, mlp = (shape[k] for k in ("D", "H", "Dh", "S_img", "S_txt", "mlp"))
    S = Si + St
    e = 2  # bf16 bytes
    out: List[Dict[str, Any]] = []
    x = rnd(1, S, D, device=device, scale=2.0)
    y = rnd(1, S, D, device=device)
    emb = rnd(1, 6 * D, device=device, scale=0.5)
    shift, scale, gate = emb[:, :D], emb[:, D:2 * D], emb[:, 2 * D:3 * D]  # views of a chunked emb, as diffusers
    norm = torch.nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
    def pair_norm(t: torch.Tensor) -> torch.Tensor:  # |(a, b)| of each rotated pair, for both elements
        p = t.float().reshape(*t.shape[:-1], -1, 2)
        return p.norm(dim=-1, keepdim=True).expand_as(p).reshape(t.shape)

    u_scale = lambda o: (o.float() - shift[:, None].float()).abs()  # noqa: E731  |n * (1 + scale)|
    h_scale = torch.maximum(x.float().abs(), (gate[:, None].float() * y.float()).abs())
    out.append(dict(
        name="layer_norm_modulate", bytes=2 * S * D * e, scales=lambda r: [u_scale(r[0])],
        ref=lambda: norm(x) * (1 + scale[:, None]) + shift[:, None],
        op=lambda: modulate.layer_norm_modulate(x, scale, shift, eps=1e-6),
    ))
    out.append(dict(
        name="gate_residual", bytes=3 * S * D * e, scales=lambda r: [h_scale],
        ref=lambda: x + gate.unsqueeze(1) * y,
        op=lambda: modulate.gate_residual(x, gate, y),
    ))
    out.append(dict(
        name="gate_residual_ln_modulate", bytes=4 * S * D * e, scales=lambda r: [h_scale, u_scale(r[1])],
        ref=lambda: (lambda h: (h, norm(h) * (1 + scale[:, None]) + shift[:, None]))(x + gate.unsqueeze(1) * y),
        op=lambda: modulate.gate_residual_layer_norm_modulate(x, gate, y, scale, shift, eps=1e-6),
    ))
    # q/k RMSNorm + RoPE, joint attention (double block): separate projections, as diffusers' FLUX.1/2.
    q, k, v = (rnd(1, Si, H, Dh, device=device, scale=3.0) for _ in range(3))
    qt, kt, vt = (rnd(1, St, H, Dh, device=device, scale=3.0) for _ in range(3))
    # Weights without grad, as in the patched (inference) model: a call autograd records takes the PyTorch tier.
    norms = [torch.nn.RMSNorm(Dh, eps=1e-6).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
             for _ in range(4)]
    for n in norms:
        n.weight.data = (torch.rand(Dh, device=device) + 0.5).to(torch.bfloat16)
    ang = torch.rand(S, Dh // 2, device=device, dtype=torch.float64) * 100
    cos = ang.cos().repeat_interleave(2, -1).float()
    sin = ang.sin().repeat_interleave(2, -1).float()

    def ref_joint():
        qq = torch.cat([norms[2](qt), norms[0](q)], dim=1)
        kk = torch.cat([norms[3](kt), norms[1](k)], dim=1)
        vv = torch.cat([vt, v], dim=1)
        return apply_rotary_emb(qq, (cos, sin), sequence_dim=1), apply_rotary_emb(kk, (cos, sin), sequence_dim=1), vv

    out.append(dict(
        name="qk_norm_rope_joint", bytes=6 * S * H * Dh * e + 2 * S * Dh * 4, ref=ref_joint,
        scales=lambda r: [pair_norm(r[0]), pair_norm(r[1]), None],
        op=lambda: qk_norm_rope.qk_norm_rope(
            q, k, cos, sin, q_weight=norms[0].weight, k_weight=norms[1].weight, eps_q=1e-6, eps_k=1e-6, v=v,
            q_txt=qt, k_txt=kt, v_txt=vt, q_txt_weight=norms[2].weight, k_txt_weight=norms[3].weight,
            eps_q_txt=1e-6, eps_k_txt=1e-6),
    ))
    # Single block: q, k as chunks of one fused projection row (FLUX.2's to_qkv_mlp_proj layout).
    proj = rnd(1, S, 3 * H * Dh + 2 * mlp, device=device, scale=3.0)
    qs, ks, _ = proj[..., : 3 * H * Dh].chunk(3, dim=-1)
    qs, ks = qs.unflatten(-1, (-1, Dh)), ks.unflatten(-1, (-1, Dh))
    out.append(dict(
        name="qk_norm_rope_single_strided", bytes=4 * S * H * Dh * e + 2 * S * Dh * 4,
        scales=lambda r: [pair_norm(r[0]), pair_norm(r[1])],
        ref=lambda: (apply_rotary_emb(norms[0](qs), (cos, sin), sequence_dim=1),
                     apply_rotary_emb(norms[1](ks), (cos, sin), sequence_dim=1)),
        op=lambda: qk_norm_rope.qk_norm_rope(qs, ks, cos, sin, q_weight=norms[0].weight, k_weight=norms[1].weight,
                                             eps_q=1e-6, eps_k=1e-6)[:2],
    ))
    mlp_in = proj[..., 3 * H * Dh:]
    act = Flux2SwiGLU()
    out.append(dict(
        name="swiglu_strided", bytes=3 * S * mlp * e, ref=lambda: act(mlp_in), op=lambda: swiglu.swiglu(mlp_in),
    ))
    # Single-block concat before the output projection: [attention output | activation(mlp)].
    attn_out = rnd(1, S, H * Dh, device=device)
    gelu_in = rnd(1, S, 4 * D, device=device, scale=2.0)

    def gelu_cat_op():
        buf = attn_out.new_empty((1, S, H * Dh + 4 * D))
        slices.gelu_tanh_into(gelu_in, buf[..., H * Dh:])
        slices.copy_into(attn_out, buf[..., : H * Dh])
        return buf

    out.append(dict(
        name="flux1_single_gelu_cat", bytes=2 * S * (H * Dh + 4 * D) * e,
        ref=lambda: torch.cat([attn_out, F.gelu(gelu_in, approximate="tanh")], dim=2), op=gelu_cat_op,
    ))

    def swiglu_cat_op():
        buf = attn_out.new_empty((1, S, H * Dh + mlp))
        swiglu.swiglu(mlp_in, out=buf[..., H * Dh:])
        slices.copy_into(attn_out, buf[..., : H * Dh])
        return buf

    out.append(dict(
        name="flux2_single_swiglu_cat", bytes=S * (2 * H * Dh + 3 * mlp) * e,
        ref=lambda: torch.cat([attn_out, act(mlp_in)], dim=-1), op=swiglu_cat_op,
    ))
    # Ring attention (two ranks): one rank's two partial outputs [1, S/2, H, Dh] merged by their log-sum-exps,
    # diffusers' TemplatedRingAttention.forward (convert_to_fp32) against ops.lse_merge (cp_ring_attention).
    shard = S // 2
    partial = [rnd(1, shard, H, Dh, device=device) for _ in range(2)]
    lses = [rnd(1, shard, H, device=device, scale=2.0, dtype=torch.float32) for _ in range(2)]

    def ring_merge_ref():
        prev_o = prev_l = None
        for o, l in zip(partial, lses):
            o, l = o.to(torch.float32), l.to(torch.float32).unsqueeze(-1)
            if prev_o is not None:
                o = prev_o - F.sigmoid(l - prev_l) * (prev_o - o)
                l = prev_l - F.logsigmoid(prev_l - l)
            prev_o, prev_l = o, l
        return o.to(torch.bfloat16), l.squeeze(-1)

    out.append(dict(
        name="ring_lse_merge", bytes=3 * shard * H * Dh * e + 3 * shard * H * 4, ref=ring_merge_ref,
        op=lambda: lse_merge.lse_merge(partial[0], lses[0], partial[1], lses[1], out_dtype=torch.bfloat16),
    ))
    # GELU(tanh) projection (FLUX.1 double-block MLP in): addmm + gelu vs the cuBLASLt epilogue.
    xin = rnd(S, D, device=device)
    w = rnd(4 * D, D, device=device, scale=D ** -0.5)
    b = rnd(4 * D, device=device, scale=0.1)
    out.append(dict(
        name="linear_gelu_tanh", bytes=(S * D + 4 * D * D + 4 * D + S * 4 * D) * e, flops=2 * S * D * 4 * D,
        ref=lambda: F.gelu(F.linear(xin, w, b), approximate="tanh"), op=lambda: linear_gelu_tanh(xin, w, b),
        scales=lambda r: [1.13 * F.linear(xin, w, b).float().abs()],  # GELU's slope <= 1.13: ulps of its input
        gelu_inputs=(xin, w, b),
    ))
    return out


def gelu_form(xin: torch.Tensor, w: torch.Tensor, b: torch.Tensor, fused: torch.Tensor,
              unfused: torch.Tensor) -> Dict[str, float]:
    """Which GELU cuBLASLt's epilogue computes, and how far the bf16 results are from float64.

    In bf16 the tanh/erf difference (~2e-4) hides under the output rounding, so the form is decided on
    an fp32 ``_addmm_activation`` (same epilogue, fp32 GEMM): its error against float64 tanh-GELU vs
    erf-GELU. The bf16 fused and unfused (diffusers) outputs are compared to float64 tanh-GELU.
    """
    lin = xin.double() @ w.double().t() + b.double()
    tanh = F.gelu(lin, approximate="tanh")
    erf = F.gelu(lin)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        f32 = torch._addmm_activation(b.float(), xin.float(), w.float().t(), use_gelu=True).double()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev

    def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
        return float((a.double() - ref).norm() / ref.norm())

    return {"fp32_epilogue_vs_tanh64": rel(f32, tanh), "fp32_epilogue_vs_erf64": rel(f32, erf),
            "bf16_fused_vs_tanh64": rel(fused, tanh), "bf16_diffusers_vs_tanh64": rel(unfused, tanh),
            "tanh_vs_erf64": rel(tanh, erf)}


def sweep(device: torch.device, gbps: float) -> List[Dict[str, Any]]:
    """Launch-configuration sweep of the modulate kernels at FLUX widths (GPU us and % of the copy rate), with
    the kernels' cast rounding and with their former integer rounding."""
    from torchpatches.ops import _modulate as modulate

    rows = []
    for D in (3072, 6144):
        S = 4608
        x, y = rnd(1, S, D, device=device), rnd(1, S, D, device=device)
        v = rnd(1, 3 * D, device=device, scale=0.5)
        sc, sh, g = v[:, :D], v[:, D:2 * D], v[:, 2 * D:]
        for rounding, warps, rows_per_prog in itertools.product(("cast", "int"), (2, 4, 8, 16), (1, 2)):
            with _bench.launch_config(num_warps=warps, ROWS=rows_per_prog), \
                    (_bench.integer_rounding() if rounding == "int" else contextlib.nullcontext()):
                lm = graph_us(lambda: modulate.layer_norm_modulate(x, sc, sh), device)
                rm = graph_us(lambda: modulate.gate_residual_layer_norm_modulate(x, g, y, sc, sh), device)
                gr = graph_us(lambda: modulate.gate_residual(x, g, y), device)
            row = dict(D=D, rounding=rounding, rows=rows_per_prog, num_warps=warps, ln_mod_us=lm,
                       ln_mod_pct=100 * 2 * S * D * 2 / (gbps * 1e3) / lm,
                       res_ln_mod_us=rm, res_ln_mod_pct=100 * 4 * S * D * 2 / (gbps * 1e3) / rm,
                       res_us=gr, res_pct=100 * 3 * S * D * 2 / (gbps * 1e3) / gr)
            rows.append(row)
            print("sweep", json.dumps(row), flush=True)
    return rows


def run_case(case: Dict[str, Any], model: str, device: torch.device, gbps: float, torchpatches: Any) -> Dict[str, Any]:
    """Correctness (NaN-poisoned outputs) then GPU times of one case."""
    poison(device)
    with torchpatches.disabled():
        ref = as_list(case["ref"]())
    poison(device)
    got = as_list(case["op"]())
    scales = case.get("scales", lambda r: [None] * len(r))(ref)
    checks = [compare(g, r, sc) for g, r, sc in zip(got, ref, scales)]
    row: Dict[str, Any] = dict(model=model, op=case["name"], bytes=case["bytes"], checks=checks)
    if "gelu_inputs" in case and device.type == "cuda":
        row["gelu_form"] = gelu_form(*case["gelu_inputs"], got[0], ref[0])
    row["floor_us"] = case["bytes"] / (gbps * 1e3) if gbps == gbps else float("nan")
    with torchpatches.disabled():
        row["diffusers_us"] = graph_us(case["ref"], device)
    row["op_us"] = graph_us(case["op"], device)
    if device.type == "cuda":  # A/B: the kernels' cast rounding against their former integer rounding
        with _bench.integer_rounding():
            poison(device)
            older = as_list(case["op"]())
            row["int_round_us"] = graph_us(case["op"], device)
        row["int_round_differing"] = sum(int((a != b).sum()) - int((a.isnan() & b.isnan()).sum())
                                         for a, b in zip(got, older))
    if "flops" in case:
        row["op_tflops"] = case["flops"] / row["op_us"] / 1e6
        row["diffusers_tflops"] = case["flops"] / row["diffusers_us"] / 1e6
    return row


def as_list(r: Any) -> List[torch.Tensor]:
    return [t for t in (list(r) if isinstance(r, (tuple, list)) else [r]) if isinstance(t, torch.Tensor)]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--sweep-only", action="store_true", help="only the launch-configuration sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    args = parser.parse_args(argv)
    import torchpatches

    device = torch.device("cpu" if args.tiny else "cuda")
    results: Dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               "torch": torch.__version__}
    gbps = copy_rate(device)
    results["copy_GBps"] = gbps
    rows = []
    for model, shape in ({} if args.sweep_only else TINY if args.tiny else SHAPES).items():
        torch.manual_seed(0)
        with torchpatches.disabled():  # the references are diffusers as shipped (no rope/swiglu patch)
            built = cases(shape, device)
        for case in built:
            try:
                row = run_case(case, model, device, gbps, torchpatches)
            except Exception as error:  # noqa: BLE001 - one broken case must not cost the run
                row = dict(model=model, op=case["name"], error=f"{type(error).__name__}: {error}")
                print(f"FAILED {model} {case['name']}: {row['error']}", flush=True)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items()}), flush=True)
    results["rows"] = rows
    if not args.tiny and not args.no_sweep:
        try:
            results["sweep"] = sweep(device, gbps)
        except Exception as error:  # noqa: BLE001
            print(f"sweep failed: {type(error).__name__}: {error}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    print(f"\ncopy rate {gbps:.0f} GB/s (read + write)")
    print(f"{'model':<6} {'op':<28} {'MB':>7} {'floor us':>9} {'diffusers us':>12} {'op us':>8} {'% copy':>7} "
          f"{'identical':>9} {'differ':>7} {'max ulp':>8} {'NaN':>4} {'int-round us':>12} {'int≠cast':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<6} {r['op']:<28} FAILED: {r['error'][:100]}")
            continue
        worst = max(r["checks"], key=lambda c: c["max_ulp"])
        ident = min(c["identical_frac"] for c in r["checks"])
        pct = 100 * r["floor_us"] / r["op_us"] if r["op_us"] else float("nan")
        print(f"{r['model']:<6} {r['op']:<28} {r['bytes'] / 1e6:>7.1f} {r['floor_us']:>9.1f} {r['diffusers_us']:>12.1f} "
              f"{r['op_us']:>8.1f} {pct:>7.1f} {ident:>9.6f} {sum(c['differing'] for c in r['checks']):>7} "
              f"{worst['max_ulp']:>8.2f} "
              f"{sum(c['nan'] for c in r['checks']):>4} {r.get('int_round_us', float('nan')):>12.1f} "
              f"{r.get('int_round_differing', '-'):>8}")
        if "gelu_form" in r:
            print(f"       gelu form: {r['gelu_form']}")
    for r in results.get("sweep", []):
        print(f"sweep D={r['D']} {r.get('rounding', 'int'):<4} rows={r.get('rows', 1)} warps={r['num_warps']:>2}: ln_mod {r['ln_mod_us']:6.1f} us ({r['ln_mod_pct']:4.1f}%), "
              f"res+ln_mod {r['res_ln_mod_us']:6.1f} us ({r['res_ln_mod_pct']:4.1f}%), "
              f"res {r['res_us']:6.1f} us ({r['res_pct']:4.1f}%)")
    bad = [r for r in rows if "error" in r or any(c["nan"] > c["ref_nan"] for c in r["checks"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
