#!/usr/bin/env bash
# One device-tool call (H200/H100, no network), issue 17 round 15: FLUX.1's single blocks without the
# [attention | gelu(mlp)] buffer (benchmarks/split_proj_out.py; measured, not built). Needs .whl/ (diffusers 0.42.1,
# importlib_metadata, zipp wheels) carried into the repo root.
#   1. split_proj_out.py: one block's tail at FLUX.1-dev shapes, the package's buffer form against the split and
#      strided forms (ops.json, ops.txt)
#   2. benchmarks/dit.py on FLUX.1-dev: eager vanilla / all / single:split / single:strided and regional compile,
#      3 rounds (dit-flux1.json, log.txt, summary.txt; benchmarks/gpu_session_dit.sh)
# PART=goals instead: where issue 17's goals 2, 4 and 5 stand, one lease: benchmarks/dit.py on FLUX.1-dev and FLUX.2
# (2 + 12 blocks), eager, regional and full compile (FLUX.1's full compile on 2 + 4 blocks), 3 rounds.
# PART=bound: the fused step with every torchpatches Triton launch skipped (_bench variant no-glue: wrong outputs;
# the step's time if its glue cost nothing), FLUX.1-dev and FLUX.2 (2 + 12 blocks): eager, no-glue, regional, 3 rounds.
# PART=rows: benchmarks/rows_sweep.py (the row kernel's launch configurations at FLUX.1's single-block shapes;
# rows.json, rows.txt), then benchmarks/dit.py on FLUX.1-dev with the package's configuration and the sweep's fastest
# (_bench variant rows:CAPxWARPS) alternated, and regional compile, 3 rounds.
# PART=cp (nvidia-h200-x2): goal 6, FLUX.1-dev under diffusers' even context parallelism (Ulysses 2, ring 2),
# vanilla / all and the same through torchpatches.cuda_graphs.graphed, 3 alternated rounds (cp-flux1.json, .log).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader; nproc
case ${PART:-split} in
cp)
    timeout 540 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/flux_cp.py --models flux1 \
        --json "$OUT/cp-flux1.json" --modes ulysses,ring --variants vanilla,all --no-one-gpu --rounds 3 --iters 10 \
        --warmup 2 --back-to-back 4 --profile --graphed > "$OUT/cp-flux1.log" 2>&1
    echo "flux_cp exit $?"
    grep -vE "^\[?W[0-9]|experimental|Warning|warn_once|funcol|wait_tensor|before the output|^[12]\. |^\*+$|OMP_NUM" \
        "$OUT/cp-flux1.log" | tail -40;;
rows)
    timeout 120 python3 benchmarks/rows_sweep.py --json "$OUT/rows.json" > "$OUT/rows.txt" 2>&1
    echo "rows_sweep exit $?"; grep -vE "Warning|warn" "$OUT/rows.txt" | tail -9
    best=$(cd benchmarks && python3 -c "import sys, rows_sweep; print(rows_sweep.best(sys.argv[1]))" "$OUT/rows.json")
    echo "fastest: $best"
    DIT_BUDGET=${DIT_BUDGET:-330} DIT_ARGS="--variants eager,rows:$best,regional --rounds 3" \
        bash benchmarks/gpu_session_dit.sh flux1 | tail -12;;
bound)
    DIT_BUDGET=${DIT_BUDGET:-500} DIT_ARGS="${DIT_ARGS:---variants eager,no-glue,regional --rounds 3}" \
        bash benchmarks/gpu_session_dit.sh flux1 flux2 | tail -20;;
goals)
    DIT_BUDGET=${DIT_BUDGET:-570} DIT_ARGS="${DIT_ARGS:---variants eager,regional,full --rounds 3}" \
        bash benchmarks/gpu_session_dit.sh flux1 flux2 | tail -24;;
split)
    timeout 120 python3 benchmarks/split_proj_out.py --json "$OUT/ops.json" > "$OUT/ops.txt" 2>&1
    echo "split_proj_out exit $?"; grep -vE "Warning|warn" "$OUT/ops.txt" | tail -6
    DIT_BUDGET=${DIT_BUDGET:-420} \
        DIT_ARGS="${DIT_ARGS:---variants eager,single:split,single:strided,regional --rounds 3}" \
        bash benchmarks/gpu_session_dit.sh flux1 | tail -16;;
*) echo "unknown PART $PART (split, goals, bound, rows, cp)"; exit 2;;
esac
