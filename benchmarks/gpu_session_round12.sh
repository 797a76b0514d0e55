#!/usr/bin/env bash
# One device-tool call (H200/H100, no network), issue 17 round 12: the host time of a fused FLUX step with the
# blocks calling their attention processors directly (round 12) against the attention modules' forward
# (``_bench`` variant ``attn-forward``), alternated in one process, twice for FLUX.1-dev and once for FLUX.2;
# then (unless HOST_ONLY=1) benchmarks/dit.py on FLUX.1-dev (eager and regional compile) and the CUDA run of the
# fused patterns' tests. PART=tables: the rope_tables patch's CUDA tests, benchmarks/gpu_gaps.py and dit.py on
# FLUX.1-dev and FLUX.2 with and without it (pytest-cuda.txt, gaps.txt, dit-*.json, log.txt, summary.txt).
# Needs .whl/ (diffusers 0.42.1 + importlib_metadata wheels) carried into the repo root. Writes under $OUT:
# host-flux1-N.txt (FLUX1_RUNS processes, default 2), host-flux2.txt (variants: V),
# dit-flux1.json, log.txt, summary.txt (benchmarks/gpu_session_dit.sh), pytest-cuda.txt.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader; nproc
if [ "${PART:-host}" = tables ]; then  # the rope_tables patch: CUDA tests, GPU gaps, dit.py with and without it
    TORCHPATCHES_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not slow" \
        tests/ops/test_rope_tables.py tests/patches/test_fused_patches.py tests/ops/test_skeleton.py \
        > $OUT/pytest-cuda.txt 2>&1; echo "pytest rc $?"; tail -3 $OUT/pytest-cuda.txt
    timeout 150 python3 benchmarks/gpu_gaps.py --models flux1,flux2 --variants all,-rope_tables \
        > $OUT/gaps.txt 2>&1; grep "^\[" $OUT/gaps.txt
    DIT_BUDGET=${DIT_BUDGET:-260} DIT_ARGS="${DIT_ARGS:---variants eager,-rope_tables,regional --rounds 3}" \
        bash benchmarks/gpu_session_dit.sh flux1 flux2 | tail -24
    exit 0
fi
V=${V:-all,attn-forward,all+,attn-forward+,all++,attn-forward++}
for i in $(seq ${FLUX1_RUNS:-2}); do
    timeout 120 python3 benchmarks/host_profile.py --models flux1 --variants $V --steps 7 --top 14 > $OUT/host-flux1-$i.txt 2>&1
    grep "^\[flux1\]" $OUT/host-flux1-$i.txt
done
timeout 90 python3 benchmarks/host_profile.py --models flux2 --variants $V --steps 7 --top 14 > $OUT/host-flux2.txt 2>&1
grep "^\[flux2\]" $OUT/host-flux2.txt
[ -n "${HOST_ONLY:-}" ] && exit 0
DIT_BUDGET=${DIT_BUDGET:-200} DIT_ARGS="${DIT_ARGS:---variants eager,regional --rounds 3}" bash benchmarks/gpu_session_dit.sh flux1 | tail -14
TORCHPATCHES_TEST_DEVICE=cuda timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/patches/test_fused_patches.py tests/patches/test_fused_patches_hostile.py tests/patches/test_fused_step_aside.py \
    tests/patches/test_lora.py > $OUT/pytest-cuda.txt 2>&1; echo "pytest rc $?"; tail -3 $OUT/pytest-cuda.txt
