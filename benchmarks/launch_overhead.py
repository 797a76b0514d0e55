"""Host cost of one Triton launch: ``kernel[grid](...)`` against ``torchpatches.ops._runtime.launch.launch``.

For each fused-op kernel (modulate, swiglu, rows, rope, qk_norm_rope; imported from ``torchpatches.ops``,
never copied) the op's own launch function is run once with a recorder in place of ``kernel[grid]``, which
gives the exact (kernel, grid, args, constexprs) the op launches. Then:

- correctness: at sizes 1 / 16 / 17 and on views at an odd element offset (a data pointer that is not
  16-byte aligned: another compiled kernel), alternating aligned and odd calls so both caches are
  exercised, the outputs of ``launch`` (first call: through ``kernel.run``; later calls: the cached
  launcher) must be bit-identical to ``kernel[grid]``'s (outputs NaN-filled before each run);
- host time: microseconds per launch for ``kernel[grid]``, ``launch`` and, as the floor, the compiled
  launcher called directly (what ``launch`` ends with), each the median of repeats of a batch of launches
  at a small shape (a batch never fills the GPU's launch queue, so its wall time is host time); then
  ``launch``'s own Python time (its launchers replaced by no-ops) and that of its key alone.

Every case runs to completion and prints its result even if another fails (errors are reported in the
table and in the JSON). Prints the torch / triton / CUDA versions and the GPU.

    python benchmarks/launch_overhead.py --json out.json     # on a GPU
    python benchmarks/launch_overhead.py --device cpu        # smoke test: interpreter, both paths are kernel[grid]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from _bench import host_us_per_call

# ----------------------------------------------------------------------------------- capture


@contextlib.contextmanager
def _recording(log: List[tuple]) -> Iterator[None]:
    """``kernel[grid](*args, **kw)`` records (kernel, grid, args, kw) instead of launching, for compiled
    and interpreted kernels alike; ``_launch.launch`` takes that path too while this is active."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from torchpatches.ops._runtime import launch as _launch

    def getitem(self: Any, grid: Any) -> Callable[..., None]:
        return lambda *args, **kw: log.append((self, grid, args, kw))

    saved = {cls: cls.__dict__.get("__getitem__") for cls in (JITFunction, InterpretedFunction)}
    saved_site = _launch._site_for
    saved_sites = dict(_launch._SITES)  # launch() finds a kernel's site here before it asks _site_for
    try:
        for cls in saved:
            cls.__getitem__ = getitem
        _launch._site_for = lambda kernel: None
        _launch._SITES.clear()
        yield
    finally:
        for cls, fn in saved.items():
            if fn is None:
                del cls.__getitem__
            else:
                cls.__getitem__ = fn
        _launch._site_for = saved_site
        _launch._SITES.clear()
        _launch._SITES.update(saved_sites)


def capture(call: Callable[[], Any]) -> Tuple[Any, tuple, tuple, dict]:
    log: List[tuple] = []
    with _recording(log):
        call()
    if len(log) != 1:
        raise RuntimeError(f"expected one launch from the op, saw {len(log)}")
    return log[0]


# ------------------------------------------------------------------------------------- cases
# Each case builds op inputs on `device` at size `n` (a row/feature size or a token count) with views at
# element offset `off`, and returns (call launching the op once, output tensors).


def _view(shape: Tuple[int, ...], off: int, dtype: torch.dtype, device: str, fill: bool = True) -> torch.Tensor:
    """A ``shape`` view at element offset ``off`` of a larger buffer (rows padded by 3)."""
    *lead, last = shape
    base = torch.randn(*lead, last + off + 3, device=device) if fill else torch.empty(*lead, last + off + 3,
                                                                                       device=device)
    return base.to(dtype)[..., off:off + last]


def case_swiglu(n: int, off: int, dtype: torch.dtype, device: str) -> Tuple[Callable[[], Any], List[torch.Tensor]]:
    from torchpatches.ops import _swiglu_triton

    x = _view((4, 2 * n), off, dtype, device)
    out = _view((4, n), off, dtype, device, fill=False)
    return (lambda: _swiglu_triton.launch(x, out)), [out]


def case_rows(n: int, off: int, dtype: torch.dtype, device: str) -> Tuple[Callable[[], Any], List[torch.Tensor]]:
    from torchpatches.ops import _rows_triton

    x = _view((4, n), off, dtype, device)
    out = _view((4, n), off, dtype, device, fill=False)
    return (lambda: _rows_triton.launch(x, out, 1)), [out]


