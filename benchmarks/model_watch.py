"""Host time of the model check `cuda_graphs.graphed` runs before every replay (``ModelWatch.changed``).

The check reads every module of the tree, so its cost follows the module count: FLUX.1 has 1,279 modules, 6,229
with ``flux_lora.py``'s adapter on its 495 projections, 7,714 with two. This times it on FLUX.1's tree (19 + 38
blocks at the tiny widths: the check reads modules, not values) without adapters and in each of
``flux_lora.py``'s cases, median wall milliseconds per check over ``--repeats`` batches. With ``--baseline REV``
the ``_graph_keys.py`` of that git revision is loaded beside the current one and the two alternate (A B A B).
The host CPU is what it measures; the model stays on the CPU.

    python benchmarks/model_watch.py --baseline 820bdb3 --json model-watch.json
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import types
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402,I001

import torch  # noqa: E402

from torchpatches.cuda_graphs._keys import ModelWatch  # noqa: E402


def watch_class_at(revision: str) -> Any:
    """``ModelWatch`` as the git revision ``revision`` wrote it (loaded from ``git show``, not imported), or
    from a copy of ``_graph_keys.py`` at that path (a machine without the repository's history)."""
    if os.path.isfile(revision):
        with open(revision) as file:
            source = file.read()
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        source = subprocess.run(["git", "show", f"{revision}:torchpatches/cuda_graphs/_keys.py"], cwd=root, check=True,
                                capture_output=True, text=True).stdout
    module = types.ModuleType("graph_keys_baseline")
    exec(compile(source, f"{revision}:_graph_keys.py", "exec"), module.__dict__)
    return module.ModelWatch


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", metavar="REV", help="git revision (or a copy of its _graph_keys.py) whose "
                        "ModelWatch is timed beside this one")
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import flux_lora
    from flux_fused import TINY, build

    classes = {"current": ModelWatch}
    if args.baseline:
        classes = {"baseline": watch_class_at(args.baseline), **classes}
        print(f"baseline: ModelWatch of {args.baseline}")
    config = dict(TINY["flux1"], num_layers=19, num_single_layers=38)
    model = build("flux1", config, torch.device("cpu"), torch.float32)
    results: Dict[str, Any] = {"versions": _bench.versions(), "command": _bench.command_line(argv),
                               "baseline": args.baseline, "cases": {}}
    print(f"{'case':<12}{'modules':>8}{'tensors':>8}" + "".join(f"{name + ' ms':>16}" for name in classes)
          + ("    ratio" if args.baseline else ""))

    def measure(case: str) -> None:
        watches = {name: cls(model) for name, cls in classes.items()}
        if any(watch.changed() for watch in watches.values()):
            raise RuntimeError(f"{case}: a fresh snapshot reports a change")
        times: Dict[str, List[float]] = {name: [] for name in watches}
        for _ in range(args.repeats):  # alternated, each a median of its own batches
            for name, watch in watches.items():
                times[name].append(_bench.host_us_per_call(watch.changed, args.batch, 3, lambda: None) / 1e3)
        row: Dict[str, Any] = {"modules": sum(1 for _ in model.modules()),
                               "tensors": sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())}
        row.update({f"{name}_ms": statistics.median(ts) for name, ts in times.items()})
        results["cases"][case] = row
        line = f"{case:<12}{row['modules']:>8}{row['tensors']:>8}" + "".join(
            f"{row[f'{name}_ms']:>16.2f}" for name in watches)
        if args.baseline:
            line += f"{row['current_ms'] / row['baseline_ms']:>9.3f}"
        print(line, flush=True)

    model.eval()
    measure("no adapter")
    if importlib.util.find_spec("peft") is None:
        print("peft is not installed: the cases with adapters were not measured")
        _bench.save_json(args.json, results)
        return 0
    for name, setup, _ in flux_lora.cases(model, 4):
        setup()
        model.eval()
        measure(name)
    _bench.save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
