#!/usr/bin/env bash
# pallas_ragged_dot's GPU run (issue #38) in one call, one GPU, under 200 s:
# each part under its own time limit, one log a part, JSON beside the logs.
# Exit status non-zero when any part failed or timed out.
#
#   bash tools/ci/pallas_gpu_run.sh [OUT_DIR]        (default: gpu-logs-pallas)
#   PYTHON=python3 PALLAS_TESTS_TIMEOUT=80 PALLAS_SWEEP_TIMEOUT=95 PALLAS_PROBE_TIMEOUT=25   (seconds)
#
# 1. tests/grouped_gemm/test_pallas_gpu.py: pallas_ragged_dot == batched_ragged_dot
#    at both full shapes (bf16, balanced and skewed; values, d_lhs, d_rhs),
#    fwd+bwd times of both printed;
# 2. tools/probes/pallas_gemm_sweep.py: fwd, d_lhs, d_rhs per tile config at
#    both shapes beside the dense GEMM (new configs stop after 75 s);
# 3. tools/probes/grouped_gemm_probe.py --only pallas at the Qwen3-like shape:
#    the pallas rows at balanced and skewed routing beside the dense GEMM.
set -u
cd "$(dirname "$0")/../.."
out=${1:-gpu-logs-pallas}
mkdir -p "$out"
export NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
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
run gpu-tests "${PALLAS_TESTS_TIMEOUT:-80}" "$py" -m pytest -q -s -p no:cacheprovider tests/grouped_gemm/test_pallas_gpu.py
run sweep "${PALLAS_SWEEP_TIMEOUT:-95}" "$py" tools/probes/pallas_gemm_sweep.py --budget-s 75 --json "$out/sweep.json"
run probe "${PALLAS_PROBE_TIMEOUT:-25}" "$py" tools/probes/grouped_gemm_probe.py --only pallas --shapes qwen3-like \
  --repeats 5 --json "$out/probe.json"
tail -n 40 "$out"/*.log
exit $status
