#!/usr/bin/env bash
# One device-tool call (H100/H200, no network): host cost of the fused ops, the tree before a change against
# the working tree, in one lease. Needs, carried into the repo root: .whl/ (diffusers 0.42.1 + importlib_metadata
# wheels) and .old/before/ (git archive REV torchpatches benchmarks). benchmarks/op_host_cost.py twice per tree,
# alternated; host_profile.py on FLUX.1-dev (eager + torchpatches) twice per tree, alternated; the CUDA tests of
# the fused ops and patterns; launch_overhead.py. `bash benchmarks/gpu_session_host.sh host|tests` runs one half
# (a call has 600 s). Writes JSON, pytest.txt and launch-overhead.txt under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
part=${1:-all}  # host: op_host_cost + host_profile; tests: the CUDA tests + launch_overhead; all: both
if [ "$part" != tests ]; then
for i in 1 2; do for tree in .old/before .; do echo "== $tree $i"; PYTHONPATH=/tmp/site:$PWD/$tree timeout 60 python3 benchmarks/op_host_cost.py --top 0 --json $OUT/op-host-cost-$(basename $tree)-$i.json 2>&1 | sed -n 2,6p; done; done
for i in 1 2; do for tree in .old/before .; do echo "== host_profile $tree $i"; PYTHONPATH=/tmp/site:$PWD/$tree timeout 150 python3 benchmarks/host_profile.py --models flux1 --variants all --steps 5 --top 12 --json $OUT/host-profile-$(basename $tree)-$i.json 2>&1 | grep -A22 "^\[flux1\]"; done; done
fi
[ "$part" = host ] && exit 0
TORCHPATCHES_TEST_DEVICE=cuda PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/ops/test_rounding.py tests/ops/test_launch.py tests/patches/test_fused_patches.py tests/patches/test_fused_qwenimage.py tests/patches/test_fused_sd3.py tests/patches/test_fused_wan.py tests/patches/test_lora.py tests/patches/test_fused_step_aside.py tests/patches/test_fused_patches_hostile.py tests/patches/test_fused_calls.py tests/ops/test_modulate.py tests/ops/test_qk_norm_rope.py > $OUT/pytest.txt 2>&1; echo pytest $?; tail -3 $OUT/pytest.txt
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 benchmarks/launch_overhead.py --json $OUT/launch-overhead.json 2>&1 | tail -16 > $OUT/launch-overhead.txt; tail -8 $OUT/launch-overhead.txt
