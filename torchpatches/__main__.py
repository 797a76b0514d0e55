"""``python -m torchpatches``: the status table; exit code 1 if any patch failed.

    python -m torchpatches                 # status as it stands after `import torchpatches`
    python -m torchpatches --load          # import the patch targets first (Inductor, diffusers), then status
    python -m torchpatches --json          # machine-readable
    python -m torchpatches demo            # compile a tiny model with the patches, then status
    python -m torchpatches doctor [--json] SCRIPT [ARGS...]   # the script's graph breaks and recompiles
    python -m torchpatches coverage [--json] SCRIPT [ARGS...] # what fused in the script's models, and why not

Exit status 141 when stdout is closed early (``| head``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import List, Optional, Tuple

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


#: Exit status when stdout is closed before the report is written (``... | head``): 128 + SIGPIPE, as
#: a shell reports a process that SIGPIPE ended; 1 stays "a patch failed" / "graph breaks remain".
EXIT_BROKEN_PIPE = 141

_DOCTOR_OPTIONS_WITH_VALUE = ("--json-out",)


def _split_script(argv: List[str]) -> Tuple[List[str], List[str]]:
    """(the doctor's options and SCRIPT, the script's arguments verbatim): everything after SCRIPT is the
    script's, ``--`` included, as ``python SCRIPT -- b`` passes it; a ``--`` before SCRIPT ends the options."""
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":  # kept for argparse: SCRIPT may start with "-"
            return argv[:index + 2], argv[index + 2:]
        if token in _DOCTOR_OPTIONS_WITH_VALUE:
            index += 2
            continue
        if not token.startswith("-") or token == "-":
            return argv[:index + 1], argv[index + 1:]
        index += 1
    return argv, []


def _doctor_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchpatches doctor",
        usage="%(prog)s [--json] [--json-out FILE] [--no-baseline] [--no-fullgraph] SCRIPT [ARGS...]",
        description="Run SCRIPT as __main__ three times, each in its own process -- without torchpatches, "
        "with it, and with fullgraph semantics -- and report every graph break (and the patch that removes it), "
        "every recompile (and the guard that failed), and whether fullgraph=True compiles. Exit status: 0 when "
        "no graph break remains, 1 when some remain (or the run with torchpatches failed), 2 on a usage error, "
        "3 when nothing can be judged (nothing was compiled).",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout (everything the "
                        "script and its processes write to stdout goes to stderr)")
    parser.add_argument("--json-out", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without torchpatches (fixed breaks are not listed)")
    parser.add_argument("--no-fullgraph", action="store_true", help="skip the fullgraph trial")
    parser.add_argument("script", help="a Python script; it runs with torchpatches applied")
    options, script_args = _split_script(argv)
    args = parser.parse_args(options)
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script}")  # exits with status 2
    try:  # a script that cannot run at all is a usage error, not a finding
        with open(args.script, "rb") as handle:
            compile(handle.read(), args.script, "exec")
    except (OSError, SyntaxError, ValueError) as error:
        parser.error(f"cannot run {args.script}: {type(error).__name__}: {error}")

    from ._doctor import script as _doctor_script

    report = _doctor_script.diagnose_script(
        torchpatches, args.script, script_args, json_mode=args.json, baseline=not args.no_baseline,
        fullgraph=not args.no_fullgraph,
    )
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as handle:
            json.dump(report.to_json(), handle, indent=2)
    print(json.dumps(report.to_json(), indent=2) if args.json else report)
    return report.exit_code


def _coverage_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchpatches coverage", usage="%(prog)s [--json] SCRIPT [ARGS...]",
        description="Run SCRIPT as __main__ in this process with torchpatches applied and report, per eager fusion "
        "pattern and class, the calls fused and those handed to diffusers' code with the reason, and the classes "
        "of the script's models that no pattern targets. Time one call on a GPU with torchpatches.coverage(model, "
        "...). Exit status: 0, or 2 on a usage error.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("script", help="a Python script; it runs with torchpatches applied")
    options, script_args = _split_script(argv)
    args = parser.parse_args(options)
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script}")

    from ._coverage import run as _coverage

    report = _coverage.coverage_script(torchpatches, args.script, script_args)
    print(json.dumps(report.to_json(), indent=2) if args.json else report)
    return 0


def _description() -> str:
    """The first line of this module's docstring (None under ``python -OO``)."""
    return (__doc__ or "python -m torchpatches: the status table").splitlines()[0]


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:
        return _doctor_main(argv[1:])
    if argv[:1] == ["coverage"]:
        return _coverage_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m torchpatches", description=_description())
    parser.add_argument("command", nargs="?", choices=("status", "demo", "doctor", "coverage"), default="status")
    parser.add_argument("--load", action="store_true", help="import the patch targets first")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    if args.command in ("doctor", "coverage"):  # reached only with options before it: "--json doctor script.py"
        parser.error(f"the {args.command} command's options go after it: "
                     f"python -m torchpatches {args.command} [--json] SCRIPT [ARGS...]")
    if args.command == "demo":
        from . import _demo

        _demo.run(torchpatches)
    elif args.load:
        for failure in _import_targets():
            print(f"note: could not import {failure}", file=sys.stderr)
    status = torchpatches.status()
    print(_status_json(status) if args.json else status)
    return 1 if any(entry.state is torchpatches.PatchState.FAILED for entry in status.values()) else 0


def run(argv: Optional[List[str]] = None) -> int:
    """:func:`main`, with a closed stdout handled as the Python docs advise for SIGPIPE: no traceback,
    the rest of the output to devnull, and its own exit status (:data:`EXIT_BROKEN_PIPE`)."""
    try:
        code = main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(run())
