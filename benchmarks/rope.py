"""RoPE benchmark and GPU correctness check for ``torchpatches.ops.rope``.

    python benchmarks/rope.py [--out DIR] [--skip-check] [--skip-bench]

On a CUDA GPU:
1. correctness of every available tier against a float64 reference (several shapes, fp32/bf16/fp16,
   both layouts, both cos/sin forms, in and out of place, outputs poisoned with NaN first), plus
   torch.compile(fullgraph=True) and mode="reduce-overhead" (CUDA graphs) of a function using the op;
2. timings (triton.testing.do_bench median after warm-up) for the FLUX shape (q, k [1, 4608, 24, 128]
   bf16, fp32 cos/sin [4608, 128], interleaved) and an LLM shape (8192 tokens, 32 q / 8 k heads,
   head 128, NeoX, cos_sin_cache + positions): torchpatches op vs diffusers-style eager vs
   Inductor-compiled diffusers-style code, each as µs, GB/s and % of a device-to-device copy
   measured in the same run. Prints a table; writes JSON under --out.

diffusers is not needed: its ``apply_rotary_emb`` (use_real=True, 0.42.1) is copied inline below.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # the tests' harness
import harness  # noqa: E402
from torchpatches.ops import _rope as rope  # noqa: E402
from torchpatches.ops import _rope_triton  # noqa: E402


# --------------------------------------------------------------------------- baselines


def diffusers_apply_rotary_emb(x, freqs_cis, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers 0.42.1 embeddings.apply_rotary_emb, use_real=True branch, verbatim math."""
    cos, sin = freqs_cis
    if sequence_dim == 2:
        cos, sin = cos[None, None, :, :], sin[None, None, :, :]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    cos, sin = cos.to(x.device), sin.to(x.device)
    if use_real_unbind_dim == -1:
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    else:
        x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
        x_rotated = torch.cat([-x_imag, x_real], dim=-1)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def flux_baseline(q, k, cos, sin):
    return (diffusers_apply_rotary_emb(q, (cos, sin), -1, 1),
            diffusers_apply_rotary_emb(k, (cos, sin), -1, 1))


def llm_baseline(q, k, cache, positions):
    """vLLM-style native RoPE (NeoX, cache + positions), out of place."""
    half = cache.shape[1] // 2
    cs = cache[positions]
    cos = torch.cat([cs[:, :half]] * 2, -1)[:, None, :]
    sin = torch.cat([cs[:, half:]] * 2, -1)[:, None, :]

    def one(x):
        a, b = x.chunk(2, -1)
        return (x.float() * cos + torch.cat([-b, a], -1).float() * sin).to(x.dtype)

    return one(q), one(k)


DEV = os.environ.get("ROPE_BENCH_DEVICE", "cuda")  # "cpu" (with TRITON_INTERPRET=1): smoke test
SMALL_CASES = [((1, 3, 2, 16), 2, 1, 16), ((1, 2, 2, 12), 1, 2, 8), ((3, 2, 8), 1, 0, 8)]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative L2 error


