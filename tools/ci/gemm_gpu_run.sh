#!/usr/bin/env bash
# Issue #38's GPU run in one call (one GPU, under 5 minutes): each part under
# its own time limit, one log a part, JSON beside the logs. Exit status
# non-zero when any part failed or timed out.
#
#   bash tools/ci/gemm_gpu_run.sh [OUT_DIR]        (default: gpu-logs)
#   PYTHON=python3 GPUROUTER_COMMIT=<sha>      (interpreter; the commit the probe records)
#   GEMM_TESTS_TIMEOUT=60 GEMM_PROBE_TIMEOUT=100 GEMM_BENCH_TIMEOUT=60   (seconds)
#
# 1. tests/test_grouped_matmul_gpu.py: tiled_ragged_dot == batched_ragged_dot
#    at both full shapes (bf16, balanced and skewed);
# 2. tools/probes/grouped_gemm_probe.py, both full shapes: the breakdown of
#    batched_ragged_dot, the dense ceiling, tiled, ragged_dot's time or error
#    (probe.json, hlo/), and the skewed / balanced fwd+bwd ratios ("no cliff": <= 1.5);
# 3. moe-bench at scale 1, both shapes, --grouped-matmul batched (before) and
#    tiled (after), each printing the dense-GEMM ceiling beside its GEMM rows.
set -u
cd "$(dirname "$0")/../.."
out=${1:-gpu-logs}
mkdir -p "$out"
export NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export GPUROUTER_COMMIT=${GPUROUTER_COMMIT:-unknown}
py=${PYTHON:-python3}
status=0
run() {  # run NAME LIMIT CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u; \
  "$py" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)'; } >"$out/gpu.txt" 2>&1
run gpu-tests "${GEMM_TESTS_TIMEOUT:-60}" "$py" -m pytest -q -s -p no:cacheprovider tests/test_grouped_matmul_gpu.py
run probe "${GEMM_PROBE_TIMEOUT:-100}" "$py" tools/probes/grouped_gemm_probe.py --repeats 5 --json "$out/probe.json" \
  --hlo-dir "$out/hlo"
for gmm in batched tiled; do
  run "moe-bench-$gmm" "${GEMM_BENCH_TIMEOUT:-60}" "$py" -m gpurouter moe-bench --grouped-matmul "$gmm" --repeats 3 \
    --no-progress --json "$out/moe-bench-$gmm.json"
done
tail -n 3 "$out"/*.log
exit $status
