"""Row helpers of the thread-per-token forward kernels (``token_topk_fwd.py``,
``token_aux_scores_fwd.py``): the register top-K list, the int32 flat walks
(quads, and the BITMAP_U8 phase's octets), a quad's selection flags, the
staging of the tile (``token_stager``) and the softmax rows.

Instruction counts (SASS, sm_90) drove the code's shape: loop counters are
int32 ``while`` loops and indices unsigned, because numba's int64 ``range``
loops and wrapped signed indices cost several times a loop's own work.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import int32 as nb_i32

from ..._base.access import flat_io
from ..._base.device import NEG_INF, ONE, SIGMOID, SOFTMAX, ZERO, activation, exp_f32, fmax_f32, fmin_f32, u32, u64
from ..._base.vec import quad_f32

STAGE_QUADS = 4  # quads per step of the staging, their loads in flight together
STAGE_VALUES = 4 * STAGE_QUADS  # (local-array sizes must be plain constants on the GPU)


@functools.cache
def register_pusher(cap: int):
    """Device function ``push(keys, v)``: fp32 ``v`` (no NaN) into the register
    list ``keys[0:cap]`` (descending, empty slots -inf), which keeps the
    ``cap`` largest values seen, repeats included.  ``cap`` is a compile-time
    constant: the loop unrolls and the list stays in registers; one fminf and
    one fmaxf per slot, no branches (a warp's 32 threads hold 32 independent
    lists)."""

    @cuda.jit(device=True)
    def push(keys, v):
        for q in range(cap - 1, 0, -1):
            keys[q] = fmax_f32(keys[q], fmin_f32(keys[q - 1], v))
        keys[0] = fmax_f32(keys[0], v)

    return push


@cuda.jit(device=True)
def flat_walk_i32(tid, nthreads, n):
    """``topk/lane/rows.flat_walk`` in int32: start ``(t, q)`` and step ``(dt, dq)`` of a flat
    loop over ``[rows, n]`` items, thread ``tid`` taking ``tid, tid + nthreads, ...``."""
    t = np.int32(tid // n)
    dt = np.int32(nthreads // n)
    return t, np.int32(tid - t * n), dt, np.int32(nthreads - dt * n)


@cuda.jit(device=True)
def flat_next_i32(t, q, dt, dq, n):
    t = np.int32(t + dt)
    q = np.int32(q + dq)
    if q >= n:
        q = np.int32(q - n)
        t = np.int32(t + 1)
    return t, q


@cuda.jit(device=True)
def octet_walk(tid, nthreads, nt, nb):
    """The BITMAP_U8 phase 3's walk over a tile's ``[nt, nb]`` octets: a warp
    takes a group of 8 consecutive tokens by a chunk of 4 consecutive octets,
    lane ``l`` token ``l % 8`` and octet ``l / 8`` (a row-major walk would
    put a warp's 32 lanes on one row at an 8-word stride: 8-way bank
    conflicts on every tile read; here the odd row stride spreads the 8
    rows over the banks: none).  ``(lt, lo, ngroups, nchunks, g, c, dg,
    dc)``: the lane's token and octet in the group and chunk, the counts,
    and the warp's start and step over ``[ngroups, nchunks]`` (``flat_next_i32``).
    ``nthreads``: a multiple of 32."""
    lane = np.int32(tid & 31)
    nchunks = np.int32((nb + 3) >> 2)
    g, c, dg, dc = flat_walk_i32(np.int32(tid >> 5), np.int32(nthreads >> 5), nchunks)
    return np.int32(lane & 7), np.int32(lane >> 3), np.int32((nt + 7) >> 3), nchunks, g, c, dg, dc


@cuda.jit(device=True)
def quad_flags(r0, r1, r2, r3, q, thr, cut, bits, fword):
    """Quad ``q``'s four selection flags, a byte per expert (its ``routing_map``
    word): its four scores ``r0..r3`` against the token's threshold ``thr``
    and tie cutoff ``cut``, or (``thr`` NaN) the token's bits at
    ``bits[fword:]``."""
    if thr != thr:
        n = np.uint32(bits[u32(fword + (q >> 3))] >> np.uint32(4 * (q & 7)))
        return np.uint32((n & np.uint32(1)) | ((n & np.uint32(2)) << np.uint32(7))
                         | ((n & np.uint32(4)) << np.uint32(14)) | ((n & np.uint32(8)) << np.uint32(21)))
    j = 4 * q
    return (np.uint32((r0 > thr) | ((r0 == thr) & (j <= cut)))
            | np.uint32(np.uint32((r1 > thr) | ((r1 == thr) & (j + 1 <= cut))) << np.uint32(8))
            | np.uint32(np.uint32((r2 > thr) | ((r2 == thr) & (j + 2 <= cut))) << np.uint32(16))
            | np.uint32(np.uint32((r3 > thr) | ((r3 == thr) & (j + 3 <= cut))) << np.uint32(24)))


@cuda.jit(device=True)
def quad_nibble(r0, r1, r2, r3, q, thr, cut, bits, fword):
    """``quad_flags`` for a BITMAP_U8 map: quad ``q``'s four selection flags as
    bits 0..3 (expert ``4q + i``: bit ``i``), half of its map byte.  The bit
    way's nibble is the bits themselves.  int32 throughout (numba would
    widen the index compares and the flag ORs to 64 bits)."""
    if thr != thr:
        return np.uint32(np.uint32(bits[u32(fword + (q >> 3))] >> np.uint32(4 * (q & 7))) & np.uint32(15))
    j = np.int32(4 * q)
    c0 = np.int32((r0 > thr) | ((r0 == thr) & (j <= cut)))
    c1 = np.int32((r1 > thr) | ((r1 == thr) & (np.int32(j + 1) <= cut)))
    c2 = np.int32((r2 > thr) | ((r2 == thr) & (np.int32(j + 2) <= cut)))
    c3 = np.int32((r3 > thr) | ((r3 == thr) & (np.int32(j + 3) <= cut)))
    return np.uint32(np.int32(c0 | np.int32(c1 << 1)) | np.int32(np.int32(c2 << 2) | np.int32(c3 << 3)))


@functools.cache
def token_stager(kind: str, score_fn: int, has_bias: bool, bias_first: bool = False):
    """Device function staging the forward tile, ``STAGE_QUADS`` quads per step, their
    loads in flight together: the score function, ``saved`` (sigmoid: ``a``;
    sqrtsoftplus: the raw ``x``, TE's convention; softmax: nothing yet; one
    16-byte store per quad), the tile; with ``has_bias`` the bias into
    ``smem[o_bias:o_bias+E]`` (``bias_first``, the chunk lanes' small tiles: thread
    q's bias quad loaded before the logits and stored after them, the two
    loads in flight together; else a word a thread at a time, first).  Ends
    with a barrier."""
    load4 = flat_io(kind)[0]
    load_f32, store_f32 = quad_f32()

    @cuda.jit(device=True)
    def put4(x0, x1, x2, x3, w, tile, saved, smem):
        s0, s1, s2, s3 = x0, x1, x2, x3
        if score_fn != SOFTMAX:
            s0 = activation(x0, score_fn)
            s1 = activation(x1, score_fn)
            s2 = activation(x2, score_fn)
            s3 = activation(x3, score_fn)
            if score_fn == SIGMOID:
                store_f32(saved, w, s0, s1, s2, s3)
            else:
                store_f32(saved, w, x0, x1, x2, x3)
        smem[u32(tile)] = s0
        smem[u32(tile + 1)] = s1
        smem[u32(tile + 2)] = s2
        smem[u32(tile + 3)] = s3

    @cuda.jit(device=True)
    def walk(lg, saved, smem, wb, nt, eq, stride, tid, nthreads):
        xs = cuda.local.array(STAGE_VALUES, nb_f32)
        ts = cuda.local.array(STAGE_QUADS, nb_i32)
        qs = cuda.local.array(STAGE_QUADS, nb_i32)
        t, q, dt, dq = flat_walk_i32(tid, nthreads, eq)
        while t < nt:
            ts[0] = t
            qs[0] = q
            for i in range(1, STAGE_QUADS):
                ts[i], qs[i] = flat_next_i32(ts[i - 1], qs[i - 1], dt, dq, eq)
            for i in range(STAGE_QUADS):  # every load first: STAGE_QUADS quads in flight
                if ts[i] < nt:
                    xs[4 * i], xs[4 * i + 1], xs[4 * i + 2], xs[4 * i + 3] = load4(
                        lg, wb + np.int32(ts[i] * eq + qs[i]))
            for i in range(STAGE_QUADS):
                if ts[i] < nt:
                    put4(xs[4 * i], xs[4 * i + 1], xs[4 * i + 2], xs[4 * i + 3],
                         wb + np.int32(ts[i] * eq + qs[i]), ts[i] * stride + 4 * qs[i], saved, smem)
            t, q = flat_next_i32(ts[STAGE_QUADS - 1], qs[STAGE_QUADS - 1], dt, dq, eq)

    @cuda.jit(device=True)
    def stage(lg, bias, saved, smem, o_bias, wb, nt, eq, stride, tid, nthreads):
        if has_bias:
            j = np.int32(tid)
            while j < 4 * eq:
                smem[u32(o_bias + j)] = bias[u64(j)]
                j = np.int32(j + nthreads)
        walk(lg, saved, smem, wb, nt, eq, stride, tid, nthreads)
        cuda.syncthreads()

    @cuda.jit(device=True)
    def stage_bias_first(lg, bias, saved, smem, o_bias, wb, nt, eq, stride, tid, nthreads):
        c0 = c1 = c2 = c3 = ZERO
        if has_bias and tid < eq:
            c0, c1, c2, c3 = load_f32(bias, np.int32(tid))
        walk(lg, saved, smem, wb, nt, eq, stride, tid, nthreads)
        if has_bias:
            q = np.int32(tid)
            while q < eq:
                if q != tid:
                    c0, c1, c2, c3 = load_f32(bias, q)
                smem[u32(o_bias + 4 * q)] = c0
                smem[u32(o_bias + 4 * q + 1)] = c1
                smem[u32(o_bias + 4 * q + 2)] = c2
                smem[u32(o_bias + 4 * q + 3)] = c3
                q = np.int32(q + nthreads)
        cuda.syncthreads()

    return stage_bias_first if bias_first else stage


@functools.cache
def softmax_rows(from_exp: bool = False):
    """Device functions of the softmax rows (``from_exp``: ``normalise`` finds
    ``exp(x - max)`` in the tile, ``lane_softmax_stats`` put it there): ``stats(smem, row, valid, E, o_m,
    o_s)``, by a row's thread: the max (NaN ignored) then ``sum exp(x -
    max)``, stored (``valid`` rows) at ``smem[o_m]`` and, as ``1 / sum``, at
    ``smem[o_s]``; and ``normalise(smem, o_red, tb, out1, out2, write2, wb,
    nt, eq, stride, tid, nthreads)``, all threads, a quad per step: the tile
    rows as ``exp(x - max) / sum`` like jax.nn.softmax (an all -inf row
    giving NaN; a product with the reciprocal, within an ulp of the
    division), in place, to ``out1`` and (``write2``) ``out2`` (flat fp32,
    16-byte stores).  Token t's statistics: ``smem[o_red + t]``,
    ``smem[o_red + tb + t]``.  ``stats`` is followed, ``normalise`` ends,
    with a barrier."""
    store_f32 = quad_f32()[1]

    @cuda.jit(device=True)
    def stats(smem, row, valid, num_experts, o_m, o_s):
        # two accumulators (even and odd experts; E is even): two dependency
        # chains in flight, the scan being latency-bound
        if valid:
            m = NEG_INF
            m2 = NEG_INF
            j = np.int32(0)
            while j < num_experts:
                v = smem[u32(row + j)]
                v2 = smem[u32(row + j + 1)]
                if v > m:  # NaN never wins; it still makes the sum NaN below
                    m = v
                if v2 > m2:
                    m2 = v2
                j = np.int32(j + 2)
            if m2 > m:
                m = m2
            total = ZERO
            total2 = ZERO
            j = np.int32(0)
            while j < num_experts:
                total += exp_f32(smem[u32(row + j)] - m)
                total2 += exp_f32(smem[u32(row + j + 1)] - m)
                j = np.int32(j + 2)
            smem[u32(o_m)] = m
            smem[u32(o_s)] = np.float32(ONE / np.float32(total + total2))
        cuda.syncthreads()

    @cuda.jit(device=True)
    def one(v, m, inv):
        if from_exp:  # v is exp_f32(x - m) already: the same bits
            return np.float32(v * inv)
        return np.float32(exp_f32(v - m) * inv)

    @cuda.jit(device=True)
    def normalise(smem, o_red, tb, out1, out2, write2, wb, nt, eq, stride, tid, nthreads):
        t, q, dt, dq = flat_walk_i32(tid, nthreads, eq)
        while t < nt:
            m = smem[u32(o_red + t)]
            inv = smem[u32(o_red + tb + t)]
            base = np.int32(t * stride + 4 * q)
            p0 = one(smem[u32(base)], m, inv)
            p1 = one(smem[u32(base + 1)], m, inv)
            p2 = one(smem[u32(base + 2)], m, inv)
            p3 = one(smem[u32(base + 3)], m, inv)
            smem[u32(base)] = p0
            smem[u32(base + 1)] = p1
            smem[u32(base + 2)] = p2
            smem[u32(base + 3)] = p3
            w = wb + np.int32(t * eq + q)
            store_f32(out1, w, p0, p1, p2, p3)
            if write2:
                store_f32(out2, w, p0, p1, p2, p3)
            t, q = flat_next_i32(t, q, dt, dq, eq)
        cuda.syncthreads()

    return stats, normalise


@functools.cache
def lane_softmax_stats():
    """Device function ``stats(smem, tid, nthreads, nt, tb, stride, E, o_scr, area, o_red)``:
    ``softmax_rows``' ``stats`` by a token's W = ``nthreads // tb`` lanes (all
    threads call it; three barriers), the same bits: lane l takes the runs
    of 32 experts l, l + W, ...: their maxima (NaN ignored) into the token's
    scratch ``smem[o_scr + t * area:]``; then every lane the row max (the
    same value in any order) and its runs' ``exp(x - max)`` in place in the
    tile (``softmax_rows(True)``'s ``normalise`` reads them); then lane 0
    the sum in ``stats``' order (even and odd experts, two accumulators),
    the max at ``smem[o_red + t]``, ``1 / sum`` at ``smem[o_red + tb + t]``."""

    @cuda.jit(device=True)
    def stats(smem, tid, nthreads, nt, tb, stride, num_experts, o_scr, area, o_red):
        lanes = np.int32(nthreads // tb)
        t = np.int32(tid // lanes)
        lane = np.int32(tid - t * lanes)
        runs = np.int32((num_experts + 31) >> 5)
        row = np.int32(t * stride)
        scr = np.int32(o_scr + t * area)
        live = t < nt
        if live:
            k = lane
            while k < runs:
                m = NEG_INF
                j = np.int32(row + 32 * k)
                end = np.int32(row + min(32 * k + 32, num_experts))
                while j < end:
                    v = smem[u32(j)]
                    if v > m:
                        m = v
                    j = np.int32(j + 1)
                smem[u32(scr + k)] = m
                k = np.int32(k + lanes)
        cuda.syncthreads()
        if live:
            m = NEG_INF
            k = np.int32(0)
            while k < runs:
                v = smem[u32(scr + k)]
                if v > m:
                    m = v
                k = np.int32(k + 1)
            k = lane
            while k < runs:
                j = np.int32(row + 32 * k)
                end = np.int32(row + min(32 * k + 32, num_experts))
                while j < end:
                    smem[u32(j)] = exp_f32(smem[u32(j)] - m)
                    j = np.int32(j + 1)
                k = np.int32(k + lanes)
            if lane == 0:
                smem[u32(o_red + t)] = m
        cuda.syncthreads()
        if live and lane == 0:
            total = ZERO
            total2 = ZERO
            j = np.int32(row)
            end = np.int32(row + num_experts)
            while j < end:  # E % 4 == 0: two pairs a step, their loads first
                e0 = smem[u32(j)]
                e1 = smem[u32(j + 1)]
                e2 = smem[u32(j + 2)]
                e3 = smem[u32(j + 3)]
                total += e0
                total2 += e1
                total += e2
                total2 += e3
                j = np.int32(j + 4)
            smem[u32(o_red + tb + t)] = np.float32(ONE / np.float32(total + total2))
        cuda.syncthreads()

    return stats
