#!/usr/bin/env bash
# One device-tool lease (H100/H200, torch 2.11 + triton 3.6, no network): the GPU checks and the FLUX.1-dev eager
# re-check after a refactor, in one call so the lease is short. Needs, carried into the repo root:
#   .whl/  diffusers 0.42.1 + importlib_metadata wheels (docs/development.md: "GPU runs")
#   .old/before/  the torchpatches/ and benchmarks/ trees to compare with (git archive REV torchpatches benchmarks)
# Writes under $OUT: pytest.txt, fused.json, before-N.json / after-N.json (eager vanilla vs all, A B A B in each
# process; before and after alternated across processes), after-compiled.json (a compile ran first), summary.txt.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"

# 1. Correctness on the GPU: the fused paths' step-aside cases (compiled Triton tier), the launch path.
TORCHPATCHES_TEST_DEVICE=cuda PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/patches/test_fused_step_aside.py tests/ops/test_launch.py 2>&1 | tail -15 | tee "$OUT/pytest.txt"
# 2. Each fused op against diffusers' code at FLUX shapes (bit-identical fraction, ulps).
PYTHONPATH=/tmp/site:$PWD timeout 180 python3 benchmarks/fused.py --no-sweep --json "$OUT/fused.json" 2>&1 | tail -25
# 3. FLUX.1-dev eager step: the tree before vs after, alternated.
flux() {  # tree name json [extra args]
    local tree=$1 name=$2; shift 2
    PYTHONPATH=/tmp/site:$tree timeout 240 python3 "$tree/benchmarks/flux_fused.py" --models flux1 --modes eager \
        --patterns "" --json "$OUT/$name.json" "$@" 2>&1 | grep -E "eager/|built" | head -12
}
for i in 1 2; do
    flux "$PWD/.old/before" "before-$i"
    flux "$PWD" "after-$i" $([ "$i" = 1 ] && echo --profile)
done
flux "$PWD" after-compiled --after-compile
PYTHONPATH=/tmp/site:$PWD python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*-*.json")):
    if path.name == "fused.json":
        continue
    steps = json.loads(path.read_text())["models"]["flux1"]["steps"]
    row = {k.split("/")[1]: (v["median_ms"], v["host_ms"]) for k, v in steps.items()}
    van = min(row["vanilla"][0], row["vanilla+"][0]); fused = min(row["all"][0], row["all+"][0])
    print(f"{path.stem:16} vanilla {row['vanilla'][0]:.2f}/{row['vanilla+'][0]:.2f}  all {row['all'][0]:.2f}/"
          f"{row['all+'][0]:.2f} ms  ratio {fused / van:.3f}x  host all {row['all'][1]:.1f}/{row['all+'][1]:.1f} ms")
PY