def poison_allocator(nbytes: int):
    """Free a NaN-filled block so the next allocations of that size likely reuse NaN memory."""
    t = torch.full((nbytes // 2 + 64,), float("nan"), dtype=torch.float16, device=DEV)
    del t


# --------------------------------------------------------------------------- correctness


def make_inputs(shape_q, hk, dtype, seq_dim, rotary_dim, interleaved, form, gen):
    dev = DEV
    if len(shape_q) == 3:
        T, H, D = shape_q
        q = torch.randn(T, H, D, device=dev, dtype=dtype, generator=gen)
        k = torch.randn(T, hk, D, device=dev, dtype=dtype, generator=gen)
        S, B = T, 1
    else:
        B, S, H, D = shape_q
        sq = (B, S, H, D) if seq_dim == 1 else (B, H, S, D)
        sk = (B, S, hk, D) if seq_dim == 1 else (B, hk, S, D)
        q = torch.randn(sq, device=dev, dtype=dtype, generator=gen)
        k = torch.randn(sk, device=dev, dtype=dtype, generator=gen)
    half = rotary_dim // 2
    if form == "per_token":
        ang = torch.rand(S, half, device=dev, generator=gen) * 50
        f = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat([t, t], -1))
        return q, k, f(ang.cos()), f(ang.sin()), None
    P = S + 7
    ang = torch.rand(P, half, device=dev, generator=gen) * 50
    cache = torch.cat([ang.cos(), ang.sin()], -1).contiguous()
    pos = torch.randint(0, P, (S,) if len(shape_q) == 3 else (B, S), device=dev, generator=gen)
    return q, k, cache, None, pos


def check_one(tier, shape_q, hk, dtype, seq_dim, rotary_dim, interleaved, form, inplace, gen):
    q, k, a, b, pos = make_inputs(shape_q, hk, dtype, seq_dim, rotary_dim, interleaved, form, gen)
    sd = seq_dim if q.dim() == 4 else 0
    if form == "per_token":
        rq = harness.rope_reference(q, a, b, interleaved=interleaved, seq_dim=sd)
        rk = harness.rope_reference(k, a, b, interleaved=interleaved, seq_dim=sd)
    else:
        h = rotary_dim // 2
        cos, sin = a[:, :h], a[:, h:]
        rq = harness.rope_reference(q, cos, sin, pos, interleaved=interleaved, cos_half=True, seq_dim=sd)
        rk = harness.rope_reference(k, cos, sin, pos, interleaved=interleaved, cos_half=True, seq_dim=sd)
    if inplace:
        qo, ko = q.clone(), k.clone()
        if form == "per_token":
            rope.apply_rope_qk_inplace(qo, ko, a, b, interleaved=interleaved, sequence_dim=sd, tier=tier)
        else:
            rope.apply_rope_qk_with_cache_inplace(qo, ko, a, pos, interleaved=interleaved,
                                                  sequence_dim=sd, tier=tier)
    else:
        poison_allocator(q.numel() * q.element_size())
        if form == "per_token":
            qo, ko = rope.apply_rope_qk(q, k, a, b, interleaved=interleaved, sequence_dim=sd, tier=tier)
        else:
            qo, ko = rope.apply_rope_qk_with_cache(q, k, a, pos, interleaved=interleaved,
                                                   sequence_dim=sd, tier=tier)
    e = max(harness.rel_err(qo, rq), harness.rel_err(ko, rk))
    return e, rope.last_tier()


def run_checks(results, only_tiers=None):
    gen = torch.Generator(device=DEV).manual_seed(1234)
    tiers = [t for t, (ok, _) in rope.describe_tiers(DEV).items() if ok]
    tiers = [t for t in tiers if not only_tiers or t in only_tiers]
    cases = SMALL_CASES if DEV == "cpu" else [
        ((1, 4608, 24, 128), 24, 1, 128),   # FLUX
        ((2, 77, 5, 64), 5, 2, 64),          # [B, H, S, D], odd S
        ((1, 1, 3, 256), 1, 1, 256),         # S = 1, D = 256
        ((3, 33, 8, 96), 2, 1, 64),          # GQA, rotary < head, non-pow2 head dim
        ((515, 32, 128), 8, 0, 128),         # token-major LLM, GQA
        ((257, 4, 80), 4, 0, 48),            # token-major, rotary 48 of 80
    ]
    fails = 0
    for tier in tiers:
        for shape, hk, sd, r in cases:
            big = shape[-3] * shape[-2] > 10000 if len(shape) == 4 else False
            for dtype in (torch.bfloat16,) if big else (torch.bfloat16, torch.float16, torch.float32):
                for interleaved in (True, False):
                    for form in ("per_token", "cache"):
                        for inplace in (True, False):
                            if tier == "flashinfer" and (form != "cache" or dtype == torch.float32
                                                         or shape[-1] not in (64, 128, 256)
                                                         or (len(shape) == 4 and sd == 2)):
                                continue
                            try:
                                e, ran = check_one(tier, shape, hk, dtype, sd, r, interleaved, form,
                                                   inplace, gen)
                                ok = (e == e) and e <= TOL[dtype]
                            except Exception as ex:  # record, keep checking the rest
                                e, ran, ok = repr(ex)[:200], None, False
                            fails += not ok
                            results.append(dict(tier=tier, ran=ran, shape=shape, hk=hk, seq_dim=sd,
                                                rotary_dim=r, dtype=str(dtype), interleaved=interleaved,
                                                form=form, inplace=inplace, rel_err=e, ok=ok))
    # non-contiguous views: a slice of a fused qkv projection, token-major.
    T, HQ, HK, D = (300, 8, 2, 128) if DEV == "cuda" else (3, 2, 1, 16)
    qkv = torch.randn(T, (HQ + 2 * HK) * D, device=DEV, dtype=torch.bfloat16, generator=gen)
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HK) * D].view(T, HK, D)
    ang = torch.rand(T + 5, D // 2, device=DEV, generator=gen) * 50
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    pos = torch.randint(0, T + 5, (T,), device=DEV, generator=gen)
    for tier in tiers:
        cos, sin = cache[:, :D // 2], cache[:, D // 2:]
        rq = harness.rope_reference(q, cos, sin, pos, interleaved=False, cos_half=True, seq_dim=0)
        rk = harness.rope_reference(k, cos, sin, pos, interleaved=False, cos_half=True, seq_dim=0)
        v = qkv[:, (HQ + HK) * D:].clone()
        qkv2 = qkv.clone()
        qq = qkv2[:, : HQ * D].view(T, HQ, D)
        kk = qkv2[:, HQ * D:(HQ + HK) * D].view(T, HK, D)
        rope.apply_rope_qk_with_cache_inplace(qq, kk, cache, pos, interleaved=False, tier=tier)
        e = max(harness.rel_err(qq, rq), harness.rel_err(kk, rk))
        untouched = torch.equal(qkv2[:, (HQ + HK) * D:], v)
        ok = e <= TOL[torch.bfloat16] and untouched
        fails += not ok
        results.append(dict(tier=tier, ran=rope.last_tier(), case="qkv-slice inplace", rel_err=e,
                            v_untouched=untouched, ok=ok))
    return fails


def run_compile_checks(results):
    """fullgraph compile and CUDA graphs with the Triton tier; graph breaks counted."""
    fails = 0
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    ang = torch.rand(512, 64, device="cuda", generator=gen) * 50
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)

    def f_out(q, k, cos, sin):
        q = q * 1.5
        qo, ko = rope.apply_rope_qk(q, k, cos, sin, interleaved=True)
        return qo + 1, ko

    def f_in(q, k, cos, sin):
        q = q * 1.5
        k = k.clone()
        rope.apply_rope_qk_inplace(q, k, cos, sin, interleaved=True)
        return q + 1, k

    for name, fn in (("out", f_out), ("inplace", f_in)):
        ref = fn(q, k, cos, sin)
        for mode in ("default", "reduce-overhead", "max-autotune-no-cudagraphs"):
            torch._dynamo.reset()
            try:
                breaks = harness.graph_report(fn, q, k, cos, sin).breaks
                cf = torch.compile(fn, fullgraph=True, mode=None if mode == "default" else mode)
                for _ in range(3):  # cudagraph trees record on the 2nd/3rd call
                    got = cf(q, k, cos, sin)
                torch.cuda.synchronize()
                e = max(harness.rel_err(got[0], ref[0].double()), harness.rel_err(got[1], ref[1].double()))
                ok = breaks == 0 and e <= 1e-2 and rope.last_tier() == "triton"
            except Exception as ex:
                breaks, e, ok = None, repr(ex)[:300], False
            fails += not ok
            results.append(dict(case=f"compile {name} {mode}", graph_breaks=breaks, rel_err_vs_eager=e,
                                tier=rope.last_tier(), ok=ok))
    return fails


# --------------------------------------------------------------------------- timing


def bench(fn: Callable[[], object]) -> float:
    """Host-inclusive µs per call: do_bench median, one call per timed region (Python included)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3


def bench_graph(fn: Callable[[], object]) -> float:
    """GPU µs per call: calls captured in a CUDA graph and replayed (host overhead removed)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    n = 1 << 29  # 512 Mi bf16 elements = 1 GiB each way
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    dst = torch.empty_like(src)
    # Not bench_graph: inside a CUDA graph a contiguous copy_ becomes a memcpy node run by the
    # copy engines (2.7 TB/s on an H200), not the SM copy kernel eager code gets (4.2 TB/s).
    us = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9


def bench_row(rows, shape, name, fn, nbytes, copy_gbs, host=True, **extra):
    """Append a row: GPU µs (graph), host-inclusive µs (eager loop), GB/s and % of copy (GPU)."""
    try:
        gpu_us = bench_graph(fn)
        host_us = bench(fn) if host else float("nan")
        gbs = nbytes / (gpu_us * 1e-6) / 1e9
        rows.append(dict(shape=shape, variant=name, gpu_us=round(gpu_us, 2), host_us=round(host_us, 2),
                         GBps=round(gbs, 1), pct_copy=round(100 * gbs / copy_gbs, 1), **extra))
    except Exception as ex:  # one broken variant must not lose the others
        rows.append(dict(shape=shape, variant=name, gpu_us=float("nan"), host_us=float("nan"),
                         GBps=float("nan"), pct_copy=float("nan"), error=repr(ex)[:300], **extra))


def compiled(fn, *args):
    """torch.compile(fn) warmed up, or a function raising the compile error when it is called."""
    try:
        c = torch.compile(fn, fullgraph=True)
        c(*args)
        return c
    except Exception as ex:
        err = ex

        def broken(*a):
            raise err
        return broken


SWEEP_FLUX = [dict(BLOCK_H=bh, num_warps=nw, HEAD_PROGS=hp)
              for bh in (4, 8) for nw in (1, 2, 4) for hp in (0, 2)]
SWEEP_LLM = SWEEP_FLUX


def launch_inplace(q, k, cos, sin, positions, *, interleaved, cos_half, config):
    """One in-place launch of the Triton kernel with the given launch parameters (no tier choice)."""
    qv = q if q.dim() == 4 else q.unsqueeze(0)  # [T, H, D] -> [1, T, H, D]
    kv = k if k.dim() == 4 else k.unsqueeze(0)
    rotary_dim = cos.shape[1] * (2 if cos_half else 1)
    _rope_triton.launch(_rope_triton.rope_kernel, qv, kv, qv, kv, cos, sin, positions,
                        interleaved=interleaved, cos_half=cos_half, rotary_dim=rotary_dim, config=config)


def sweep(rows, shape, configs, run_inplace, fresh, expected, nbytes, copy_gbs):
    """Time each launch config (GPU µs) and check its result against ``expected``.

    ``run_inplace(q, k, config)`` launches the kernel in place with that config."""
    for cfg in configs:
        try:
            qc, kc = fresh()
            run_inplace(qc, kc, cfg)
            err = max((qc.float() - expected[0].float()).abs().max().item(),
                      (kc.float() - expected[1].float()).abs().max().item())
        except Exception as ex:
            err = repr(ex)[:200]
        qi, ki = fresh()
        bench_row(rows, shape, "triton in-place " + " ".join(f"{k}={v}" for k, v in cfg.items()),
                  lambda: run_inplace(qi, ki, cfg), nbytes, copy_gbs, host=False, sweep=True,
                  config=dict(cfg), max_abs_diff_vs_torch_tier=err)


def bench_flux(copy_gbs, rows):
    B, S, H, D = 1, 4608, 24, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    ang = torch.rand(S, D // 2, device="cuda", generator=gen) * 50
    cos = ang.cos().repeat_interleave(2, -1).contiguous()
    sin = ang.sin().repeat_interleave(2, -1).contiguous()
    nbytes = 2 * 2 * q.numel() * q.element_size() + 2 * cos.numel() * 4
    floor_us = nbytes / (copy_gbs * 1e9) * 1e6
    torch._dynamo.reset()
    comp = compiled(flux_baseline, q, k, cos, sin)
    qi, ki = q.clone(), k.clone()

    def ours_out():
        return rope.apply_rope_qk(q, k, cos, sin, interleaved=True, sequence_dim=1, tier="triton")

    ours_comp = compiled(ours_out)

    def run_inplace(a, b):
        rope.apply_rope_qk_inplace(a, b, cos, sin, interleaved=True, sequence_dim=1, tier="triton")

    variants = [
        ("diffusers eager (q and k)", lambda: flux_baseline(q, k, cos, sin)),
        ("diffusers Inductor-compiled", lambda: comp(q, k, cos, sin)),
        ("torchpatches triton out-of-place", ours_out),
        ("torchpatches triton in-place", lambda: run_inplace(qi, ki)),
        ("torchpatches triton out-of-place, compiled", ours_comp),
        ("torchpatches torch tier eager",
         lambda: rope.apply_rope_qk(q, k, cos, sin, interleaved=True, sequence_dim=1, tier="torch")),
    ]
    for name, fn in variants:
        bench_row(rows, "flux", name, fn, nbytes, copy_gbs)
    expected = rope.apply_rope_qk(q, k, cos, sin, interleaved=True, sequence_dim=1, tier="torch")
    sweep(rows, "flux", SWEEP_FLUX,
          lambda a, b, cfg: launch_inplace(a, b, cos, sin, None, interleaved=True, cos_half=False, config=cfg),
          lambda: (q.clone(), k.clone()), expected, nbytes, copy_gbs)
    return dict(nbytes=nbytes, floor_us=round(floor_us, 2))


def bench_llm(copy_gbs, rows):
    T, HQ, HK, D, P = 8192, 32, 8, 128, 32768
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    ang = torch.rand(P, D // 2, device="cuda", generator=gen) * 50
    cache = torch.cat([ang.cos(), ang.sin()], -1).contiguous()
    pos = torch.randint(0, P, (T,), device="cuda", generator=gen)
    nbytes = 2 * (q.numel() + k.numel()) * 2 + T * D * 4 + T * 8
    floor_us = nbytes / (copy_gbs * 1e9) * 1e6
    torch._dynamo.reset()
    comp = compiled(llm_baseline, q, k, cache, pos)
    qi, ki = q.clone(), k.clone()

    def run_inplace(a, b, tier="triton"):
        rope.apply_rope_qk_with_cache_inplace(a, b, cache, pos, interleaved=False, tier=tier)

    def ours_out():
        return rope.apply_rope_qk_with_cache(q, k, cache, pos, interleaved=False, tier="triton")

    ours_comp = compiled(ours_out)
    variants = [
        ("native torch eager (vLLM-style)", lambda: llm_baseline(q, k, cache, pos)),
        ("native torch Inductor-compiled", lambda: comp(q, k, cache, pos)),
        ("torchpatches triton out-of-place", ours_out),
        ("torchpatches triton in-place", lambda: run_inplace(qi, ki)),
        ("torchpatches triton out-of-place, compiled", ours_comp),
    ]
    if rope.describe_tiers("cuda")["flashinfer"][0]:
        variants.append(("flashinfer in-place", lambda: run_inplace(qi, ki, "flashinfer")))
        variants.append(("flashinfer out-of-place", lambda: rope.apply_rope_qk_with_cache(
            q, k, cache, pos, interleaved=False, tier="flashinfer")))
    for name, fn in variants:
        bench_row(rows, "llm", name, fn, nbytes, copy_gbs)
    expected = rope.apply_rope_qk_with_cache(q, k, cache, pos, interleaved=False, tier="torch")
    half = D // 2
    sweep(rows, "llm", SWEEP_LLM,
          lambda a, b, cfg: launch_inplace(a, b, cache[:, :half], cache[:, half:], pos[None], interleaved=False,
                                           cos_half=True, config=cfg),
          lambda: (q.clone(), k.clone()), expected, nbytes, copy_gbs)
    return dict(nbytes=nbytes, floor_us=round(floor_us, 2))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-compile-checks", action="store_true")
    ap.add_argument("--tiers", default="", help="comma list: check only these tiers")
    ap.add_argument("--shapes", default="flux,llm")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton

    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "cpu-smoke"
    info = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), tiers=rope.describe_tiers(DEV),
                when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print(json.dumps(info, indent=1), flush=True)
    out = dict(info=info)
    fails = 0
    if not args.skip_check:
        checks: list = []
        t0 = time.time()
        fails += run_checks(checks, [t for t in args.tiers.split(",") if t])
        if DEV == "cuda" and not args.skip_compile_checks:
            fails += run_compile_checks(checks)
        out["checks"] = checks
        bad = [c for c in checks if not c["ok"]]
        print(f"correctness: {len(checks) - len(bad)}/{len(checks)} ok in {time.time() - t0:.0f}s", flush=True)
        for c in bad[:40]:
            print("FAIL", c, flush=True)
        save(out, args, gpu)
        for c in checks:
            if str(c.get("case", "")).startswith("compile"):
                print(c, flush=True)
    if not args.skip_bench and DEV == "cuda":
        copy_gbs = copy_bandwidth()
        rows: list = []
        out["copy_GBps"] = round(copy_gbs, 1)
        out["rows"] = rows
        if "flux" in args.shapes:
            out["flux"] = bench_flux(copy_gbs, rows)
            save(out, args, gpu)
        if "llm" in args.shapes:
            out["llm"] = bench_llm(copy_gbs, rows)
            save(out, args, gpu)
        print(f"\ncopy bandwidth (read+write): {copy_gbs:.0f} GB/s")
        for sh in ("flux", "llm"):
            if sh in out:
                print(f"{sh} floor: {out[sh]['floor_us']} us for {out[sh]['nbytes'] / 1e6:.1f} MB")
        sweep_rows = sorted((r for r in rows if r.get("sweep") and r["gpu_us"] == r["gpu_us"]),
                            key=lambda r: (r["shape"], r["gpu_us"]))
        for sh in ("flux", "llm"):
            best = [r for r in sweep_rows if r["shape"] == sh][:5]
            print(f"best {sh} configs:", [(r["variant"], r["gpu_us"], r["max_abs_diff_vs_torch_tier"])
                                          for r in best])
        print(f"{'shape':6} {'variant':45} {'GPU us':>8} {'host us':>8} {'GB/s':>7} {'%copy':>6}")
        for r in rows:
            if not r.get("sweep"):
                print(f"{r['shape']:6} {r['variant']:45} {r['gpu_us']:8.1f} {r['host_us']:8.1f} "
                      f"{r['GBps']:7.0f} {r['pct_copy']:6.1f}" + (f"  {r['error']}" if "error" in r else ""))
    save(out, args, gpu)
    return 1 if fails else 0


def save(out, args, gpu):
    name = "rope-" + gpu.replace(" ", "_").replace("/", "_") + args.tag + ".json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
