"""How fast this GPU takes writes (GPU only): ``python tools/write_ceiling.py``.

The aux-loss backward only writes (67 MB at DeepSeek-V3's T = 65536, E =
256, fp32), so its floor is the write rate, not the copy rate.  Times the
driver's ``cuMemsetD32Async`` of 67 MB and two numba write kernels with
16-byte stores (``kernels._vec``): grid-strided, and a contiguous chunk per
block, four stores in flight per thread, over several grid and block sizes.
Median of 50 launches (CUDA events); every element checked afterwards.
"""

from __future__ import annotations

import ctypes
import statistics

import numpy as np
from numba import cuda

from gpurouter.kernels import _vec

_, _store4 = _vec.quad_f32()


@cuda.jit(device=True)
def _fill(a, w, end, step, v):
    """Quads ``w, w + step, ... < end`` := v, four stores in flight."""
    while w + 3 * step < end:
        _store4(a, w, v, v, v, v)
        _store4(a, w + step, v, v, v, v)
        _store4(a, w + 2 * step, v, v, v, v)
        _store4(a, w + 3 * step, v, v, v, v)
        w = np.int32(w + 4 * step)
    while w < end:
        _store4(a, w, v, v, v, v)
        w = np.int32(w + step)


@cuda.jit
def _chunked(a, nq, per_block, v):
    b0 = np.int32(cuda.blockIdx.x) * np.int32(per_block)
    _fill(a, np.int32(b0 + cuda.threadIdx.x), min(np.int32(b0 + per_block), np.int32(nq)),
          np.int32(cuda.blockDim.x), v)


@cuda.jit
def _strided(a, nq, v):
    _fill(a, np.int32(cuda.grid(1)), np.int32(nq), np.int32(cuda.gridsize(1)), v)


def _time(fn, stream, repeats=50):
    fn()
    stream.synchronize()
    events = [cuda.event() for _ in range(repeats + 1)]
    events[0].record(stream)
    for i in range(repeats):
        fn()
        events[i + 1].record(stream)
    events[-1].synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(repeats)) * 1e3


def main():
    n = 65536 * 256
    nq = n // 4
    a = cuda.device_array(n, np.float32)
    stream = cuda.stream()
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
    ptr, handle = a.device_ctypes_pointer.value, ctypes.c_void_p(int(stream.handle))

    def memset():
        err = lib.cuMemsetD32Async(ptr, 0x3FC00000, n, handle)  # 1.5f
        if err:
            raise RuntimeError(f"cuMemsetD32Async: CUresult {err}")

    us = _time(memset, stream)
    print(f"cuMemsetD32 {4 * n / 1e6:.0f} MB: {us:6.1f} us ({4 * n / us / 1e6:.2f} TB/s)")
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    v = np.float32(2.5)
    for mult in (2, 4, 8, 16, 32):
        for threads in (256, 512, 1024):
            grid = sms * mult
            if grid * threads > 8192 * sms:
                continue
            per = -(-nq // grid)
            chunk = _time(lambda g=grid, t=threads, p=per: _chunked[g, t, stream](a, nq, p, v), stream)
            strided = _time(lambda g=grid, t=threads: _strided[g, t, stream](a, nq, v), stream)
            print(f"grid {mult:2d} x SMs, {threads:4d} threads: chunk per block {chunk:6.1f} us "
                  f"({4 * n / chunk / 1e6:.2f} TB/s), grid-strided {strided:6.1f} us")
    assert (a.copy_to_host() == v).all(), "an element was not written"


if __name__ == "__main__":
    main()
