#!/usr/bin/env bash
# Device-tool calls (H200/H100, no network), issue 17 round 14: the fused paths' stock nn.Linear / nn.Dropout layers
# called as their forward would (_fused_common.linear / dropout) against module calls (_bench variant
# module-calls), alternated in one process. Needs .whl/ (diffusers 0.42.1, importlib_metadata, zipp wheels) carried
# into the repo root. PART picks what runs (two calls: each fits one call's 600 s):
#   host (default)  the CUDA run of the fused patterns' tests (pytest-cuda.txt), then host_profile.py on FLUX.1-dev and
#                   FLUX.2 (2 + 12 blocks), all / module-calls alternated three times (host-flux1.txt, host-flux2.txt)
#   dit             benchmarks/dit.py on FLUX.1-dev and FLUX.2: eager vanilla / all / module-calls and regional
#                   compile, 3 rounds (dit-*.json, log.txt, summary.txt; benchmarks/gpu_session_dit.sh)
#   lora            benchmarks/flux_lora.py, its four cases (issue 17 goal 3; peft is on the device): lora.json, lora.txt
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader; nproc
if [ "${PART:-host}" = dit ]; then
    DIT_BUDGET=${DIT_BUDGET:-570} DIT_ARGS="${DIT_ARGS:---variants eager,module-calls,regional --rounds 3}" \
        bash benchmarks/gpu_session_dit.sh flux1 flux2 | tail -24
    exit 0
fi
if [ "${PART:-host}" = lora ]; then
    timeout ${LORA_S:-560} python3 benchmarks/flux_lora.py --json "$OUT/lora.json" > "$OUT/lora.txt" 2>&1
    echo "flux_lora exit $?"; grep -vE "Warning|warn" "$OUT/lora.txt" | tail -12
    exit 0
fi
TORCHPATCHES_TEST_DEVICE=cuda timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/patches/test_fused_patches.py tests/patches/test_fused_patches_hostile.py tests/patches/test_fused_step_aside.py \
    tests/patches/test_fused_sd3.py tests/patches/test_fused_wan.py tests/patches/test_fused_qwenimage.py \
    > "$OUT/pytest-cuda.txt" 2>&1; echo "pytest rc $?"; tail -3 "$OUT/pytest-cuda.txt"
V=${V:-all,module-calls,all+,module-calls+,all++,module-calls++}
timeout 150 python3 benchmarks/host_profile.py --models flux1 --variants "$V" --steps 7 --top 14 > "$OUT/host-flux1.txt" 2>&1
grep "^\[flux1\]" "$OUT/host-flux1.txt"
timeout 100 python3 benchmarks/host_profile.py --models flux2 --variants "$V" --steps 7 --top 14 > "$OUT/host-flux2.txt" 2>&1
grep "^\[flux2\]" "$OUT/host-flux2.txt"
