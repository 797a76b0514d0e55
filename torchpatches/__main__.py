"""``python -m torchpatches``: the status table; exit code 1 if any patch failed.

    python -m torchpatches                 # status as it stands after `import torchpatches`
    python -m torchpatches --load          # import the patch targets first (Inductor, diffusers), then status
    python -m torchpatches --json          # machine-readable
    python -m torchpatches demo            # compile a tiny model with the patches, then status
    python -m torchpatches doctor [--json] SCRIPT [ARGS...]   # the script's graph breaks and recompiles
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import List, Optional

import torchpatches


def _import_targets() -> List[str]:
    """Import every module a patch targets so pending patches resolve; returns the ones that failed."""
    failures = []
    for name, patch_status in torchpatches.status().items():
        for target in patch_status.targets:
            module = target.path.split(":", 1)[0]
            try:
                importlib.import_module(module)
            except Exception as error:  # a missing optional dependency is reported, not fatal
                failures.append(f"{module}: {type(error).__name__}: {error}")
    return failures


def _status_json(status: torchpatches.Status) -> str:
    return json.dumps(
        {
            name: {
                "state": entry.state.value,
                "reason": entry.reason,
                "summary": entry.summary,
                "targets": [{"path": t.path, "state": t.state.value, "reason": t.reason} for t in entry.targets],
            }
            for name, entry in status.items()
        },
        indent=2,
    )


def _doctor_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchpatches doctor",
        description="Run SCRIPT as __main__ three times -- without torchpatches, with it, and with fullgraph "
        "semantics -- and report every graph break (and the patch that removes it), every recompile "
        "(and the guard that failed), and whether fullgraph=True compiles. Exit status: 0 when no graph "
        "break remains, 1 when some remain, 2 on a usage error.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the script's own prints go to stderr)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without torchpatches (fixed breaks are not listed)")
    parser.add_argument("--no-fullgraph", action="store_true", help="skip the fullgraph trial")
    parser.add_argument("script", help="a Python script; it runs with torchpatches applied")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script}")  # exits with status 2
    try:  # a script that cannot run at all is a usage error, not a finding
        with open(args.script, "rb") as handle:
            compile(handle.read(), args.script, "exec")
    except (OSError, SyntaxError, ValueError) as error:
        parser.error(f"cannot run {args.script}: {type(error).__name__}: {error}")

    from . import _doctor

    workload = _doctor.script_workload(args.script, args.args, stdout=sys.stderr if args.json else None)
    report = _doctor.diagnose(
        workload, target=args.script, baseline=not args.no_baseline, fullgraph=not args.no_fullgraph
    )
    print(json.dumps(report.to_json(), indent=2) if args.json else report)
    return report.exit_code


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:
        return _doctor_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m torchpatches", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("status", "demo", "doctor"), default="status")
    parser.add_argument("--load", action="store_true", help="import the patch targets first")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    if args.command == "doctor":  # reached only with options before it: "--json doctor script.py"
        parser.error("the doctor's options go after it: python -m torchpatches doctor [--json] SCRIPT [ARGS...]")
    if args.command == "demo":
        from . import _demo

        _demo.run()
    elif args.load:
        for failure in _import_targets():
            print(f"note: could not import {failure}", file=sys.stderr)
    status = torchpatches.status()
    print(_status_json(status) if args.json else status)
    return 1 if any(entry.state is torchpatches.PatchState.FAILED for entry in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
