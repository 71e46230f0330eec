#!/usr/bin/env bash
# The whole test suite on a GPU (kernels for real, NUMBA_ENABLE_CUDASIM=0),
# in parallel groups of test files (every file in one: tests/tools/test_gpu_suite.py; 16 groups at f480be6, when all
# ran at once on one H200 in 410 s, the longest group 381 s: docs/testing.md): one GPU is
# shared, and most of a group's time is compiling and tracing on the CPU
# (nine larger groups timed out on one GPU). One log per group, then each
# group's summary line; the exit status is non-zero when any group failed.
#
#   bash tools/ci/gpu_suite.sh [LOG_DIR]        (default: gpu-logs)
#   GPU_SUITE_TIMEOUT=570 PYTHON=python3     (seconds per group; interpreter)
#   GPU_SUITE_XLA_CACHE=DIR                  (JAX's compilation cache; empty: none)
set -u
cd "$(dirname "$0")/../.."
out=${1:-gpu-logs}
mkdir -p "$out"
export NUMBA_ENABLE_CUDASIM=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The groups already fill the CPU: no background compile workers in them (docs/cache.md), unless asked for.
# Each process frees the GPU memory it is done with (XLA's "platform" allocator, not its caching
# one): 24 processes hoarding their peaks ran one H200 out of memory at 70388aa (docs/performance.md).
export XLA_PYTHON_CLIENT_ALLOCATOR=${XLA_PYTHON_CLIENT_ALLOCATOR-platform}
# The groups share one kernel cache, so a kernel one group compiled is loaded by the others.
export GPUROUTER_COMPILE_WORKERS=${GPUROUTER_COMPILE_WORKERS-0}
# And one JAX persistent compilation cache, kept between runs like the kernel cache: a jitted
# program one group or an earlier run compiled is read back instead of compiled again (every
# program, however quick its compile). Programs with the "ffi" transport's calls never match
# another process's (their `process` attribute: docs/transports.md). GPU_SUITE_XLA_CACHE= (empty) turns it off.
xla_cache=${GPU_SUITE_XLA_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/gpurouter-suite-xla}
if [ -n "$xla_cache" ]; then
  export JAX_COMPILATION_CACHE_DIR=$xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  # Each run adds the "ffi" programs it compiled (about 25 MB at 9e2fb1b), which no later process
  # reads: entries written over a week ago go, so the folder stays bounded (a pruned program is
  # compiled and written again by the next run that needs it).
  find "$xla_cache" -type f -mtime +7 -delete 2>/dev/null
fi
py=${PYTHON:-python3}
limit=${GPU_SUITE_TIMEOUT:-570}
k=tests/kernels
groups=(  # (a -k expression without spaces: a group is split on them)
  "$k/losses/test_aux_loss.py $k/topk/test_aux_plans.py $k/losses/test_aux_loss_bwd.py $k/losses/test_mask_bits.py $k/losses/test_masks.py $k/losses/test_z_loss_unit.py"
  "$k/test_gpu.py"
  "$k/topk/test_indices_replay.py"
  "$k/topk/lane/test_aux_fwd.py $k/topk/lane/test_fwd.py tests/ops/test_audit_qb.py"
  "$k/topk/test_map_format.py $k/moe/test_permute.py $k/moe/test_grouped_bias.py"
  "$k/topk/test_bwd_quad.py $k/topk/test_bwd_stream.py $k/test_tiling.py tests/ops/test_loss_masks_numba.py tests/ops/test_step_prefetch.py"
  "$k/topk/token/test_aux_fwd.py $k/topk/test_plans.py"
  "$k/topk/token/test_fwd.py -k test_shapes_fwd_bwd"
  "$k/topk/token/test_fwd.py -k not(test_shapes_fwd_bwd)"
  "$k/topk/warp/test_group_scores.py $k/topk/warp/test_compact.py $k/topk/test_qb_cutoff.py $k/topk/test_qb_math.py $k/topk/test_qb.py $k/topk/test_qb_tiling.py $k/topk/warp/test_qb_cutoff.py"
  "$k/_base/test_vec.py $k/_base/test_f16_words.py $k/topk/warp/test_bwd.py $k/topk/warp/test_fwd.py $k/losses/test_z_loss.py $k/losses/test_z_loss_vec.py"
  "tests/ops/test_public.py"
  "tests/ops/test_topk_indices.py tests/ops/test_routing_map_format.py"
  "tests/transport/test_ffi.py tests/ops/test_losses.py tests/transport/test_buffer.py tests/ops/test_errors.py tests/transport/test_ffi_abi.py tests/kernels/_base/test_context.py tests/test_kernel_cache.py tests/test_seeds.py"
  "tests/ops/test_moe_ops.py tests/ops/test_moe.py tests/ops/test_moe_auto.py"
  "tests/sharding/test_sharding.py tests/transport/test_partition.py tests/sharding/test_multi_gpu.py tests/test_parallel_compile.py tests/transport/test_ffi_cache.py"
  "tests/reference tests/ops/test_api.py tests/test_cli.py tests/test_docs.py tests/test_layering.py"
  "$k/losses/test_last_block.py tests/ops/test_edges.py $k/_base/test_device.py tests/ops/test_audit_groups_compact.py"
  "tests/ops/test_arg_table.py tests/tools/test_probes.py tests/tools/test_gpu_suite.py tests/testing/test_package.py tests/testing/test_token_ops_checks.py tests/ops/test_audit_masks.py"
  "tests/ops/test_router_variants.py tests/ops/test_token_masks.py tests/ops/test_qb_te_oracle.py"
  "tests/ops/test_router_variants_numba.py tests/test_grouped_matmul_gpu.py tests/grouped_gemm/test_slot_experts_gpu.py tests/grouped_gemm/test_pallas.py tests/grouped_gemm/test_gemm_helpers.py tests/grouped_gemm/test_pallas_gpu.py"
  # the checkers' slow runs (many hypothesis examples of jnp routers: nothing of the GPU's) run by hand
  # (make test-slow); at 3c3a03d the false-alarm ones held their group at the 450 s limit, cold and warm
  "tests/testing/test_dogfood.py tests/testing/test_mutants.py tests/testing/test_false_alarms.py -m not(slow)"
  "tests/sharding/test_ep_processes.py tests/grouped_gemm/test_mosaic_gpu.py tests/grouped_gemm/test_mosaic.py"
)
# shellcheck disable=SC2086,SC2116  # the groups' globs expand here
listed=" $(echo ${groups[*]}) "
extra=""
for f in $(find tests -name 'test_*.py' -not -path 'tests/reference/*' | sort); do  # files in no group: one more group
  case "$listed" in *" $f "*) ;; *) extra="$extra $f" ;; esac
done
if [ -n "$extra" ]; then
  echo "tools/ci/gpu_suite.sh: files in no group run together in one more group:$extra" >&2
  groups+=("${extra# }")
fi
pids=()
for i in "${!groups[@]}"; do
  # shellcheck disable=SC2086  # a group is a list of paths
  timeout "$limit" "$py" -m pytest -q -p no:cacheprovider ${groups[$i]} >"$out/group$i.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  summary=$(tail -n 1 "$out/group$i.log")
  [ "$rc" -eq 124 ] && summary="TIMED OUT after ${limit} s (last line: $summary)"
  [ "$rc" -ne 0 ] && status=1
  echo "group $i (${groups[$i]}): $summary"
done
exit $status
