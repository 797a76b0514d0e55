"""What the ``inductor_realize`` patch changes in Inductor's output: kernels, loop nests, buffers, bytes.

Each program is compiled twice from scratch (``torch._dynamo.reset()``, FX-graph and AOTAutograd
caches off), once with the patch reverted and once applied, and the generated code is measured with
``torchpatches.testing.inductor_report`` (kernels, nests, loads, buffers, bytes: see
``torchpatches.testing.InductorReport`` for what each counts).

    python benchmarks/inductor_realize.py                 # CPU, every program, a table
    python benchmarks/inductor_realize.py --json out.json --programs flux_tiny residual_chain
    python benchmarks/inductor_realize.py --device cuda --time   # GPU: also median step times

The programs are the harness's ``REALIZE_PROGRAMS`` (tests/harness), the equivalence-test programs of
tests/patches/test_inductor_realize.py, so the test and the table cannot drift apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # the tests' harness
import harness  # noqa: E402

PATCH_NAME = "inductor_realize"


def counts(report: harness.InductorReport) -> Dict[str, int]:
    return {name: getattr(report, name) for name in ("kernels", "nests", "loads", "buffers", "bytes")}


def measure_both(program: harness.Program, device: torch.device) -> Tuple[harness.InductorReport, harness.InductorReport]:
    """(original, patched) for one program, this patch alone in both."""
    import torchpatches

    fn, args = program.build(device)
    with torchpatches.only():
        original = harness.inductor_report(fn, *args)
    with torchpatches.only(PATCH_NAME):
        patched = harness.inductor_report(fn, *args)
    return original, patched


def _median_step_ms(fn: Callable[..., Any], args: Tuple[Any, ...], device: torch.device, steps: int = 50) -> float:
    compiled = torch.compile(fn, fullgraph=True)
    times = []
    with torch.no_grad():
        for step in range(steps + 5):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            compiled(*args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 5:
                times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cpu")
    programs = harness.REALIZE_PROGRAMS
    parser.add_argument("--programs", nargs="*", default=list(programs), choices=list(programs))
    parser.add_argument("--time", action="store_true", help="also time compiled steps (meaningful on a GPU)")
    parser.add_argument("--json", help="write the results to this file")
    options = parser.parse_args(argv)

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="torchpatches-realize-"))
    import torchpatches

    device = torch.device(options.device)
    results: Dict[str, Any] = {"torch": torch.__version__, "device": str(device), "programs": {}}
    header = f"{'program':<16} {'':>9} {'kernels':>7} {'nests':>5} {'loads':>5} {'buffers':>7} {'bytes':>9}"
    if options.time:
        header += f" {'step ms':>8}"
    print(header)
    for name in options.programs:
        program = programs[name]
        original, patched = measure_both(program, device)
        row: Dict[str, Any] = {"original": counts(original), "patched": counts(patched), "note": program.note}
        if options.time:
            fn, args = program.build(device)
            for label, on in (("original", ()), ("patched", (PATCH_NAME,))):
                with torchpatches.only(*on):
                    torch._dynamo.reset()
                    row[label]["step_ms"] = _median_step_ms(fn, args, device)
        results["programs"][name] = row
        for label in ("original", "patched"):
            measured = row[label]
            line = (f"{name if label == 'original' else '':<16} {label:>9} {measured['kernels']:>7} {measured['nests']:>5} "
                    f"{measured['loads']:>5} {measured['buffers']:>7} {measured['bytes']:>9}")
            if options.time:
                line += f" {measured['step_ms']:>8.3f}"
            print(line)
        sys.stdout.flush()
    state = torchpatches.status()[PATCH_NAME]
    results["patch_state"] = f"{state.state.value}: {state.reason}"
    print(f"# torch {torch.__version__} on {device}; {PATCH_NAME} after the runs: {results['patch_state']}")
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
