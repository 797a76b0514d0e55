#!/usr/bin/env bash
# One device-tool call (H100/H200, no network): the kernels' rounding change of issue 17 round 4 on the GPU.
# 1. benchmarks/fused.py: each fused op against diffusers' code at FLUX shapes, timed with the cast rounding and
#    with the former integer rounding (A/B in one process, outputs compared bit for bit), then the modulate
#    kernels' launch sweep for both roundings;
# 2. the CUDA tests: the rounding helper against torch's casts, and the fused patterns against diffusers.
# Needs .whl/ carried into the repo root (docs/development.md: "GPU runs"). Writes fused.json, fused.txt,
# pytest.txt under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
timeout ${FUSED_BUDGET:-400} python3 benchmarks/fused.py --json "$OUT/fused.json" >"$OUT/fused.txt" 2>&1
echo "fused.py exit $?"; grep -v '^{\|^sweep {' "$OUT/fused.txt" | tail -70
TORCHPATCHES_TEST_DEVICE=cuda timeout ${TEST_BUDGET:-180} python3 -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/ops/test_rounding.py tests/patches/test_fused_patches.py tests/patches/test_fused_qwenimage.py \
    tests/patches/test_fused_sd3.py tests/patches/test_fused_wan.py tests/patches/test_lora.py \
    tests/patches/test_fused_step_aside.py >"$OUT/pytest.txt" 2>&1
echo "pytest exit $?"; tail -15 "$OUT/pytest.txt"