def case_modulate(n: int, off: int, dtype: torch.dtype, device: str) -> Tuple[Callable[[], Any], List[torch.Tensor]]:
    from torchpatches.ops import _modulate_triton

    B, S, D = 2, 3, n
    res, y = _view((B, S, D), off, dtype, device), _view((B, S, D), off, dtype, device)
    gate, scale, shift = (_view((B, 1, D), off, dtype, device) for _ in range(3))
    h, o = _view((B, S, D), off, dtype, device, fill=False), _view((B, S, D), off, dtype, device, fill=False)
    return (lambda: _modulate_triton.launch(res, gate, y, scale, shift, h, o, eps=1e-6, clip=False)), [h, o]


def case_rope(n: int, off: int, dtype: torch.dtype, device: str) -> Tuple[Callable[[], Any], List[torch.Tensor]]:
    from torchpatches.ops import _rope_triton

    B, S, H, D = 1, n, 4, 32
    q, k = _view((B, S, H, D), off, dtype, device), _view((B, S, H, D), off, dtype, device)
    qo, ko = _view((B, S, H, D), off, dtype, device, fill=False), _view((B, S, H, D), off, dtype, device, fill=False)
    cos, sin = _view((S, D), off, torch.float32, device), _view((S, D), off, torch.float32, device)
    kernel = _rope_triton.kernel_for(torch.device(device).type)
    return (lambda: _rope_triton.launch(kernel, q, k, qo, ko, cos, sin, None, interleaved=True, cos_half=False,
                                        rotary_dim=D)), [qo, ko]


def case_qk_norm_rope(n: int, off: int, dtype: torch.dtype,
                      device: str) -> Tuple[Callable[[], Any], List[torch.Tensor]]:
    from torchpatches.ops import _qk_norm_rope_triton

    B, S_img, S_txt, H, D = 1, n, 2, 4, 32
    img = [_view((B, S_img, H, D), off, dtype, device) for _ in range(3)]
    txt = [_view((B, S_txt, H, D), off, dtype, device) for _ in range(3)]
    w = [torch.randn(D, device=device).to(dtype) for _ in range(4)]
    cos, sin = (torch.randn(S_txt + S_img, D, device=device) for _ in range(2))
    outs = [torch.empty(B, S_txt + S_img, H, D, device=device, dtype=dtype) for _ in range(3)]
    return (lambda: _qk_norm_rope_triton.launch(*img[:2], img[2], *txt, *w, (1e-6, 1e-6, 1e-6, 1e-6), cos, sin,
                                                *outs)), outs


CASES: Dict[str, Callable[..., Tuple[Callable[[], Any], List[torch.Tensor]]]] = {
    "modulate": case_modulate, "swiglu": case_swiglu, "rows": case_rows, "rope": case_rope,
    "qk_norm_rope": case_qk_norm_rope,
}
#: Size of the host-time runs per case: small, so the GPU keeps up with the host.
BENCH_SIZE = {"modulate": 3072, "swiglu": 3072, "rows": 3072, "rope": 16, "qk_norm_rope": 16}

# ------------------------------------------------------------------------------------ checks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_case(name: str, device: str, dtype: torch.dtype) -> Dict[str, Any]:
    """Bit-identity of ``launch`` against ``kernel[grid]`` over sizes and offsets (aligned, odd, aligned)."""
    from torchpatches.ops._runtime import launch as _launch

    row: Dict[str, Any] = {"case": name, "dtype": str(dtype).replace("torch.", ""), "checks": 0, "mismatches": []}
    kernel = None
    for n in (1, 16, 17):
        for off in (0, 1, 0, 3):
            try:
                call, outs = CASES[name](n, off, dtype, device)
                kernel, grid, args, kw = capture(call)
                for o in outs:
                    o.fill_(float("nan"))
                kernel[grid](*args, **kw)
                ref = [o.clone() for o in outs]
                for attempt in range(2):  # first: kernel.run or the class dict; then the exact dict
                    for o in outs:
                        o.fill_(float("nan"))
                    _launch.launch(kernel, grid, args, kw)
                    if device != "cpu":
                        torch.cuda.synchronize()
                    row["checks"] += 1
                    if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, ref)):
                        row["mismatches"].append(f"n={n} off={off} call={attempt}")
            except Exception as e:  # keep going: report it
                row["mismatches"].append(f"n={n} off={off}: {type(e).__name__}: {e}")
    row["info"] = _launch.info(kernel) if kernel is not None else {}
    row["ok"] = not row["mismatches"]
    return row


# -------------------------------------------------------------------------------------- timing


