"""``python -m torchpatches``: the status table; exit code 1 if any patch failed.

    python -m torchpatches                 # status as it stands after `import torchpatches`
    python -m torchpatches --load          # import the patch targets first (Inductor, diffusers), then status
    python -m torchpatches --json          # machine-readable
    python -m torchpatches demo            # compile a tiny model with the patches, then status
"""
from __future__ import annotations

import argparse
import importlib
import json
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


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchpatches", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("status", "demo"), default="status")
    parser.add_argument("--load", action="store_true", help="import the patch targets first")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

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
