"""A warp's lanes exchanging values, and the two bitonic sorts of the
warp-per-token forward (``warp_topk_fwd.py``).

On a GPU the exchanges are warp shuffles.  The CUDA simulator has none, so
there each one is a shared-memory twin: every thread of the block writes its
value to ``red[tid]`` between two block barriers and reads its partner's
word.  A twin must be reached by every thread of the block, so the kernels
that use these call them on block-uniform paths only, and ask
``uniform_any`` (a block-wide vote on the simulator, the warp's own flag on
a GPU) before a branch that holds exchanges.

Each exchange takes ``(v, arg, red, tid)``: ``red`` a shared array of the
value's type with a word per thread of the block (read on the simulator
only), ``tid`` the thread's index in the block.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from ..._base.device import NEG_INF, inline_device
from ..._base.launch import simulator_enabled

FULL = np.uint32(0xFFFFFFFF)
NO_EXPERT = np.int32(0x7FFFFFFF)  # a key after every expert's


def warp_auto(simulator: bool | None = None) -> bool:
    """Whether ``path="auto"`` takes a warp-per-token kernel (forward or
    backward) for a shape it fits: on a GPU always (timed faster than the
    other kernels at every preset and T = 1024 - 65536: lab/journal/benchmarks.md,
    "Softmax after the top-k" and "A warp a token, backward"); never on the
    CUDA simulator (``simulator`` None: whether it is on), where the
    exchanges are block barriers and the other kernels, the same bits or the
    same gradients, run many times faster (the warp kernels' own tests force
    ``path="warp"``)."""
    return not (simulator_enabled() if simulator is None else simulator)


def warp_grid(num_tokens: int, warps: int, max_blocks: int) -> tuple[int, int]:
    """``(grid, threads)`` of a warp-per-token kernel: ``warps`` warps (tokens)
    a block on a GPU, one on the simulator (where a barrier costs a thread
    switch for each thread), at most ``max_blocks`` blocks (a grid-strided
    token loop)."""
    warps = 1 if simulator_enabled() else warps
    return max(1, min(max_blocks, -(-num_tokens // warps))), 32 * warps


@cuda.jit(device=True)
def ahead(v, e, ov, oe):
    """Whether (score ``v``, expert ``e``) comes before (``ov``, ``oe``) in the
    selection order: the larger score, then the lower expert."""
    return (v > ov) | ((v == ov) & (e < oe))


@functools.cache
def exchanges():
    """``(xor, up, idx, uniform_any, warp_sync)``: ``xor(v, m, red, tid)``, lane
    ``l`` gets lane ``l ^ m``'s ``v``; ``up(v, d, red, tid)`` lane ``l - d``'s (its
    own below ``d``); ``idx(v, src, red, tid)`` lane ``src``'s; ``uniform_any(flag)``
    whether the flag (the same on a warp's lanes) is set anywhere it must be
    honoured; ``warp_sync()`` orders a warp's shared-memory writes before its
    reads."""
    if simulator_enabled():

        @cuda.jit(device=True)
        def publish(v, red, tid):
            cuda.syncthreads()  # the previous exchange's reads are done
            red[tid] = v
            cuda.syncthreads()

        @cuda.jit(device=True)
        def xor(v, m, red, tid):
            publish(v, red, tid)
            return red[tid ^ m]

        @cuda.jit(device=True)
        def up(v, d, red, tid):
            publish(v, red, tid)
            return red[tid - d] if (tid & 31) >= d else v

        @cuda.jit(device=True)
        def idx(v, src, red, tid):
            publish(v, red, tid)
            return red[(tid & -32) + src]

        @cuda.jit(device=True)
        def uniform_any(flag):
            return cuda.syncthreads_or(np.int32(flag)) != 0

        @cuda.jit(device=True)
        def warp_sync():
            cuda.syncthreads()

        return xor, up, idx, uniform_any, warp_sync

    @inline_device
    def xor(v, m, red, tid):
        return cuda.shfl_xor_sync(FULL, v, m)

    @inline_device
    def up(v, d, red, tid):
        return cuda.shfl_up_sync(FULL, v, d)

    @inline_device
    def idx(v, src, red, tid):
        return cuda.shfl_sync(FULL, v, src)

    @cuda.jit(device=True)
    def uniform_any(flag):
        return flag

    @cuda.jit(device=True)
    def warp_sync():
        cuda.syncwarp(FULL)

    return xor, up, idx, uniform_any, warp_sync


@functools.cache
def warp_sorts():
    """``(sort64, sort32, sort32v)``.

    ``sort64(a0, a1, red, tid) -> (a0, a1)``: a descending bitonic sort of 64
    fp32 values, item ``i = 2 lane + h`` in slot ``a_h`` of its lane.
    ``sort32v(v, red, tid) -> v``: a descending sort of 32 fp32 values, one a
    lane.
    ``sort32(v, e, red, redi, tid) -> (v, e)``: a bitonic sort of 32 (score,
    expert) pairs, one a lane, in the selection order (``ahead`` first).

    The stages are written out, one call each with constant ``(k, j)``: numba
    does not unroll a loop that holds shuffles, and a loop's stage cost about 30
    more instructions on an H200 (a warp-select probe since removed; figures in the lab journal).  Each stage
    calls the exchange once a value: a stage that called the next one on two
    branches would double the inlined code at every level."""
    xor, _, _, _, _ = exchanges()

    @inline_device
    def stage64(a0, a1, red, tid, k, j):
        i0 = (tid & 31) * 2
        if j == 1:  # the lane's own two items
            hi = max(a0, a1)
            lo = min(a0, a1)
            first = (i0 & k) == 0
            return (hi if first else lo), (lo if first else hi)
        o0 = xor(a0, j >> 1, red, tid)
        o1 = xor(a1, j >> 1, red, tid)
        keep_max = ((i0 & j) == 0) == ((i0 & k) == 0)
        return (max(a0, o0) if keep_max else min(a0, o0)), (max(a1, o1) if keep_max else min(a1, o1))

    @cuda.jit(device=True)
    def sort64(a0, a1, red, tid):
        a0, a1 = stage64(a0, a1, red, tid, 2, 1)
        a0, a1 = stage64(a0, a1, red, tid, 4, 2)
        a0, a1 = stage64(a0, a1, red, tid, 4, 1)
        a0, a1 = stage64(a0, a1, red, tid, 8, 4)
        a0, a1 = stage64(a0, a1, red, tid, 8, 2)
        a0, a1 = stage64(a0, a1, red, tid, 8, 1)
        a0, a1 = stage64(a0, a1, red, tid, 16, 8)
        a0, a1 = stage64(a0, a1, red, tid, 16, 4)
        a0, a1 = stage64(a0, a1, red, tid, 16, 2)
        a0, a1 = stage64(a0, a1, red, tid, 16, 1)
        a0, a1 = stage64(a0, a1, red, tid, 32, 16)
        a0, a1 = stage64(a0, a1, red, tid, 32, 8)
        a0, a1 = stage64(a0, a1, red, tid, 32, 4)
        a0, a1 = stage64(a0, a1, red, tid, 32, 2)
        a0, a1 = stage64(a0, a1, red, tid, 32, 1)
        a0, a1 = stage64(a0, a1, red, tid, 64, 32)
        a0, a1 = stage64(a0, a1, red, tid, 64, 16)
        a0, a1 = stage64(a0, a1, red, tid, 64, 8)
        a0, a1 = stage64(a0, a1, red, tid, 64, 4)
        a0, a1 = stage64(a0, a1, red, tid, 64, 2)
        a0, a1 = stage64(a0, a1, red, tid, 64, 1)
        return a0, a1

    # Not inline_device: compiled once per constant (k, j) (15 compiles), its
    # lane tests folded into each stage. Compiled once for every constant,
    # NVVM computed the four lane bits (lane >> b) & 1 once, before the
    # candidate sort, and Kimi-K2's warp forward ran 1.8-2.0% slower on an
    # H200 (docs/cache.md, "Constants at the call, one compile").
    @cuda.jit(device=True)
    def stage32(v, e, red, redi, tid, k, j):
        lane = tid & 31
        ov = xor(v, j, red, tid)
        oe = xor(e, j, redi, tid)
        take = ahead(ov, oe, v, e) == (((lane & j) == 0) == ((lane & k) == 0))
        return (ov if take else v), (oe if take else e)

    @inline_device
    def stage32v(v, red, tid, k, j):
        lane = tid & 31
        o = xor(v, j, red, tid)
        keep_max = ((lane & j) == 0) == ((lane & k) == 0)
        return max(v, o) if keep_max else min(v, o)

    @cuda.jit(device=True)
    def sort32v(v, red, tid):
        v = stage32v(v, red, tid, 2, 1)
        v = stage32v(v, red, tid, 4, 2)
        v = stage32v(v, red, tid, 4, 1)
        v = stage32v(v, red, tid, 8, 4)
        v = stage32v(v, red, tid, 8, 2)
        v = stage32v(v, red, tid, 8, 1)
        v = stage32v(v, red, tid, 16, 8)
        v = stage32v(v, red, tid, 16, 4)
        v = stage32v(v, red, tid, 16, 2)
        v = stage32v(v, red, tid, 16, 1)
        v = stage32v(v, red, tid, 32, 16)
        v = stage32v(v, red, tid, 32, 8)
        v = stage32v(v, red, tid, 32, 4)
        v = stage32v(v, red, tid, 32, 2)
        return stage32v(v, red, tid, 32, 1)

    @cuda.jit(device=True)
    def sort32(v, e, red, redi, tid):
        v, e = stage32(v, e, red, redi, tid, 2, 1)
        v, e = stage32(v, e, red, redi, tid, 4, 2)
        v, e = stage32(v, e, red, redi, tid, 4, 1)
        v, e = stage32(v, e, red, redi, tid, 8, 4)
        v, e = stage32(v, e, red, redi, tid, 8, 2)
        v, e = stage32(v, e, red, redi, tid, 8, 1)
        v, e = stage32(v, e, red, redi, tid, 16, 8)
        v, e = stage32(v, e, red, redi, tid, 16, 4)
        v, e = stage32(v, e, red, redi, tid, 16, 2)
        v, e = stage32(v, e, red, redi, tid, 16, 1)
        v, e = stage32(v, e, red, redi, tid, 32, 16)
        v, e = stage32(v, e, red, redi, tid, 32, 8)
        v, e = stage32(v, e, red, redi, tid, 32, 4)
        v, e = stage32(v, e, red, redi, tid, 32, 2)
        v, e = stage32(v, e, red, redi, tid, 32, 1)
        return v, e

    return sort64, sort32, sort32v


@functools.cache
def warp_scans():
    """``(inclusive_sum(v, redi, tid), arg_max(v, e, red, redi, tid))``: a warp's
    inclusive prefix sum of int32 ``v`` in lane order; the first (score,
    expert) pair of the warp in the selection order, on every lane."""
    xor, up, _, _, _ = exchanges()

    @inline_device
    def add_up(v, d, redi, tid):
        o = up(v, d, redi, tid)
        return np.int32(v + o) if (tid & 31) >= d else v  # (numba's sum would be 64-bit: two shuffles a step)

    @cuda.jit(device=True)
    def inclusive_sum(v, redi, tid):
        v = add_up(v, 1, redi, tid)
        v = add_up(v, 2, redi, tid)
        v = add_up(v, 4, redi, tid)
        v = add_up(v, 8, redi, tid)
        return add_up(v, 16, redi, tid)

    @inline_device
    def max_step(v, e, red, redi, tid, m):
        ov = xor(v, m, red, tid)
        oe = xor(e, m, redi, tid)
        take = ahead(ov, oe, v, e)
        return (ov if take else v), (oe if take else e)

    @cuda.jit(device=True)
    def arg_max(v, e, red, redi, tid):
        v, e = max_step(v, e, red, redi, tid, 16)
        v, e = max_step(v, e, red, redi, tid, 8)
        v, e = max_step(v, e, red, redi, tid, 4)
        v, e = max_step(v, e, red, redi, tid, 2)
        return max_step(v, e, red, redi, tid, 1)

    return inclusive_sum, arg_max


@functools.cache
def warp_ranks():
    """``by_rank(wv, we, cv, ce, lane, count) -> (v, e)``: the warp-per-token
    forward's candidates in the selection order, without a sort."""
    warp_sync = exchanges()[4]

    @cuda.jit(device=True)
    def by_rank(wv, we, cv, ce, lane, count):
        """The ``count`` candidates in the warp's words (this lane's ``(cv, ce)``
        if ``lane < count``) in the selection order, the k-th in lane k (``sort32``'s
        result; the others get ``(-inf, NO_EXPERT)``): each candidate's rank is
        the number of candidates ahead of it (the keys differ: a permutation),
        then each goes to its rank's word."""
        rank = np.int32(0)
        j = np.int32(0)
        while j < count:  # (int32, unsigned indices: numba's range is 64-bit, its indices wrap)
            rank = np.int32(rank + np.int32(ahead(wv[np.uint32(j)], we[np.uint32(j)], cv, ce)))
            j = np.int32(j + np.int32(1))
        warp_sync()  # every read done before the words are overwritten
        if lane < count:
            wv[np.uint32(rank)] = cv
            we[np.uint32(rank)] = ce
        warp_sync()
        ulane = np.uint32(lane)
        v = wv[ulane] if lane < count else NEG_INF
        e = we[ulane] if lane < count else NO_EXPERT
        warp_sync()
        return v, e

    return by_rank
