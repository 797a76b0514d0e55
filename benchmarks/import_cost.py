"""What `import torchpatches` costs on top of `import torch` (goal: <= 30 ms).

Each sample is a fresh interpreter that imports torch, then times `import torchpatches` with
perf_counter inside the process (so interpreter start-up and torch itself are excluded).
Prints a table; `--json PATH` writes the raw samples.

    python benchmarks/import_cost.py --runs 15
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = r"""
import sys, time
import torch
start = time.perf_counter()
import torchpatches
elapsed = time.perf_counter() - start
states = {name: s.state.value for name, s in torchpatches.status().items()}
heavy = [m for m in ("diffusers", "triton", "flashinfer", "torch._inductor.ir", "torch._dynamo") if m in sys.modules]
print(elapsed * 1e3, states, heavy, sep="|")
"""


def sample(runs: int) -> list:
    rows = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
        ms, states, heavy = out.strip().split("|")
        rows.append({"ms": float(ms), "states": states, "heavy_modules_loaded": heavy})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", help="write samples here")
    args = parser.parse_args()
    rows = sample(args.runs)
    times = sorted(row["ms"] for row in rows)
    import torch

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"{'runs':>5} {'median ms':>10} {'min ms':>8} {'max ms':>8}  goal")
    median = statistics.median(times)
    print(f"{len(times):>5} {median:>10.1f} {times[0]:>8.1f} {times[-1]:>8.1f}  <= 30 ms: {'met' if median <= 30 else 'MISSED'}")
    print(f"patch states at import: {rows[-1]['states']}")
    print(f"heavy modules loaded by the import: {rows[-1]['heavy_modules_loaded']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"torch": torch.__version__, "median_ms": median, "samples": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
