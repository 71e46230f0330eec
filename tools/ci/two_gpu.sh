#!/usr/bin/env bash
# The multi-GPU issue's runs in one call on a machine with two or more GPUs
# (nvidia-h200-x2): each part under its own time limit, most important first,
# one log a part, then each log's last line. Exit status non-zero when any
# part failed or timed out.
#
#   bash tools/ci/two_gpu.sh [LOG_DIR]          (default: gpu-logs)
#   TWO_GPU_TIMEOUT=150 PYTHON=python3       (seconds a part; interpreter)
#   TWO_GPU_PUBLIC_TIMEOUT=300               (seconds for each public-suite part)
#   TWO_GPU_EP_BENCH_TIMEOUT=300             (seconds for tools/probes/ep_bench.py: its times and
#                                             a float32 check at each shape; 150 s on 2 x H200)
#
# 1. expert parallelism with the real ragged_all_to_all against one device
#    (tests/ops/test_moe.py -k expert_parallel);
# 2. the ffi launch records on each GPU, a jitted step on all at once, the
#    sharding suite on Auto and explicit meshes (test_multi_gpu, test_sharding,
#    test_partition), run beside part 1 (most of each is compiling on the CPU);
#    beside them, the top-k / aux-scores / aux-loss public suite (test_public,
#    test_ffi, test_losses, test_callback) with the last GPU as JAX's default
#    device (GPUROUTER_TEST_DEVICE; the single-GPU runs cover the first);
# 3. tools/probes/ep_bench.py: EP against one GPU on half the batch, the exchange's
#    share, and its own EP == one device checks (a small shape and each timed one);
# 4. compute-sanitizer memcheck over the jitted step on every GPU at once.
set -u
cd "$(dirname "$0")/../.."
out=${1:-gpu-logs}
mkdir -p "$out"
export NUMBA_ENABLE_CUDASIM=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
limit=${TWO_GPU_TIMEOUT:-150}
public_limit=${TWO_GPU_PUBLIC_TIMEOUT:-300}
ep_bench_limit=${TWO_GPU_EP_BENCH_TIMEOUT:-300}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpus.txt" 2>&1
date -u >>"$out/gpus.txt"
start=$(date +%s)
timeout "$limit" "$py" -m pytest -q -p no:cacheprovider tests/ops/test_moe.py -k expert_parallel \
  >"$out/ep-tests.log" 2>&1 &
p1=$!
timeout "$limit" "$py" -m pytest -q -p no:cacheprovider tests/sharding/test_multi_gpu.py tests/sharding/test_sharding.py \
  tests/transport/test_partition.py >"$out/multi-gpu-tests.log" 2>&1 &
p2=$!
last=$(( $(nvidia-smi -L | wc -l) - 1 ))
GPUROUTER_TEST_DEVICE=$last timeout "$public_limit" "$py" -m pytest -q -p no:cacheprovider tests/ops/test_public.py \
  >"$out/public-last-gpu.log" 2>&1 &
p3=$!
GPUROUTER_TEST_DEVICE=$last timeout "$public_limit" "$py" -m pytest -q -p no:cacheprovider tests/transport/test_ffi.py \
  tests/ops/test_losses.py tests/transport/test_buffer.py >"$out/ffi-losses-last-gpu.log" 2>&1 &
p4=$!
status=0
wait $p1 || status=1
wait $p2 || status=1
wait $p3 || status=1
wait $p4 || status=1
timeout "$ep_bench_limit" "$py" tools/probes/ep_bench.py --repeats 5 --json "$out/ep-bench.json" >"$out/ep-bench.log" 2>&1 || status=1
if command -v compute-sanitizer >/dev/null 2>&1; then
  timeout "$limit" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 --target-processes all \
    "$py" -m pytest -q -p no:cacheprovider tests/sharding/test_multi_gpu.py -k one_jitted_step \
    >"$out/memcheck.log" 2>&1 || status=1
else
  echo "compute-sanitizer not on PATH" >"$out/memcheck.log"
  status=1
fi
for f in ep-tests multi-gpu-tests public-last-gpu ffi-losses-last-gpu ep-bench memcheck; do
  printf '%-16s %s\n' "$f" "$(tail -n 1 "$out/$f.log")"
done
echo "two_gpu.sh: $(( $(date +%s) - start )) s, status $status" | tee -a "$out/gpus.txt"
exit $status
