"""Graph breaks of tiny diffusers transformers under torch.compile, before and after `compile_warnings`.

Prints the README table: model x argument form -> graphs / graph breaks / whether `fullgraph=True`
compiles, with the patch reverted ("before") and applied ("after"). CPU only, tiny configs, Dynamo
with the `eager` backend (graph breaks do not depend on the backend).

    python benchmarks/graph_breaks.py                 # the table
    python benchmarks/graph_breaks.py --json out.json # and the rows as JSON
    python benchmarks/graph_breaks.py --model flux1   # one model

The models and argument forms are the harness's GRAPH_BREAK_CASES (tests/harness), which the test suite
(tests/patches/test_compile_warnings.py) asserts on, so the table and the tests measure the same programs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # the tests' harness
import harness  # noqa: E402


def explain_counts(model: torch.nn.Module, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """graphs / graph breaks from torch._dynamo.explain, and whether fullgraph=True compiles."""
    report = harness.graph_report(model, backend="eager", **kwargs)  # fullgraph by trying it
    return {
        "graphs": report.graphs,
        "breaks": report.breaks,
        "fullgraph": report.fullgraph,
        "reasons": list(report.reasons),
        "fullgraph_error": report.error,
        # where Dynamo broke the graph, as the doctor captures it (explain does not count some of these)
        "sites": [f"{name}:{line}" for name, line in report.break_sites],
    }


def measure(case: harness.GraphBreakCase) -> Dict[str, Any]:
    import torchpatches

    model = case.build()
    row: Dict[str, Any] = {"model": case.model, "form": case.form}
    with harness.quiet(), harness.attn_checks(case.attn_checks), torch.no_grad():
        with torchpatches.disabled("compile_warnings"):
            row["before"] = explain_counts(model, case.inputs())
        row["after"] = explain_counts(model, case.inputs())
    row["patch_state"] = str(torchpatches.status()["compile_warnings"].state)
    return row


def format_table(rows: List[Dict[str, Any]]) -> str:
    def cell(m: Dict[str, Any]) -> str:
        if m["graphs"] is None:
            return "compile error"
        return f"{m['graphs']} / {m['breaks']} / {'yes' if m['fullgraph'] else 'no'}"

    def sites(r: Dict[str, Any]) -> str:
        return f"{len(r['before']['sites'])} → {len(r['after']['sites'])}"

    header = (
        "| model | argument form | before: graphs / breaks / fullgraph | after: graphs / breaks / fullgraph "
        "| break sites (doctor) |"
    )
    lines = [header, "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['form']} | {cell(r['before'])} | {cell(r['after'])} | {sites(r)} |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows (with break reasons) to this file")
    parser.add_argument("--model", action="append", help="only these models (repeatable)")
    parser.add_argument("--reasons", action="store_true", help="print the break reasons under the table")
    args = parser.parse_args(argv)

    import diffusers

    cases = [c for c in harness.GRAPH_BREAK_CASES if not args.model or c.model in args.model]
    rows = [measure(case) for case in cases]
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, python {sys.version.split()[0]}")
    print(format_table(rows))
    if args.reasons:
        for r in rows:
            for when in ("before", "after"):
                for reason in r[when]["reasons"]:
                    print(f"  {r['model']} / {r['form']} / {when}: {reason}")
                if r[when]["sites"]:
                    print(f"  {r['model']} / {r['form']} / {when} sites: {', '.join(r[when]['sites'])}")
                if r[when]["fullgraph_error"]:
                    print(f"  {r['model']} / {r['form']} / {when} fullgraph: {r[when]['fullgraph_error']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"torch": torch.__version__, "diffusers": diffusers.__version__, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHDYNAMO_VERBOSE", "0")
    sys.exit(main())
