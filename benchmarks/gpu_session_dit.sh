#!/usr/bin/env bash
# One device-tool call (H100/H200, no network): benchmarks/dit.py model by model, each in its own process (a fresh
# process per model: the eager rows' "fresh" state is real), within one call's 600 s. Needs, carried into the repo
# root: .whl/ (diffusers 0.42.1 + importlib_metadata wheels; docs/development.md: "GPU runs").
#
#   bash benchmarks/gpu_session_dit.sh wan                 # one model
#   bash benchmarks/gpu_session_dit.sh flux1 sd3           # several, one after the other
#   DIT_ARGS="--variants eager,regional" bash benchmarks/gpu_session_dit.sh qwenimage
#
# Each model gets the seconds left of DIT_BUDGET (default 560) minus 5, so a model that overruns is cut short
# (its JSON holds every first call and round done) and the summary still prints. Writes under $OUT (at most 8
# files come back: one JSON per model, one log): dit-MODEL.json, log.txt (every model's output), summary.txt
# (every model's table and the one-line-per-model summary). Summaries of several calls' files, anywhere:
#   python benchmarks/dit.py --summary dit-*.json
#
# Expected device seconds per model on an H100 (estimated from the script's structure and issue 16/17's step and
# compile times, not yet measured; each includes ~15 s of imports): flux1 ~180 (regional 2 x ~22 s, full on 2+4
# blocks 2 x ~20 s), flux2 ~180 (full 2 x ~30 s), wan ~240 (4 compiles ~130 s, 0.35 s steps), qwenimage ~180,
# sd3 ~165. So three calls: "wan sd3", "flux1 flux2", "qwenimage". Without the full-compile rows
# (DIT_ARGS="--variants eager,each,regional,after") each model needs ~60 s less.
set -u
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,memory.used --format=csv
budget=${DIT_BUDGET:-560}
models=("$@"); [ ${#models[@]} -gt 0 ] || models=(flux1 flux2 wan qwenimage sd3)
for model in "${models[@]}"; do
    left=$((budget - (SECONDS - start) - 5))
    if [ "$left" -lt 60 ]; then echo "[$model] skipped: ${left} s left"; continue; fi
    echo "=== $model (${left} s left)" >>"$OUT/log.txt"
    # shellcheck disable=SC2086  # DIT_ARGS is a list of words
    timeout -s INT -k 10 "$left" python3 benchmarks/dit.py --models "$model" --json "$OUT/dit-$model.json" \
        ${DIT_ARGS:-} >>"$OUT/log.txt" 2>&1
    echo "[$model] exit $? after $((SECONDS - start)) s"
done
grep -E "FAILED|Error" "$OUT/log.txt" | head -20
python3 benchmarks/dit.py --summary "$OUT"/dit-*.json 2>&1 | tee "$OUT/summary.txt"
