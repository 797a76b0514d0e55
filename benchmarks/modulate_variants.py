"""Variants of the modulate kernel (``torchpatches.ops._modulate_triton``) at FLUX widths, on the GPU.

An experiment, not part of the package: each variant is the package's kernel source with one change,
compiled from a temporary module, swapped in for the op's kernel while it is timed; outputs are compared
with the package kernel's bit for bit. Variants:

- ``package``: the kernel as shipped (since issue 17 round 4 it loads the modulation vectors after the
  LayerNorm statistics: this script's first run measured that order as its ``late`` variant);
- ``early``: scale and shift loaded before the statistics, with the activations (the order before round 4);
- ``stream``: the activations read with ``evict_first`` and the outputs written with ``.cs`` (streaming), so
  the vectors that every row re-reads stay in L2. Beware: replaying one op on the same inputs lets a 28 MB
  input stay in the 50 MB L2 from one replay to the next once the outputs stop evicting it, which a model
  step does not do; judge this one by the whole-model A/B (``benchmarks/dit.py --variants eager,modulate:stream``).

GPU µs from CUDA-graph replays (``fused.graph_us``), % of the device-to-device copy rate; one or two rows per
program with 4 or 8 warps.

    python benchmarks/modulate_variants.py [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from fused import as_list, copy_rate, graph_us, rnd

_LOAD_X = "x = tl.load(res_ptr + (b * r_sb + s * r_ss)[:, None] + d[None, :], mask=m, other=0.0)"
_VECTORS = (
    "        sc = tl.load(scale_ptr + (b * c_sb + s * c_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)\n"
    "        sh = tl.load(shift_ptr + (b * t_sb + s * t_ss)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)\n")
_AFTER_STATS = "        rstd = _rsqrt(var + eps, LIBDEVICE)\n"
_AFTER_LOADS = ("        y = tl.load(y_ptr + (b * y_sb + s * y_ss)[:, None] + d[None, :], mask=m, other=0.0)"
                ".to(tl.float32)\n")
_STORES = ("x.to(ty), mask=m)", "o.to(ty), mask=m)")


def _early(src: str) -> str:
    late = _AFTER_STATS + _VECTORS
    assert src.count(late) == 1 and src.count(_AFTER_LOADS) == 1, "kernel source changed: update the variant"
    return src.replace(late, _AFTER_STATS).replace(_AFTER_LOADS, _AFTER_LOADS + "    if HAS_NORM:\n" + _VECTORS)


def _stream(src: str) -> str:
    assert src.count(_LOAD_X) == 1 and all(src.count(s) == 1 for s in _STORES), "kernel source changed"
    src = src.replace(_LOAD_X, _LOAD_X[:-1] + ', eviction_policy="evict_first")')
    for store in _STORES:
        src = src.replace(store, store[:-1] + ', cache_modifier=".cs")')
    return src


VARIANTS: Dict[str, Callable[[str], str]] = {"package": lambda src: src, "early": _early, "stream": _stream}


def build(name: str, workdir: Path) -> Any:
    """The variant's kernel, compiled by triton from a module written to ``workdir``."""
    import triton

    from torchpatches.ops import _modulate_triton

    src = VARIANTS[name](inspect.getsource(_modulate_triton._modulate_kernel))
    header = ("import triton.language as tl\n"
              "from torchpatches.ops._runtime.triton_common import _mul_rn, _round_to, _rsqrt, _sum_combine\n\n\n")
    path = workdir / f"modulate_{name.replace('+', '_')}.py"
    path.write_text(header + src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return triton.jit(module._modulate_kernel)


@contextlib.contextmanager
def kernel(compiled: Any, warps: Optional[int] = None, rows: Optional[int] = None) -> Iterator[None]:
    """``compiled`` as the op's CUDA kernel (and a launch configuration, else the package's) for the block."""
    from _bench import cuda_kernel, launch_config
    from torchpatches.ops import _modulate_triton

    config = {k: v for k, v in (("num_warps", warps), ("ROWS", rows)) if v}
    with launch_config(**config), cuda_kernel(_modulate_triton, compiled):
        yield


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The op runs the named variant's kernel for the block (``benchmarks/_bench.state("modulate:NAME")``)."""
    with kernel(build(name, Path(tempfile.mkdtemp(prefix="modulate-variant-")))):
        yield


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from torchpatches.ops import _modulate as modulate

    device = torch.device("cuda")
    gbps = copy_rate(device)
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {name: build(name, Path(tmp)) for name in VARIANTS}
        for D in (3072, 6144):
            S = 4608
            torch.manual_seed(0)
            x, y = rnd(1, S, D, device=device), rnd(1, S, D, device=device)
            v = rnd(1, 3 * D, device=device, scale=0.5)
            sc, sh, g = v[:, :D], v[:, D:2 * D], v[:, 2 * D:]
            ops = {
                "ln_mod": (lambda: modulate.layer_norm_modulate(x, sc, sh), 2),
                "res_ln_mod": (lambda: modulate.gate_residual_layer_norm_modulate(x, g, y, sc, sh), 4),
                "res": (lambda: modulate.gate_residual(x, g, y), 3),
            }
            reference = {op: [t.clone() for t in as_list(fn())] for op, (fn, _) in ops.items()}
            for (name, compiled), warps, rows in itertools.product(kernels.items(), (4, 8), (1, 2)):
                row: Dict[str, Any] = dict(D=D, variant=name, num_warps=warps, rows=rows)
                with kernel(compiled, warps, rows):
                    for op, (fn, passes) in ops.items():
                        same = all(torch.equal(a, b) for a, b in zip(as_list(fn()), reference[op]))
                        us = graph_us(fn, device)
                        row[op] = dict(us=us, pct=100 * passes * S * D * 2 / (gbps * 1e3) / us, same=same)
                results.append(row)
                print(json.dumps(row), flush=True)
    print(f"\ncopy rate {gbps:.0f} GB/s; GPU us (% of copy), '!' where outputs differ from the package kernel's")
    print(f"{'D':>5} {'variant':<12} {'warps':>5} {'rows':>4} " + "".join(f"{op:>18}" for op in ("ln_mod", "res_ln_mod", "res")))
    for r in results:
        cells = "".join(f"{r[op]['us']:>9.1f} ({r[op]['pct']:4.1f}%){'' if r[op]['same'] else '!'}"
                        for op in ("ln_mod", "res_ln_mod", "res"))
        print(f"{r['D']:>5} {r['variant']:<12} {r['num_warps']:>5} {r['rows']:>4} {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_GBps=gbps, device=torch.cuda.get_device_name(),
                                                   torch=torch.__version__, rows=results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
