"""How fast this GPU takes writes (GPU only): ``python tools/probes/write_ceiling.py``.

The aux-loss backward only writes (67 MB at DeepSeek-V3's T = 65536, E =
256, fp32), so its floor is the write rate, not the copy rate.  Times, for
the same 67 MB: the driver's ``cuMemsetD32Async``; grid-strided numba fill
kernels with 16-byte stores (``kernels/_base/vec``), plain and L2 evict-first,
over several grid and block sizes.  (gpurouter's aux-loss backward itself:
``python -m gpurouter bench --paths kernel --presets deepseek-v3``.)

Kernel time: CUDA events around each launch, the launches queued behind a
sleep kernel (``gpurouter.bench.timing``) so that the host's launch rate is not
what gets timed (numba's dispatcher takes longer to launch a kernel than
this one runs; timing back-to-back launches without the sleep measured
24-28 us for kernels that take 19-20).  Median of 100 launches; every
element checked afterwards.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics

import numpy as np
from numba import cuda

from gpurouter.bench.timing import launch_times, spin_kernel
from gpurouter.kernels._base import vec as _vec


def _strided_fill(store4):
    """Kernel ``(a, nq, v)``: quads ``0 .. nq-1`` of ``a`` := v, grid-strided."""

    @cuda.jit
    def fill(a, nq, v):
        w = np.int32(cuda.grid(1))
        step = np.int32(cuda.gridsize(1))
        while w < nq:
            store4(a, w, v, v, v, v)
            w = np.int32(w + step)

    return fill


def _time(fn, stream, repeats=100):
    """Median kernel microseconds of ``fn()`` (``gpurouter.bench.timing.launch_times``)."""
    kernel, _ = launch_times(lambda _: fn(), [()], repeats, spin_kernel(), stream)
    return statistics.median(kernel) * 1e6


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    strided, strided_once = _strided_fill(_vec.quad_f32()[1]), _strided_fill(_vec.quad_store_once_f32())
    n = 65536 * 256
    nq = n // 4
    mb = 4 * n / 1e6
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
    print(f"cuMemsetD32 {mb:.0f} MB: {us:6.1f} us ({mb / us:.2f} TB/s)")
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    v = np.float32(2.5)
    for mult in (1, 4, 16):
        for threads in (256, 1024):
            grid = sms * mult
            if grid * threads > 2048 * sms:
                continue
            plain = _time(lambda g=grid, t=threads: strided[g, t, stream](a, nq, v), stream)
            once = _time(lambda g=grid, t=threads: strided_once[g, t, stream](a, nq, v), stream)
            print(f"grid-strided, {mult:2d} blocks per SM x {threads:4d} threads: plain stores "
                  f"{plain:6.1f} us, evict-first {once:6.1f} us")
    assert (a.copy_to_host() == v).all(), "an element was not written"


if __name__ == "__main__":
    main()
