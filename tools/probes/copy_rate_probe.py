"""The GPU's streaming rates, measured: what a bandwidth-bound kernel can reach.

``python tools/probes/copy_rate_probe.py [--mbytes 33.5] [--repeats 100] [--json out.json]``

Times, on buffers of ``--mbytes`` MB (three sets rotated, more than L2 holds):
an empty kernel (the fixed cost of a launch in this timing method); a copy
kernel and a read-only kernel (sum of the words, one fp32 per block
written) with 16-byte accesses (``kernels/_base/vec.py``) at several grid sizes
and quads per thread.  Same timing method as the other probes
(``gpurouter/bench/timing.py``).  The router z-loss backward reads and writes
``T * E`` elements, its forward reads them: these rates say how far above
the copy rate and the read rate those kernels are (lab/journal/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from numba import cuda
from numba import float32 as nb_f32

from gpurouter.bench.timing import median_us as _time
from gpurouter.bench.timing import spin_kernel as _spin_kernel
from gpurouter.kernels._base.vec import quad_f32, quad_store_once_f32

_U = np.uint64


def _kernels(unroll):
    load, store = quad_f32()
    store_once = quad_store_once_f32()

    @cuda.jit
    def copy_quads(src, dst, nquads, evict_first):
        stride = _U(cuda.gridDim.x) * _U(cuda.blockDim.x) * _U(unroll)
        q = _U(cuda.blockIdx.x) * _U(cuda.blockDim.x) * _U(unroll) + _U(cuda.threadIdx.x)
        while q < _U(nquads):
            for u in range(unroll):
                w = q + _U(u) * _U(cuda.blockDim.x)
                if w < _U(nquads):
                    a, b, c, d = load(src, w)
                    if evict_first:
                        store_once(dst, w, a, b, c, d)
                    else:
                        store(dst, w, a, b, c, d)
            q += stride

    @cuda.jit
    def read_quads(src, out, nquads):
        stride = _U(cuda.gridDim.x) * _U(cuda.blockDim.x) * _U(unroll)
        q = _U(cuda.blockIdx.x) * _U(cuda.blockDim.x) * _U(unroll) + _U(cuda.threadIdx.x)
        acc = nb_f32(0)
        while q < _U(nquads):
            for u in range(unroll):
                w = q + _U(u) * _U(cuda.blockDim.x)
                if w < _U(nquads):
                    a, b, c, d = load(src, w)
                    acc += (a + b) + (c + d)
            q += stride
        if acc == nb_f32(12345.678):  # never true for the data used: keeps the loads alive
            out[cuda.blockIdx.x] = acc

    return copy_quads, read_quads


def _name():
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbytes", type=float, default=33.554432, help="MB per buffer (default: T=65536 x E=256 bf16)")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--json")
    a = ap.parse_args()
    n = int(a.mbytes * 1e6) // 16 * 4  # fp32 words, whole quads
    nquads = n // 4
    rng = np.random.default_rng(0)
    srcs = [cuda.to_device(rng.random(n, dtype=np.float32)) for _ in range(3)]
    dsts = [cuda.device_array(n, np.float32) for _ in range(3)]
    out = cuda.device_array(4096, np.float32)
    spin = _spin_kernel()
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    nbytes = n * 4
    rows = []

    def record(label, us, moved):
        tbs = moved / (us * 1e-6) / 1e12 if moved else 0.0
        rows.append(dict(label=label, us=us, bytes=moved, tb_per_s=tbs))
        print(f"{label:>44}: {us:8.2f} us  {tbs:5.2f} TB/s", flush=True)

    sets = [[j] for j in range(3)]  # "pointer sets" for the timer: the buffer set's index

    @cuda.jit
    def empty_kernel(out, flag):
        if flag == 1:
            out[cuda.blockIdx.x] = 0.0

    for grid in (1, sms * 8):
        def launch_e(which, stream, grid=grid):
            empty_kernel[grid, 256, stream](out, 0)
        record(f"empty kernel {grid}x256", _time(launch_e, sets, a.repeats, spin), 0)
    for unroll in (1, 2, 4):
        copy_k, read_k = _kernels(unroll)
        for per_sm, threads in ((4, 256), (8, 256), (16, 256), (8, 512), (32, 128)):
            grid = min(sms * per_sm, 4096)
            for ef in (0, 1):
                def launch(which, stream, grid=grid, threads=threads, ef=ef, k=copy_k):
                    k[grid, threads, stream](srcs[which[0]], dsts[which[0]], nquads, ef)
                record(f"copy u{unroll} {grid}x{threads}{' evict-first' if ef else ''}",
                       _time(launch, sets, a.repeats, spin), 2 * nbytes)

            def launch_r(which, stream, grid=grid, threads=threads, k=read_k):
                k[grid, threads, stream](srcs[which[0]], out, nquads)
            record(f"read u{unroll} {grid}x{threads}", _time(launch_r, sets, a.repeats, spin), nbytes)
    best = {kind: max((r for r in rows if r["label"].startswith(kind)), key=lambda r: r["tb_per_s"])
            for kind in ("copy", "read")}
    for kind, r in best.items():
        print(f"best {kind}: {r['label']} {r['tb_per_s']:.2f} TB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=_name(), mbytes=nbytes / 1e6,
                           rows=rows, best=best), f, indent=1)


if __name__ == "__main__":
    main()
