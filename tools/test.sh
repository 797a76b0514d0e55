#!/usr/bin/env bash
# Run the test suite under each supported torch in its own virtual environment.
#
#   tools/test.sh                 # torch 2.11.0 and torch 2.13.0, one after the other
#   tools/test.sh 2.13.0 -k rope  # one torch version, extra arguments go to pytest
#
# Environments live in .venvs/torch-<version> and are created (and the package installed into
# them, editable, with its [test] extra) on first use. torch 2.11.0 is what the inductor_realize
# patch targets; 2.13.0 is the newest we verify (there the patch must be skipped).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VERSIONS=("2.11.0" "2.13.0")
if [[ $# -gt 0 && $1 =~ ^[0-9]+\.[0-9]+ ]]; then
    VERSIONS=("$1")
    shift
fi

setup_env() {
    local version=$1 venv=.venvs/torch-$1
    local stamp=$venv/.torchpatches-installed
    if [[ -f $stamp && $stamp -nt setup.cfg && $stamp -nt tools/constraints.txt ]]; then
        return 0
    fi
    echo "== creating $venv (torch $version)"
    "$PYTHON" -m venv "$venv" || return 1
    "$venv/bin/python" -m pip install -q --upgrade pip || return 1
    "$venv/bin/python" -m pip install -q -c tools/constraints.txt "torch==$version" -e ".[test]" || return 1
    touch "$stamp"
}

status=0
for version in "${VERSIONS[@]}"; do
    if ! setup_env "$version"; then
        echo "== could not set up torch $version" >&2
        status=1
        continue
    fi
    echo "== pytest under torch $version"
    ".venvs/torch-$version/bin/python" -m pytest "$@"
    code=$?
    if [[ $code -ne 0 ]]; then  # 5 (no tests collected) counts as a failure too
        echo "== torch $version: pytest exited $code" >&2
        status=1
    fi
done
exit $status
