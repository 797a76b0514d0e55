#!/usr/bin/env bash
# One device-tool call on a two-GPU kind (nvidia-h200-x2; no network), issue 17 round 13: diffusers' even context
# parallelism (Ulysses 2, ring 2), vanilla vs torchpatches alternated, one process per GPU (benchmarks/flux_cp.py,
# which now records each round's steps, the ranks' thread CPU time and Python's GC passes), with and without
# gc.freeze() after the model is built. Needs .whl/ (diffusers 0.42.1, importlib_metadata, zipp wheels) carried into
# the repo root. PARTS picks what runs (default "flux1 flux1-freeze flux2-freeze"):
#   flux1         FLUX.1-dev, Ulysses and ring, vanilla / all
#   flux1-freeze  the same in a process that calls gc.freeze() once each model is built (--gc-freeze), with rank 0's
#                 host profile (--host-profile 16)
#   flux2         FLUX.2 (2 + 12 blocks), as flux1
#   flux2-freeze  FLUX.2, as flux1-freeze without the host profile
# ROUNDS (default 4) alternated rounds of 10 synchronized steps after 2 of warm-up, then 4 back to back, 3 times.
# Writes cp-PART.{json,log} under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
COMMON="--modes ulysses,ring --variants vanilla,all --no-one-gpu --rounds ${ROUNDS:-4} --iters 10 --warmup 2
        --back-to-back 4 --profile"
run_cp() {  # label model seconds [args]
    local label=$1 model=$2 limit=$3; shift 3
    # shellcheck disable=SC2086  # COMMON is a list of words
    timeout "$limit" python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/flux_cp.py --models "$model" \
        --json "$OUT/cp-$label.json" $COMMON "$@" > "$OUT/cp-$label.log" 2>&1
    echo "== $label: exit $?"
    grep -vE "^\[?W[0-9]|experimental|Warning|warn_once|funcol|wait_tensor|before the output|^[12]\. |^\*+$|OMP_NUM" \
        "$OUT/cp-$label.log" | tail -40
}
for part in ${PARTS:-flux1 flux1-freeze flux2-freeze}; do
    case $part in
    flux1) run_cp flux1 flux1 200;;
    flux1-freeze) run_cp flux1-freeze flux1 230 --gc-freeze --host-profile 16;;
    flux2) run_cp flux2 flux2 120;;
    flux2-freeze) run_cp flux2-freeze flux2 120 --gc-freeze;;
    *) echo "unknown part $part"; exit 2;;
    esac
done
