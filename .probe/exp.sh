export NUMBA_ENABLE_CUDASIM=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
o=$1
(timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py > $o/A-sharding.log 2>&1; echo "rc=$?" >> $o/A-sharding.log) &
(timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_multi_gpu.py tests/test_sharding.py > $o/B-multi-sharding.log 2>&1; echo "rc=$?" >> $o/B-multi-sharding.log) &
(GPUROUTER_TEST_DEVICE=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ffi.py > $o/C-ffi-gpu1.log 2>&1; echo "rc=$?" >> $o/C-ffi-gpu1.log) &
wait
timeout 150 python3 -X faulthandler tools/ep_bench.py --repeats 3 --shapes qwen3-like > $o/D-ep-bench.log 2>&1; echo "rc=$?" >> $o/D-ep-bench.log
for f in $o/*.log; do echo "== $f"; grep -E "passed|failed|FAILED|rc=|corrupt|double free|Fatal|CUresult" $f | grep -v "^E  " | head -8 | cut -c1-200; done
