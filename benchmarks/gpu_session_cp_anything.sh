#!/usr/bin/env bash
# One device-tool call on a two-GPU kind (nvidia-h200-x2 / nvidia-h100-x2; no network): diffusers' uneven-shard
# context parallelism (ulysses_anything / ring_anything) beside the even modes, vanilla vs torchpatches, one process
# per GPU (benchmarks/flux_cp.py), and the CUDA tests of what round 11 changed (cuda_graphs' pool after a failed
# capture, cp_ring_attention's uneven form, cp_ulysses_anything). Needs .whl/ (diffusers 0.42.1 + importlib_metadata
# wheels) carried into the repo root. PARTS picks what runs (default "tests flux1 flux1-gloo qwen"):
#   tests       CUDA tests: tests/test_cuda_graphs.py, cp_ring_attention, cp_ulysses_anything, qwenimage_text_seq_len,
#               lse_merge
#   flux1       FLUX.1-dev, Ulysses / ulysses_anything, with and without cp_ulysses_anything, init_process_group("nccl")
#   flux1-gloo  ulysses_anything over init_process_group("cpu:gloo,cuda:nccl") (the lengths exchanged on gloo)
#   flux2       FLUX.2 (2 + 12 blocks), as flux1
#   qwen        Qwen-Image at the pipeline's 1328x1328 (83 x 83 tokens: uneven), ulysses_anything
#   qwen-graphed  Qwen-Image 1024x1024, Ulysses, also through cuda_graphs.graphed, with and without
#               qwenimage_text_seq_len (without it the capture fails and the graphed rows run eagerly)
#   rings       FLUX.1-dev, ring / ring_anything, with and without cp_ring_attention
#   qwen-compile  one GPU: benchmarks/compile_repeat_probe.py on tiny QwenImage's regional compile (Inductor's own
#               choices, timed ones included: what the probe looks for; add --deterministic to mirror the test),
#               then the compile test of tiny QwenImage (deterministic mode on the GPU since round 13)
# Each part's arguments: FLUX1_ARGS, GLOO_ARGS, FLUX2_ARGS, QWEN_ARGS, QWEN_GRAPHED_ARGS, RINGS_ARGS replace the
# defaults. Writes under
# $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${PARTS:-tests flux1 flux1-gloo qwen}
COMMON="--no-one-gpu --rounds 2 --iters 10 --warmup 2 --back-to-back 4 --profile"
run_cp() {  # label model seconds [args]
    local label=$1 model=$2 limit=$3; shift 3
    timeout "$limit" python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/flux_cp.py --models "$model" \
        --json "$OUT/cp-$label.json" "$@" > "$OUT/cp-$label.log" 2>&1
    echo "== $label: exit $?"
    grep -vE "^\[?W[0-9]|experimental|FutureWarning|funcol|wait_tensor|before the output|^[12]\. |^\*+$|OMP_NUM|step_of" \
        "$OUT/cp-$label.log" | tail -40
}
for part in $PARTS; do
    case $part in
    tests)
        TORCHPATCHES_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
            tests/patches/test_cp_ring_attention.py tests/patches/test_cp_ulysses_anything.py \
            tests/patches/test_qwenimage_text_seq_len.py tests/ops/test_lse_merge.py \
            > "$OUT/pytest-cuda.txt" 2>&1
        echo "== pytest: exit $?"; tail -5 "$OUT/pytest-cuda.txt";;
    flux1) run_cp flux1 flux1 240 ${FLUX1_ARGS:---modes ulysses,ulysses_anything \
        --variants vanilla,all,-cp_ulysses_anything $COMMON};;
    flux1-gloo) run_cp flux1-gloo flux1 150 ${GLOO_ARGS:---backend cpu:gloo,cuda:nccl --modes ulysses_anything \
        --variants vanilla,all,-cp_ulysses_anything $COMMON};;
    flux2) run_cp flux2 flux2 180 ${FLUX2_ARGS:---modes ulysses,ulysses_anything \
        --variants vanilla,all,-cp_ulysses_anything $COMMON};;
    qwen) run_cp qwenimage qwenimage 150 ${QWEN_ARGS:---qwen-side 83 --modes ulysses_anything \
        --variants vanilla,all,-cp_ulysses_anything $COMMON};;
    qwen-graphed) run_cp qwen-graphed qwenimage 150 ${QWEN_GRAPHED_ARGS:---modes ulysses --graphed \
        --variants vanilla,all,-qwenimage_text_seq_len $COMMON};;
    rings) run_cp rings flux1 240 ${RINGS_ARGS:---modes ring,ring_anything \
        --variants vanilla,all,-cp_ring_attention $COMMON};;
    qwen-compile)
        timeout 200 python3 benchmarks/compile_repeat_probe.py --models qwenimage-fused --regional --ids float32 \
            --device cuda --json "$OUT/qwen-compile-probe.json" > "$OUT/qwen-compile-probe.txt" 2>&1
        echo "== compile_repeat_probe: exit $?"; grep -v Warning "$OUT/qwen-compile-probe.txt" | tail -30
        TORCHPATCHES_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider \
            tests/patches/test_fused_qwenimage.py -k test_compile_same_kernels_and_outputs \
            > "$OUT/pytest-qwen-compile.txt" 2>&1
        echo "== pytest qwen compile: exit $?"; tail -3 "$OUT/pytest-qwen-compile.txt";;
    *) echo "unknown part $part"; exit 2;;
    esac
done
