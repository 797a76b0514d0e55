"""Two versions of torchpatches on the same models: is a refactor as fast as the code it replaces?

``dit.py`` compares variants inside one process, but a process imports one torchpatches. This script runs
``dit.py`` once per model and tree, trees alternated (A B, then B A in the next repeat), each process with its
tree first on ``PYTHONPATH``, and compares what the trees share: eager + torchpatches against eager diffusers
(``eager/all`` / ``eager/vanilla``, the same process), so a machine that drifts between processes cancels out.

    python benchmarks/code_ab.py --trees old=/tmp/old-tree,new=$PWD --models flux1,sd3 --repeats 2 --json ab.json
    python benchmarks/code_ab.py --trees a=$PWD,b=$PWD --models sd3 --tiny          # CPU smoke test

A tree is a directory holding a ``torchpatches`` package (a checkout, or ``git archive`` of one). Extra arguments
after ``--`` go to every ``dit.py`` run (default: ``--rounds 3 --round-ms 600 --warmup 1 --no-grad
--no-profile``). Prints per model and tree the median over repeats of the ratio and of eager + torchpatches' step
and host ms, then new / old (the last tree against the first); ``--json`` writes the runs and the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIT_ARGS = ["--rounds", "3", "--round-ms", "600", "--warmup", "1", "--no-grad", "--no-profile"]


def parse_trees(text: str) -> List[Tuple[str, str]]:
    """``name=dir,name=dir`` (two or more), each dir holding a ``torchpatches`` package."""
    trees = []
    for item in text.split(","):
        name, sep, path = item.partition("=")
        if not sep or not name or not os.path.isdir(os.path.join(path, "torchpatches")):
            raise SystemExit(f"--trees: {item!r} is not NAME=DIR with DIR/torchpatches")
        trees.append((name, os.path.abspath(path)))
    if len(trees) < 2 or len({name for name, _ in trees}) != len(trees):
        raise SystemExit("--trees: two or more trees with distinct names")
    return trees


def run_dit(tree: str, model: str, dit_args: List[str], tiny: bool) -> Dict[str, Any]:
    """One ``dit.py`` process over ``model`` with ``tree``'s torchpatches: that model's entry of its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        command = [sys.executable, os.path.join(HERE, "dit.py"), "--models", model,
                   "--variants", "eager/vanilla,eager/all", "--json", path] + (["--tiny"] if tiny else []) + dit_args
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(path) as handle:
            return json.load(handle)["models"][model]


def row_numbers(entry: Dict[str, Any]) -> Dict[str, float]:
    rows = entry["rows"]
    vanilla, fused = rows["eager/vanilla"], rows["eager/all"]
    return {"ratio": fused["median_ms"] / vanilla["median_ms"], "ms": fused["median_ms"],
            "host_ms": fused.get("host_ms") or float("nan")}


def table(runs: Dict[str, Dict[str, List[Dict[str, float]]]], trees: List[str]) -> List[Dict[str, Any]]:
    """Per model: each tree's median over repeats of ratio / ms / host ms, and the last tree's ratio over the
    first's."""
    out = []
    for model, per_tree in runs.items():
        line: Dict[str, Any] = {"model": model}
        for tree in trees:
            for key in ("ratio", "ms", "host_ms"):
                line[f"{tree}_{key}"] = statistics.median(r[key] for r in per_tree[tree])
        line["last_over_first"] = line[f"{trees[-1]}_ratio"] / line[f"{trees[0]}_ratio"]
        out.append(line)
    return out


def print_table(lines: List[Dict[str, Any]], trees: List[str]) -> None:
    head = f"{'model':<16}" + "".join(f"{t + ' all/van':>14}{t + ' ms':>10}{t + ' host':>10}" for t in trees)
    print(head + f"{trees[-1] + '/' + trees[0]:>12}")
    for line in lines:
        cells = "".join(f"{line[t + '_ratio']:>13.3f}x{line[t + '_ms']:>10.2f}{line[t + '_host_ms']:>10.2f}"
                        for t in trees)
        print(f"{line['model']:<16}{cells}{line['last_over_first']:>11.3f}x")


def main() -> None:
    argv = sys.argv[1:]
    dit_args = DEFAULT_DIT_ARGS
    if "--" in argv:
        cut = argv.index("--")
        argv, dit_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", required=True, help="name=dir,name=dir: the torchpatches versions, first = base")
    parser.add_argument("--models", required=True, help="comma-separated dit.py model names")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="dit.py's tiny CPU configs")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    trees = parse_trees(args.trees)
    if args.tiny and dit_args is DEFAULT_DIT_ARGS:
        dit_args = ["--rounds", "1", "--round-ms", "50"]
    names = [name for name, _ in trees]
    runs: Dict[str, Dict[str, List[Dict[str, float]]]] = {}
    raw: List[Dict[str, Any]] = []
    for repeat in range(args.repeats):
        order = trees if repeat % 2 == 0 else trees[::-1]
        for model in args.models.split(","):
            for name, path in order:
                entry = run_dit(path, model, dit_args, args.tiny)
                runs.setdefault(model, {n: [] for n in names})[name].append(row_numbers(entry))
                raw.append({"repeat": repeat, "model": model, "tree": name, "entry": entry})
    lines = table(runs, names)
    print_table(lines, names)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"trees": dict(trees), "dit_args": dit_args, "table": lines, "runs": raw}, handle, indent=1)


if __name__ == "__main__":
    main()
