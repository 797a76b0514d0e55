"""What `import torchpatches` costs on top of `import torch` (goals: <= 15 ms with bytecode caches, <= 30 ms without).

Each sample is a fresh interpreter that imports torch, then times `import torchpatches` with
perf_counter inside the process (so interpreter start-up and torch itself are excluded).
Two rows: with bytecode caches (what an installed package normally has: a warm-up run writes the
``.pyc`` files first), and without (``PYTHONDONTWRITEBYTECODE=1`` and an empty ``PYTHONPYCACHEPREFIX``:
every module is compiled from source, as on a read-only install or a shell exporting that variable).
The goal applies to the first. Prints a table; `--json PATH` writes the raw samples.

    python benchmarks/import_cost.py --runs 15
"""
from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile

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


def sample(runs: int, env: dict) -> list:
    rows = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                             env=env).stdout
        ms, states, heavy = out.strip().split("|")
        rows.append({"ms": float(ms), "states": states, "heavy_modules_loaded": heavy})
    return rows


def environments(prefix: str) -> dict:
    cached = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    uncached = dict(cached, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=prefix)
    return {"bytecode cached": cached, "no bytecode cache": uncached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", help="write samples here")
    args = parser.parse_args()
    import torch

    results = {}
    with tempfile.TemporaryDirectory(prefix="import-cost-empty-pycache-") as empty:
        for name, env in environments(empty).items():
            if name == "bytecode cached":
                sample(1, env)  # writes the .pyc files
            results[name] = sample(args.runs, env)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"{'':<18} {'runs':>5} {'median ms':>10} {'min ms':>8} {'max ms':>8}  goal")
    summary = {}
    for name, rows in results.items():
        times = sorted(row["ms"] for row in rows)
        median = statistics.median(times)
        summary[name] = median
        limit = 15 if name == "bytecode cached" else 30
        goal = f"<= {limit} ms: " + ("met" if median <= limit else "MISSED")
        print(f"{name:<18} {len(times):>5} {median:>10.1f} {times[0]:>8.1f} {times[-1]:>8.1f}  {goal}")
    last = results["bytecode cached"][-1]
    print(f"patch states at import: {last['states']}")
    print(f"heavy modules loaded by the import: {last['heavy_modules_loaded']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"torch": torch.__version__, "median_ms": summary, "samples": results}, handle, indent=2)


if __name__ == "__main__":
    main()
