#!/usr/bin/env bash
# One device-tool call on a two-GPU kind (nvidia-h100-x2 / nvidia-h200-x2; no network): issue 17's goal 6, FLUX under
# diffusers' context parallelism, vanilla vs torchpatches, one process per GPU (benchmarks/flux_cp.py). Needs
# .whl/ (diffusers 0.42.1 + importlib_metadata wheels) carried into the repo root. FLUX.1-dev with the graphed
# variants and rank 0's profiles, then FLUX.2; each setting's rows are printed and saved as soon as they exist, so
# a run stopped by its timeout keeps what it finished. Writes cp-flux1.json, cp-flux2.json and their logs under $OUT.
# FLUX1_ARGS replaces flux1's extra arguments, FLUX2_ARGS gives FLUX.2 its own; FLUX1_S=0 / FLUX2_S=0 skips a model;
# further arguments go to both.
# NVLink multicast stays off (the machine's NCCL_NVLS_ENABLE=0 etc. are inherited by every rank).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.sm,power.limit --format=csv,noheader
nvidia-smi topo -m | head -4
env | grep -E "NVLS|MULTICAST" | sort
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count(), 'GPUs')"
run_cp() {  # model seconds [args]
    local model=$1 limit=$2; shift 2
    timeout "$limit" python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/flux_cp.py --models "$model" \
        --json "$OUT/cp-$model.json" "$@" > "$OUT/cp-$model.log" 2>&1
    echo "== $model: exit $?"
    grep -vE "^\[?W[0-9]|experimental|FutureWarning|funcol|wait_tensor|before the output|^[12]\. |^\*+$|OMP_NUM" \
        "$OUT/cp-$model.log" | tail -40
}
[ "${FLUX1_S:-330}" = 0 ] || run_cp flux1 "${FLUX1_S:-330}" ${FLUX1_ARGS:---graphed --profile} "$@"
[ "${FLUX2_S:-170}" = 0 ] || run_cp flux2 "${FLUX2_S:-170}" ${FLUX2_ARGS:-} "$@"
