#!/usr/bin/env bash
# One device-tool call on a two-GPU kind (nvidia-h200-x2 / nvidia-h100-x2; no network): the ring attention merge
# (ops.lse_merge inside cp_ring_attention) on CUDA. First its CUDA tests (the kernel against torch's ops bit for bit;
# cp_ring_attention's unit tests), then the op against diffusers' merge at FLUX shapes (benchmarks/fused.py, CUDA
# graph replays), then FLUX under ring attention with and without the patch (benchmarks/gpu_session_cp.sh, whose
# FLUX1_ARGS / FLUX1_S / FLUX2_S it passes on; default: ring only, vanilla / all / -cp_ring_attention, graphed too,
# rank 0's GPU time by kernel class). Needs .whl/ (diffusers 0.42.1 + importlib_metadata wheels) carried into the
# repo root. FLUX2_S / FLUX2_ARGS run FLUX.2 too. Writes pytest-cuda.txt, fused.json / fused.txt and cp-flux{1,2}.json / .log under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: only the FLUX runs
TORCHPATCHES_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_lse_merge.py \
    tests/patches/test_cp_ring_attention.py tests/patches/test_cp_all_to_all.py > "$OUT/pytest-cuda.txt" 2>&1
echo "== pytest: exit $?"; tail -5 "$OUT/pytest-cuda.txt"
(cd benchmarks && timeout 150 python3 fused.py --no-sweep --json "$OUT/fused.json" > "$OUT/fused.txt" 2>&1)
echo "== fused.py: exit $?"; grep -A 14 "^copy rate" "$OUT/fused.txt"
fi
MODES=${MODES:-ring}
export FLUX1_ARGS=${FLUX1_ARGS:---modes $MODES --no-one-gpu --variants vanilla,all,-cp_ring_attention --graphed --profile --rounds 3 --iters 10 --warmup 2 --back-to-back 4}
export FLUX1_S=${FLUX1_S:-240} FLUX2_S=${FLUX2_S:-0}
bash benchmarks/gpu_session_cp.sh "$@"
