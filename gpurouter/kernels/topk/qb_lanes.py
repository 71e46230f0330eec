"""The QB histogram with a lane an expert: ``qb.py``'s step 2 without shared
bank conflicts, where the GPU lets a block opt in to the shared memory of 32
experts' bins (``32 * B * 4`` bytes: 125 KiB at B = 1000; an H100 or H200
allows 227 KiB).

Why: ``qb.py``'s histogram gives a thread a (token row, expert) pair of a
chunk of 12 experts, the chunk's bins expert-major (``el * B + bin``). Its
lanes' bins fall in random banks: on an H200 at T = 65536, E = 384, B = 1000
(Nsight Compute, docs/performance.md) 67% of its shared wavefronts were
conflict replays and half of its warps' cycles waited on the atomics.

Here a warp takes one token row and its 32 lanes 32 consecutive experts, and
the bins are bin-major with a word per lane: lane ``l``'s bin ``k`` is word
``k * 32 + l``, always in bank ``l``. So a warp's 32 atomics hit 32 banks,
whatever the bins. The rows load 32 consecutive experts (128 bytes of f32
scores, 64 of bf16 logits).

The launches (``qb.py: qb_counts_plan`` takes them where the opt-in holds the
bins):

1. ``qb_hist_lanes`` (a block per (chunk of 32 experts, token slab); warps
   on token rows ``unroll`` at a time, their loads issued together): counts in
   shared memory, then every bin, zeros too, stored bin-major into the scratch
   ``partial [slabs, B, E]`` int32 (consecutive lanes, consecutive words: the
   stores coalesce).
2. ``qb_reduce_lanes`` (a block per 32 x 32 tile of (bins, experts)):
   ``counts[e, b] = sum over slabs of partial[s, b, e]``, read along ``e``
   and written along ``b`` through a shared tile (the transpose), every bin
   written. Integer sums: the same counts in any order, at most ``T``.

The counts are ``qb.py``'s bit for bit: the same bin of the same value.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32
from numba import int32 as nb_i32

from .._base.access import loader_2d
from .._base.device import u32, u64
from .._base.launch import simulator_enabled
from .._base.parallel import recipe
from .qb_math import qb_bin, qb_sigmoid_fn

#: experts a block (a lane each) and the reduce's tile side
LANES = 32
#: the reduce's shared tile, a column of padding: its reads across hit 32 banks
_TILE = (LANES, LANES + 1)


def lanes_shared_bytes(num_bins: int) -> int:
    """The histogram block's shared counts: ``32 * B`` int32."""
    return 4 * LANES * num_bins


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def qb_hist_lanes_kernel(kind: str, masked: bool, exp_mode: str, unroll: int = 8, scores: bool = False):
    """The counts of the experts ``[32 c, 32 c + 32)`` over the tokens of slab
    ``s`` (block ``b = s * chunks + c``), a warp a token row, a lane an expert,
    stored into ``partial [slabs, B, E]`` at ``[s, :, 32 c : 32 c + 32]``.
    ``scores``: the rows are the unbiased QB sigmoid (f32, the routing
    kernel's saved scores), not logits: no sigmoid here."""
    load = loader_2d(kind)
    sigmoid = qb_sigmoid_fn(exp_mode)
    # at most 64 registers a thread: a block of 1024 threads always launches
    jit = cuda.jit if simulator_enabled() else cuda.jit(max_registers=64)

    @jit
    def qb_hist_lanes(logits, cutoff, valid, bounds, partial, num_tokens, num_experts, num_bins, chunks, slab):
        hist = cuda.shared.array(0, nb_i32)  # lane l's bin k at k * 32 + l: bank l
        tid = np.int32(cuda.threadIdx.x)
        nth = np.int32(cuda.blockDim.x)
        b = np.int32(cuda.blockIdx.x)
        s_idx = b // np.int32(chunks)
        e0 = (b - s_idx * np.int32(chunks)) * np.int32(LANES)
        t0 = np.int64(s_idx) * np.int64(slab)
        t1 = min(np.int64(num_tokens), t0 + np.int64(slab))
        nb = np.int32(num_bins)
        words = nb * np.int32(LANES)
        i = tid
        while i < words:
            hist[i] = np.int32(0)
            i += nth
        # Barrier: the counts are zero before any lane adds.
        cuda.syncthreads()
        lower = bounds[0]
        scale = np.float32(np.float32(nb) / np.float32(bounds[1] - lower))
        top_f = np.float32(nb - np.int32(1))
        lane = tid & np.int32(LANES - 1)
        e = e0 + lane
        xs = cuda.local.array(unroll, nb_f32)  # registers: the loops over them unroll
        cs = cuda.local.array(unroll, nb_f32)
        vs = cuda.local.array(unroll, nb_i32)
        if e < np.int32(num_experts):
            step = np.int64(nth // np.int32(LANES))
            t = t0 + np.int64(tid // np.int32(LANES))
            while t + (unroll - 1) * step < t1:
                for u in range(unroll):  # the rows' loads go out together
                    tu = t + u * step
                    xs[u] = load(logits, u64(tu), u64(e))
                    cs[u] = cutoff[u64(tu)]
                    if masked:
                        vs[u] = np.int32(valid[u64(tu)] != 0)
                for u in range(unroll):
                    if not masked or vs[u] != 0:
                        x = xs[u]
                        k = qb_bin(np.float32(cs[u] - (x if scores else sigmoid(x))), lower, scale, top_f)
                        cuda.atomic.add(hist, u32(k * np.int32(LANES) + lane), np.int32(1))
                t += unroll * step
            while t < t1:
                if not masked or valid[u64(t)]:
                    x = load(logits, u64(t), u64(e))
                    k = qb_bin(np.float32(cutoff[u64(t)] - (x if scores else sigmoid(x))), lower, scale, top_f)
                    cuda.atomic.add(hist, u32(k * np.int32(LANES) + lane), np.int32(1))
                t += step
        # Barrier: every add of the block is in before the stores read.
        cuda.syncthreads()
        ec = min(np.int32(LANES), np.int32(num_experts) - e0)
        base = np.int64(s_idx) * np.int64(nb) * np.int64(num_experts) + np.int64(e0)
        i = tid
        while i < words:  # word k * 32 + l to partial[s, k, e0 + l]
            k = i // np.int32(LANES)
            el = i - k * np.int32(LANES)
            if el < ec:
                partial[u64(base + np.int64(k) * np.int64(num_experts) + np.int64(el))] = hist[i]
            i += nth

    return qb_hist_lanes


@cuda.jit
def qb_reduce_lanes_kernel(partial, counts, num_experts, num_bins, slabs, tiles_e):
    """``counts[e, b] = sum_s partial[s, b, e]``: a block a tile of 32 bins x 32
    experts (``tiles_e`` tiles along E), ``blockDim`` a multiple of 32; the
    sums read along E, then written along B through a padded shared tile."""
    tile = cuda.shared.array(_TILE, nb_i32)
    tid = np.int32(cuda.threadIdx.x)
    rows = np.int32(cuda.blockDim.x) // np.int32(LANES)
    tx = tid & np.int32(LANES - 1)
    ty = tid // np.int32(LANES)
    bt = np.int32(cuda.blockIdx.x) // np.int32(tiles_e)
    k0 = bt * np.int32(LANES)
    e0 = (np.int32(cuda.blockIdx.x) - bt * np.int32(tiles_e)) * np.int32(LANES)
    n = np.int64(num_bins) * np.int64(num_experts)
    r = ty
    while r < np.int32(LANES):
        k = k0 + r
        e = e0 + tx
        acc = np.int32(0)
        if k < np.int32(num_bins) and e < np.int32(num_experts):
            j = np.int64(k) * np.int64(num_experts) + np.int64(e)
            for _ in range(slabs):
                acc += partial[u64(j)]
                j += n
        tile[r, tx] = acc
        r += rows
    # Barrier: the tile is full before it is read across.
    cuda.syncthreads()
    r = ty
    while r < np.int32(LANES):
        e = e0 + r
        k = k0 + tx
        if e < np.int32(num_experts) and k < np.int32(num_bins):
            counts[u64(np.int64(e) * np.int64(num_bins) + np.int64(k))] = tile[tx, r]
        r += rows


__all__ = ["LANES", "lanes_shared_bytes", "qb_hist_lanes_kernel", "qb_reduce_lanes_kernel"]
