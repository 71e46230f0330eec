"""Thread-per-token forward kernels: the router top-k and aux-score forwards
for K <= ``_launch.TOKEN_MAX_TOPK`` and E a multiple of 4 (every model preset
but Nemotron's K=22; the others take the W-lane kernels of ``topk.py`` and
``aux_scores.py``).

Why one thread per token (docs/benchmarks.md): the W-lane kernels spend
their time in the selection, a few thousand warp instructions per token
(shared-memory lists, tree merges, a barrier per merge level).  Here a
token's whole selection is one thread's serial scan of its tile row, its
top-K list in registers and updated without branches (the 32 threads of a
warp scan 32 independent rows: any data-dependent branch would diverge).

Decomposition: a block owns TB tokens and ``threads >= TB`` threads; its
shared memory holds the fp32 tile of the tokens' scores (row stride
``P = E | 1``: odd, so the per-thread row scans hit 32 distinct banks), a
selection flag per expert (the four flags of a quad are one word), the
group scores, per-row statistics and the expert bias.  Global arrays are
seen flat (``topk.array_views``).

1. All threads, coalesced, four experts (a quad) per step, four quads in
   flight (bf16 logits as one 8-byte load per quad): the score function,
   ``saved``, the tile; the flag words cleared; the bias.
2. Thread t (t < TB), tile row t: (group scores, group ranks,) the K
   largest keys, then a second scan that flags the selected experts; the
   weights' statistics into shared memory.
3. All threads, coalesced, a quad per step: the flag word is the quad's
   ``routing_map`` word (one 4-byte store); the weights, ``probs`` (bf16:
   one 8-byte store), ``saved`` for post-softmax.

Ranks (CONTRACT section 2): the register list holds int32 *keys* only, an
order-preserving image of the fp32 scores (NaN as -inf, -0.0 as +0.0) in
which an empty slot ranks below every score, -inf included; keeping the K
largest keys costs two integer min/max per slot.  Which experts own them
the second scan decides, in ascending expert order: keys above the K-th
largest are selected, and keys equal to it while places remain, so among
equal scores the lower index wins.

Instruction counts (SASS, sm_90) drove the code's shape: loop counters are
int32 ``while`` loops and indices unsigned, because numba's int64 ``range``
loops and wrapped signed indices cost several times a loop's own work; the
score function, bias and softmax order are compile-time constants.

No warp intrinsics: the kernels run on the CUDA simulator too.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .topk import (
    _B0,
    _B1,
    _B2,
    _B3,
    _EPS,
    _NEG_INF,
    _ONE,
    _SIGMOID,
    _SOFTMAX,
    _ZERO,
    _activation,
    _exp,
    _u64,
    flat_io,
    nb_f32,
    nb_i32,
    nb_u8,
)

_KEY_EMPTY = np.int32(-(2**31))  # below the key of every fp32, -inf and NaN included
_KEY_FLIP = np.int32(0x7FFFFFFF)
_u32 = np.uint32  # shared-memory indices (see topk._u64)
_MARK = 8  # experts per step of the marking scan
_STAGE = 4  # quads per step of the staging, their loads in flight together
_STAGE_X = 4 * _STAGE  # (local-array sizes must be plain constants on the GPU)


# ----------------------------------------------------------------------------
# Keys and register top-K lists
# ----------------------------------------------------------------------------


@cuda.jit(device=True)
def _key(v):
    """Order-preserving int32 image of fp32 ``v``: NaN as -inf, -0.0 as +0.0."""
    if v != v:
        v = _NEG_INF
    b = np.float32(v + _ZERO).view(np.int32)  # -0.0 + 0.0 = +0.0
    if b < 0:
        b = np.int32(b ^ _KEY_FLIP)
    return b


@cuda.jit(device=True)
def _value(k):
    """The fp32 of a key (``_key``'s inverse on its image)."""
    if k < 0:
        k = np.int32(k ^ _KEY_FLIP)
    return np.int32(k).view(np.float32)


@functools.cache
def _pusher(cap: int):
    """Device function ``push(keys, k)``: key ``k`` into the register list
    ``keys[0:cap]`` (descending), which keeps the ``cap`` largest keys seen,
    repeats included.  ``cap`` is a compile-time constant: the loop unrolls
    and the list stays in registers; two integer min/max per slot, no
    branches (a warp's 32 threads hold 32 independent lists)."""

    @cuda.jit(device=True)
    def push(keys, k):
        for q in range(cap - 1, 0, -1):
            keys[q] = max(keys[q], min(keys[q - 1], k))
        keys[0] = max(keys[0], k)

    return push


@cuda.jit(device=True)
def _walk32(tid, nthreads, n):
    """``topk._walk`` in int32: start ``(t, q)`` and step ``(dt, dq)`` of a flat
    loop over ``[rows, n]`` items, thread ``tid`` taking ``tid, tid + nthreads, ...``."""
    t = np.int32(tid // n)
    dt = np.int32(nthreads // n)
    return t, np.int32(tid - t * n), dt, np.int32(nthreads - dt * n)


@cuda.jit(device=True)
def _adv32(t, q, dt, dq, n):
    t = np.int32(t + dt)
    q = np.int32(q + dq)
    if q >= n:
        q = np.int32(q - n)
        t = np.int32(t + 1)
    return t, q


@functools.cache
def _selector(kcap: int, gcap: int, has_bias: bool, post: bool):
    """Device function ``select(smem, row, E, G, Kg, K, o_gs, o_bias, flags, fbase) -> (total, m)``:
    one thread's (group-limited) top-K of its tile row ``smem[row:row+E]``
    plus, with ``has_bias``, the bias at ``smem[o_bias:o_bias+E]``; sets
    ``flags[fbase + j]`` for the K selected experts ``j``.  ``total``: the
    sum of their tile values (in ascending expert order), ``m`` 0; or, with
    ``post`` (softmax after the top-K, no bias), ``m`` their max and
    ``total`` the sum of ``exp(v - m)``, both from the list's keys (NaN when
    the values' sum is: a selected NaN, or +inf with -inf).

    1. Grouped (``gcap > 0``): group ``g``'s score is the sum, in descending
       order, of its top ``K / Kg`` keys' values (NaN as -inf), kept at
       ``smem[o_gs + g]``; a group is kept when fewer than Kg groups rank
       before it (larger score, NaN as -inf, then lower group).
    2. The K largest keys of the kept experts (all E ungrouped): a register
       list of ``kcap >= K`` keys, no indices.  ``thr``, the K-th largest,
       is the threshold.
    3. The kept experts again, in ascending order: an expert is selected when
       its key beats ``thr``, or equals it while fewer than K have been
       selected, so among equal scores the lower index wins (CONTRACT
       section 2); dropped groups are never selected, not even as fillers.
    """
    push_k = _pusher(kcap)
    glist = max(1, gcap)  # the group list's size (a constant: numba sizes local arrays at compile time)
    push_g = _pusher(glist)

    @cuda.jit(device=True)
    def key_at(smem, row, o_bias, j):
        v = smem[_u32(row + j)]
        if has_bias:
            v = np.float32(v + smem[_u32(o_bias + j)])
        return _key(v)

    @cuda.jit(device=True)
    def scan(smem, row, o_bias, lo, hi, keys):
        # (Two lists on alternate experts, merged at the end, measured slower:
        # DeepSeek-V3 forward 224 vs 186 us on an H200.)
        j = np.int32(lo)
        while j < hi:
            push_k(keys, key_at(smem, row, o_bias, j))
            j = np.int32(j + 1)

    @cuda.jit(device=True)
    def mark(smem, row, o_bias, lo, hi, thr, need, flags, fbase, total):
        # Eight experts a step, every load before any flag store: the flags
        # share the tile's shared memory, so the compiler keeps each load
        # after the stores before it, and one element a step would wait out
        # a load's latency per element.
        vs = cuda.local.array(_MARK, nb_f32)
        bs = cuda.local.array(_MARK, nb_f32)
        j = np.int32(lo)
        while j < hi:
            for i in range(_MARK):  # loads only (past hi: the last expert again, masked below)
                jj = min(np.int32(j + i), np.int32(hi - 1))
                vs[i] = smem[_u32(row + jj)]
                bs[i] = smem[_u32(o_bias + jj)] if has_bias else _ZERO
            for i in range(_MARK):
                v = vs[i]
                k = _key(np.float32(v + bs[i]) if has_bias else v)
                inside = j + i < hi
                tie = k == thr
                hit = inside & ((k > thr) | (tie & (need > 0)))  # no branch: 32 rows per warp
                need = np.int32(need - np.int32(hit & tie))
                total = np.float32(total + (v if hit else _ZERO))
                if inside:  # every byte: the rows' stride is odd, no bank conflicts
                    flags[_u32(fbase + j + i)] = np.uint8(hit)
            j = np.int32(j + _MARK)
        return need, total

    @cuda.jit(device=True)
    def select(smem, row, num_experts, num_groups, group_topk, topk, o_gs, o_bias, flags, fbase):
        keys = cuda.local.array(kcap, nb_i32)
        for q in range(kcap):
            keys[q] = _KEY_EMPTY
        kept = 0
        gsize = np.int32(num_experts)
        ngroups = 1
        if gcap > 0:
            ngroups = np.int32(num_groups)
            gsize = np.int32(num_experts // num_groups)
            per_group = topk // group_topk
            gk = cuda.local.array(glist, nb_i32)
            g = np.int32(0)
            while g < ngroups:
                for q in range(gcap):
                    gk[q] = _KEY_EMPTY
                j = np.int32(g * gsize)
                end = np.int32(j + gsize)
                while j < end:
                    push_g(gk, key_at(smem, row, o_bias, j))
                    j = np.int32(j + 1)
                gs = _value(gk[0])
                for q in range(1, gcap):
                    if q < per_group:
                        gs = np.float32(gs + _value(gk[q]))
                smem[_u32(o_gs + g)] = gs
                g = np.int32(g + 1)
            g = np.int32(0)
            while g < ngroups:
                v = smem[_u32(o_gs + g)]
                if v != v:
                    v = _NEG_INF
                rank = 0
                h = np.int32(0)
                while h < ngroups:
                    u = smem[_u32(o_gs + h)]
                    if u != u:
                        u = _NEG_INF
                    if u > v or (u == v and h < g):
                        rank += 1
                    h = np.int32(h + 1)
                if rank < group_topk:
                    kept |= 1 << g
                g = np.int32(g + 1)
        else:
            kept = 1
        g = np.int32(0)
        while g < ngroups:
            if (kept >> g) & 1:
                scan(smem, row, o_bias, np.int32(g * gsize), np.int32((g + 1) * gsize), keys)
            g = np.int32(g + 1)
        thr = keys[0]
        for q in range(1, kcap):
            if q < topk:
                thr = keys[q]
        need = np.int32(topk)
        for q in range(kcap):
            if q < topk and keys[q] > thr:
                need = np.int32(need - 1)
        total = _ZERO
        g = np.int32(0)
        while g < ngroups:
            if (kept >> g) & 1:
                need, total = mark(smem, row, o_bias, np.int32(g * gsize), np.int32((g + 1) * gsize),
                                   thr, need, flags, fbase, total)
            g = np.int32(g + 1)
        m = _ZERO
        if post:
            m = _value(keys[0])
            e = _ZERO
            for q in range(kcap):
                if q < topk:
                    e += _exp(_value(keys[q]) - m)
            if total == total:
                total = e
        return total, m

    return select


# ----------------------------------------------------------------------------
# Staging and row statistics
# ----------------------------------------------------------------------------


@functools.cache
def _stager(kind: str, sf: int, has_bias: bool):
    """Device function staging the forward tile, ``_STAGE`` quads per step, their
    loads in flight together: the score function, ``saved`` (sigmoid: ``a``;
    sqrtsoftplus: the raw ``x``, TE's convention; softmax: nothing yet), the
    tile, the quad's flag word (``ism[o_flag + t*F + q]``, ``F = E/4 | 1``) cleared; with
    ``has_bias`` the bias into ``smem[o_bias:o_bias+E]``.  Ends with a barrier."""
    load4 = flat_io(kind)[0]

    @cuda.jit(device=True)
    def put(x, f, tile, saved, smem):
        s = x
        if sf != _SOFTMAX:
            s = _activation(x, sf)
            saved[_u64(f)] = s if sf == _SIGMOID else x
        smem[_u32(tile)] = s

    @cuda.jit(device=True)
    def put4(x0, x1, x2, x3, w, tile, saved, smem):
        f = 4 * w
        put(x0, f, tile, saved, smem)
        put(x1, f + 1, tile + 1, saved, smem)
        put(x2, f + 2, tile + 2, saved, smem)
        put(x3, f + 3, tile + 3, saved, smem)

    @cuda.jit(device=True)
    def stage(lg, bias, saved, smem, ism, o_flag, o_bias, wb, nt, eq, stride, tid, nthreads):
        if has_bias:
            j = np.int32(tid)
            while j < 4 * eq:
                smem[_u32(o_bias + j)] = bias[_u64(j)]
                j = np.int32(j + nthreads)
        xs = cuda.local.array(_STAGE_X, nb_f32)
        ts = cuda.local.array(_STAGE, nb_i32)
        qs = cuda.local.array(_STAGE, nb_i32)
        t, q, dt, dq = _walk32(tid, nthreads, eq)
        while t < nt:
            ts[0] = t
            qs[0] = q
            for i in range(1, _STAGE):
                ts[i], qs[i] = _adv32(ts[i - 1], qs[i - 1], dt, dq, eq)
            for i in range(_STAGE):  # every load first: _STAGE quads in flight
                if ts[i] < nt:
                    xs[4 * i], xs[4 * i + 1], xs[4 * i + 2], xs[4 * i + 3] = load4(
                        lg, wb + np.int32(ts[i] * eq + qs[i]))
            for i in range(_STAGE):
                if ts[i] < nt:
                    put4(xs[4 * i], xs[4 * i + 1], xs[4 * i + 2], xs[4 * i + 3],
                         wb + np.int32(ts[i] * eq + qs[i]), ts[i] * stride + 4 * qs[i], saved, smem)
                    ism[_u32(o_flag + ts[i] * (eq | 1) + qs[i])] = 0
            t, q = _adv32(ts[_STAGE - 1], qs[_STAGE - 1], dt, dq, eq)
        cuda.syncthreads()

    return stage


@functools.cache
def _row_normaliser(softmax: bool):
    """Device functions ``stats(smem, row, valid, E, o_m, o_s)``, by a row's
    thread: softmax max (NaN ignored) then ``sum exp(x - max)``, else ``sum
    v``, at ``smem[o_m]``, ``smem[o_s]``; and ``normalise(smem, o_red, out1,
    out2, write2, wb, nt, eq, stride, tid, nthreads)``, all threads, a quad
    per step: the tile rows divided by their statistics (``exp(x - max) /
    sum`` like jax.nn.softmax, an all -inf row giving NaN; or ``v / (sum +
    1e-20)``), in place, to ``out1`` and (``write2``) ``out2`` (flat fp32).
    Token t's statistics: ``smem[o_red + t]``, ``smem[o_red + nthreads + t]``.
    ``stats`` is followed, ``normalise`` ends, with a barrier."""

    @cuda.jit(device=True)
    def stats(smem, row, valid, num_experts, o_m, o_s):
        # two accumulators (even and odd experts; E is even): two dependency
        # chains in flight, the scan being latency-bound
        m = _NEG_INF
        total = _ZERO
        if valid:
            if softmax:
                m2 = _NEG_INF
                j = np.int32(0)
                while j < num_experts:
                    v = smem[_u32(row + j)]
                    v2 = smem[_u32(row + j + 1)]
                    if v > m:  # NaN never wins; it still makes the sum NaN below
                        m = v
                    if v2 > m2:
                        m2 = v2
                    j = np.int32(j + 2)
                if m2 > m:
                    m = m2
            total2 = _ZERO
            j = np.int32(0)
            while j < num_experts:
                v = smem[_u32(row + j)]
                v2 = smem[_u32(row + j + 1)]
                if softmax:
                    v = _exp(v - m)
                    v2 = _exp(v2 - m)
                total += v
                total2 += v2
                j = np.int32(j + 2)
            total = np.float32(total + total2)
        smem[_u32(o_m)] = m
        smem[_u32(o_s)] = total
        cuda.syncthreads()

    @cuda.jit(device=True)
    def one(v, m, s):
        if softmax:
            return np.float32(_exp(v - m) / s)
        return np.float32(v / np.float32(s + _EPS))

    @cuda.jit(device=True)
    def normalise(smem, o_red, out1, out2, write2, wb, nt, eq, stride, tid, nthreads):
        t, q, dt, dq = _walk32(tid, nthreads, eq)
        while t < nt:
            m = smem[_u32(o_red + t)]
            s = smem[_u32(o_red + nthreads + t)]
            base = np.int32(t * stride + 4 * q)
            f = 4 * (wb + np.int32(t * eq + q))
            for i in range(4):
                p = one(smem[_u32(base + i)], m, s)
                smem[_u32(base + i)] = p
                out1[_u64(f + i)] = p
                if write2:
                    out2[_u64(f + i)] = p
            t, q = _adv32(t, q, dt, dq, eq)
        cuda.syncthreads()

    return stats, normalise


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@functools.cache
def topk_fwd_kernel(kind: str, kcap: int, gcap: int, sf: int, has_bias: bool, pre: bool):
    """The top-k forward for logits of ``kind``; ``kcap`` >= K and ``gcap`` >=
    K / Kg (0: no groups) size the register lists (powers of two); the score
    function, the bias and ``use_pre_softmax`` (softmax only) are compile-time
    constants."""
    stage = _stager(kind, sf, has_bias)
    load_at, store4, zero4 = (flat_io(kind)[i] for i in (1, 2, 3))
    select = _selector(kcap, gcap, has_bias, sf == _SOFTMAX and not pre)
    stats, normalise = _row_normaliser(True)
    pre_softmax = sf == _SOFTMAX and pre
    post_softmax = sf == _SOFTMAX and not pre

    @cuda.jit(device=True)
    def weight(v, m, inv, norm):
        """The routing weight of a selected expert of tile value ``v``; ``inv``:
        1 / the token's sum (a product instead of a division: within one ulp)."""
        if post_softmax:
            return np.float32(_exp(v - m) * inv)
        if sf != _SOFTMAX:
            if norm:
                return np.float32(v * inv)
        return v

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind, flat (bf16: [T*E/4] uint64)
        bias,  # [E] fp32 (any fp32 array without a bias; never read then)
        probs,  # [T, E] kind, flat (bf16: [T*E/4] uint64), out
        routing_map,  # [T*E/4] uint32 over the [T, E] bool map, out
        saved,  # [T*E] fp32, out
        num_tokens,
        num_experts,
        topk,  # K
        num_groups,  # G
        group_topk,  # Kg
        scale,  # fp32 scaling_factor
        tile_tokens,  # TB
        stride,  # P
        o_flag,  # word offsets (_launch.token_layout)
        o_gs,
        o_red,
        o_bias,
    ):
        smem = cuda.shared.array(0, nb_f32)  # one dynamic allocation, three views
        ism = cuda.shared.array(0, nb_i32)
        flags = cuda.shared.array(0, nb_u8)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = np.int32(min(tile_tokens, num_tokens - t0))
        valid = tid < nt  # thread t owns tile row t
        row = np.int32(tid * stride)
        eq = np.int32(num_experts // 4)
        wb = t0 * eq  # the tile's first quad (int64)
        norm = sf != _SOFTMAX and topk > 1

        # 1. All threads: s (the bias into shared memory), saved; flags cleared.
        stage(logits, bias, saved, smem, ism, o_flag, o_bias, wb, nt, eq, stride, tid, nthreads)
        if pre_softmax:
            # softmax over all E first (max and sum by the row's thread), then
            # all threads normalise in place and write saved.
            stats(smem, row, valid, num_experts, o_red + tid, o_red + nthreads + tid)
            normalise(smem, o_red, saved, saved, False, wb, nt, eq, stride, tid, nthreads)

        # 2. Thread per token: selection (flags), then the weights' statistics:
        # post-softmax the max and sum exp(s - max) of the selected scores,
        # normalised the sum of the selected scores + eps.  (Selection reads
        # s + bias; the weights, s itself.)
        if valid:
            total, m = select(smem, row, num_experts, num_groups, group_topk, topk,
                              o_gs + tid * (num_groups | 1), o_bias, flags, 4 * (o_flag + tid * (eq | 1)))
            if norm:
                total = np.float32(total + _EPS)
            smem[_u32(o_red + tid)] = np.float32(_ONE / total)  # phase 3 multiplies
            smem[_u32(o_red + nthreads + tid)] = m
        # Barrier: phase 3 reads every token's flags and statistics.
        cuda.syncthreads()

        # 3. All threads, a quad per step: the quad's four flags are one word,
        # which is also its routing-map word; probs and, for post-softmax,
        # saved (-inf at unselected, the selected-set softmax at selected).
        t, q, dt, dq = _walk32(tid, nthreads, eq)
        while t < nt:
            lq = np.int32(t * eq + q)
            w = wb + lq
            fw = np.uint32(ism[_u32(o_flag + t * (eq | 1) + q)])
            routing_map[_u64(w)] = fw
            w0 = w1 = w2 = w3 = _ZERO
            m0 = m1 = m2 = m3 = False
            if fw == 0:  # most quads: nothing selected, nothing to convert
                zero4(probs, w)
            else:
                inv = smem[_u32(o_red + t)]
                m = smem[_u32(o_red + nthreads + t)]
                base = np.int32(t * stride + 4 * q)
                m0 = fw & _B0 != 0
                m1 = fw & _B1 != 0
                m2 = fw & _B2 != 0
                m3 = fw & _B3 != 0
                w0 = weight(smem[_u32(base)], m, inv, norm) if m0 else _ZERO
                w1 = weight(smem[_u32(base + 1)], m, inv, norm) if m1 else _ZERO
                w2 = weight(smem[_u32(base + 2)], m, inv, norm) if m2 else _ZERO
                w3 = weight(smem[_u32(base + 3)], m, inv, norm) if m3 else _ZERO
                store4(probs, w, np.float32(scale * w0), np.float32(scale * w1),
                       np.float32(scale * w2), np.float32(scale * w3))
            if post_softmax:
                f = 4 * w
                saved[_u64(f)] = w0 if m0 else _NEG_INF
                saved[_u64(f + 1)] = w1 if m1 else _NEG_INF
                saved[_u64(f + 2)] = w2 if m2 else _NEG_INF
                saved[_u64(f + 3)] = w3 if m3 else _NEG_INF
            t, q = _adv32(t, q, dt, dq, eq)

    return kernel


@functools.cache
def aux_scores_fwd_kernel(kind: str, kcap: int, sf: int):
    """The aux-score forward for logits of ``kind``; ``kcap`` >= K; the score
    function a compile-time constant."""
    softmax = sf == _SOFTMAX
    stage = _stager(kind, sf, False)
    select = _selector(kcap, 0, False, False)
    stats, normalise = _row_normaliser(softmax)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind, flat (bf16: [T*E/4] uint64)
        scores,  # [T*E] fp32, out
        routing_map,  # [T*E/4] uint32 over the [T, E] bool map, out
        saved,  # [T*E] fp32, out: softmax p / sigmoid a / raw x (sqrtsoftplus)
        num_tokens,
        num_experts,
        topk,
        tile_tokens,  # TB
        stride,  # P
        o_flag,  # word offsets (_launch.token_layout, no groups)
        o_red,
    ):
        smem = cuda.shared.array(0, nb_f32)
        ism = cuda.shared.array(0, nb_i32)
        flags = cuda.shared.array(0, nb_u8)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = np.int32(min(tile_tokens, num_tokens - t0))
        valid = tid < nt
        row = np.int32(tid * stride)
        eq = np.int32(num_experts // 4)
        wb = t0 * eq

        # 1. All threads: x -> activation (x for softmax) into the tile, saved.
        stage(logits, saved, saved, smem, ism, o_flag, 0, wb, nt, eq, stride, tid, nthreads)
        # 2. Thread per token: softmax max and sum, or sum_all v; then all
        # threads normalise: the scores, in place and to memory.
        stats(smem, row, valid, num_experts, o_red + tid, o_red + nthreads + tid)
        normalise(smem, o_red, scores, saved, softmax, wb, nt, eq, stride, tid, nthreads)
        # 3. Thread per token: plain top-K of the scores, flagged.
        if valid:
            select(smem, row, num_experts, 1, 0, topk, 0, 0, flags, 4 * (o_flag + tid * (eq | 1)))
        cuda.syncthreads()
        # 4. All threads, a quad per step: its flag word is its map word.
        t, q, dt, dq = _walk32(tid, nthreads, eq)
        while t < nt:
            lq = np.int32(t * eq + q)
            routing_map[_u64(wb + lq)] = np.uint32(ism[_u32(o_flag + t * (eq | 1) + q)])
            t, q = _adv32(t, q, dt, dq, eq)

    return kernel
