"""Launch-configuration sweep of the row kernel that fills FLUX.1's single-block buffer (issue 17, goal 2).

``gate_residual`` writes ``gelu(mlp)`` ([4608, 12288]) and the attention output ([4608, 3072]) into the column halves
of one [4608, 15360] buffer with ``ops._rows_triton``'s kernel: one program per row and block of ``cap`` = 2048
columns, 4 warps (``_triton_common.launch_rows``). That configuration reached 92% of the copy rate on an H100
(docs/fused.md, round 4); on an H200 a FLUX.1-dev step's 76 calls take 3.6 ms, about 3.0 TB/s. This sweeps the
block width and warps on the device at hand: GPU us per block's two calls (CUDA events, ``--reps`` repetitions, the
configurations alternated in ``--rounds`` rounds), % of the copy rate measured in the same run, outputs compared
with the package configuration's bit for bit.

    python benchmarks/rows_sweep.py --json out.json
    python benchmarks/dit.py --models flux1 --variants eager,rows:4096x8,regional   # a configuration in the model
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from typing import Any, Dict, Iterator, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

M, WIDTH, MLP = 4608, 3072, 12288
CONFIGS: Tuple[Tuple[int, int], ...] = ((2048, 4), (1024, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (1024, 2))


def fill(x: torch.Tensor, out: torch.Tensor, act: int, cap: int, warps: int) -> None:
    """``_rows_triton.launch`` with the block width ``cap`` and ``warps`` given."""
    from torchpatches.ops import _rows_triton
    from torchpatches.ops._runtime.triton_common import KINDS, cdiv, launch_kernel

    n = out.shape[1]
    block = cap if n >= cap else max(16, 1 << (n - 1).bit_length())
    launch_kernel(_rows_triton.kernel_for("cuda"), (out.shape[0], cdiv(n, block)),
                  (x, out, n, x.stride(0), out.stride(0)),
                  dict(BLOCK=block, KIND=KINDS[out.dtype], LIBDEVICE=True, ACT=act, num_warps=warps))


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Every patch applied (the caller's state), the row kernel launched with ``name`` = ``CAPxWARPS`` (``_bench``
    variant ``rows:CAPxWARPS``)."""
    from torchpatches.ops import _rows_triton

    try:
        cap, warps = (int(part) for part in name.split("x"))
    except ValueError:
        raise ValueError(f"row-kernel configuration {name!r}: expected CAPxWARPS, e.g. 4096x8") from None
    original = _rows_triton.launch
    _rows_triton.launch = lambda x, out, act: fill(x, out, act, cap, warps)
    try:
        yield
    finally:
        _rows_triton.launch = original


def best(path: str) -> str:
    """The fastest configuration of a sweep's JSON, as ``CAPxWARPS`` (for the session script)."""
    rows = json.load(open(path))["rows"]
    return min((row["median_us"], key) for key, row in rows.items() if key != "copy" and row["identical"])[1]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import torchpatches  # noqa: F401

    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    mlp = torch.randn(M, MLP, device=device, dtype=torch.bfloat16, generator=gen)
    attn = torch.randn(M, WIDTH, device=device, dtype=torch.bfloat16, generator=gen)
    buf = torch.empty(M, WIDTH + MLP, device=device, dtype=torch.bfloat16)
    moved = 2 * (mlp.numel() + attn.numel()) * 2  # each element read once and written once, bf16

    src = torch.empty(moved // 4, device=device, dtype=torch.bfloat16)  # the same bytes moved by a plain copy
    dst = torch.empty_like(src)

    def block(cap: int, warps: int) -> None:
        fill(mlp, buf[:, WIDTH:], 1, cap, warps)
        fill(attn, buf[:, :WIDTH], 0, cap, warps)

    block(*CONFIGS[0])
    reference = buf.clone()
    rows: Dict[str, Dict[str, Any]] = {}
    for cap, warps in CONFIGS:
        buf.zero_()
        block(cap, warps)
        rows[f"{cap}x{warps}"] = dict(cap=cap, warps=warps, identical=bool(torch.equal(buf, reference)), us=[])
    rows["copy"] = dict(us=[])
    for _ in range(args.rounds):
        rows["copy"]["us"].append(_bench.time_back_to_back(lambda: dst.copy_(src), args.reps, 1)[0] * 1e3)
        for cap, warps in CONFIGS:
            rows[f"{cap}x{warps}"]["us"].append(
                _bench.time_back_to_back(lambda: block(cap, warps), args.reps, 1)[0] * 1e3)
    copy_us = statistics.median(rows["copy"]["us"])
    print(f"{torch.cuda.get_device_name()}: FLUX.1-dev single block's buffer ({moved / 1e6:.1f} MB moved), "
          f"copy of the same bytes {copy_us:.1f} us ({moved / copy_us / 1e3:.0f} GB/s)")
    for key, row in rows.items():
        row["median_us"] = statistics.median(row["us"])
        row["pct_of_copy"] = 100 * copy_us / row["median_us"]
        if key != "copy":
            print(f"  cap {row['cap']:>5} warps {row['warps']}: {row['median_us']:7.1f} us ({row['pct_of_copy']:5.1f}% "
                  f"of copy), identical {row['identical']}", flush=True)
    _bench.save_json(args.json, {"versions": _bench.versions(), "command": _bench.command_line(argv), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