def _python_only(site: Any, fn: Callable[[], None], batch: int, repeats: int) -> float:
    """``launch``'s own time: the same calls with every cached launcher replaced by a no-op."""
    saved = []
    for pat in site.patterns.values():
        if pat is not None:
            saved.append((pat, dict(pat.exact)))
            for key, entry in pat.exact.items():
                pat.exact[key] = (lambda *a: None,) + entry[1:]
    try:
        return host_us_per_call(fn, batch, repeats, lambda: None)
    finally:
        for pat, exact in saved:
            pat.exact.update(exact)


def time_case(name: str, device: str, dtype: torch.dtype, batch: int, repeats: int) -> Dict[str, Any]:
    from torchpatches.ops._runtime import launch as _launch

    row: Dict[str, Any] = {"case": name, "size": BENCH_SIZE[name]}
    try:
        call, _ = CASES[name](BENCH_SIZE[name], 0, dtype, device)
        kernel, grid, args, kw = capture(call)
        row["n_args"], row["grid"] = len(args), list(grid)
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        row["kernel[grid] us"] = host_us_per_call(lambda: kernel[grid](*args, **kw), batch, repeats, sync)
        row["launch us"] = host_us_per_call(lambda: _launch.launch(kernel, grid, args, kw), batch, repeats, sync)
        site = _launch._SITES.get(id(kernel))
        entries = [e for p in getattr(site, "patterns", {}).values() if p is not None for e in p.exact.values()]
        if entries and device != "cpu":
            launcher, function, metadata, tail, _ = entries[-1]
            stream = torch.cuda.current_stream().cuda_stream
            g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
            row["launcher only us"] = host_us_per_call(
                lambda: launcher(*g, stream, function, metadata, None, None, None, *args, *tail), batch, repeats, sync)
            row["python us"] = _python_only(site, lambda: _launch.launch(kernel, grid, args, kw), batch, repeats)
            pat = site.last
            row["key us"] = host_us_per_call(lambda: pat.exact_key(*args), batch, repeats, lambda: None)
        row["speedup"] = row["kernel[grid] us"] / row["launch us"]
        row["info"] = _launch.info(kernel)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc(limit=4)
    return row


# ---------------------------------------------------------------------------------------- main


def versions(device: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "device": device}
    try:
        import triton

        out["triton"] = triton.__version__
        from torchpatches.ops._runtime import launch as _launch

        out["fast path"] = _launch._environment_reason() or "on"
    except Exception as e:
        out["triton"] = f"unavailable: {e}"
    if device != "cpu":
        out["gpu"] = torch.cuda.get_device_name()
    out["host"] = platform.processor() or platform.machine()
    return out


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch", type=int, default=100, help="launches per timed batch")
    parser.add_argument("--repeats", type=int, default=30, help="timed batches per measurement")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument("--json", help="write every result to this path")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: the interpreted kernels
        args.batch, args.repeats = min(args.batch, 2), min(args.repeats, 2)
    names = [c for c in args.cases.split(",") if c]
    info = versions(args.device)
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    results: Dict[str, Any] = {"versions": info, "checks": [], "timings": []}

    print("\ncorrectness: launch vs kernel[grid], bit-identical outputs (sizes 1/16/17, aligned and odd views)")
    for name in names:
        row = check_case(name, args.device, dtype) if name in CASES else {"case": name, "ok": False,
                                                                             "mismatches": ["unknown case"]}
        results["checks"].append(row)
        status = "ok" if row["ok"] else "FAIL " + "; ".join(row["mismatches"][:4])
        print(f"  {name:14s} {row.get('checks', 0):3d} checks  {status}  {row.get('info', '')}", flush=True)

    cols = ["kernel[grid] us", "launch us", "launcher only us", "python us", "key us", "speedup"]
    print(f"\nhost time per launch ({args.batch} launches per batch, median of {args.repeats} batches)")
    print(f"  {'case':14s} {'args':>4s} " + " ".join(f"{c:>16s}" for c in cols))
    for name in names:
        if name not in CASES:
            continue
        row = time_case(name, args.device, dtype, args.batch, args.repeats)
        results["timings"].append(row)
        if "error" in row:
            print(f"  {name:14s} ERROR {row['error']}", flush=True)
        else:
            print(f"  {name:14s} {row['n_args']:4d} " + " ".join(f"{_fmt(row.get(c, '-')):>16s}" for c in cols),
                  flush=True)

    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)
        print(f"\nwrote {args.json}")
    failed = [r["case"] for r in results["checks"] if not r["ok"]] + [r["case"] for r in results["timings"]
                                                                      if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
