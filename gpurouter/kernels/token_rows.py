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
shared memory holds the fp32 tile of the tokens' selection scores (row
stride ``P = E | 1``: odd, so the per-thread row scans hit 32 distinct banks),
a selection flag per expert (the four flags of a quad are one word) and
the group scores.

1. All threads, coalesced, four experts (a quad) per step, two quads in
   flight (bf16 logits as one 8-byte load per quad): the score function,
   ``saved``, the bias, the tile; the flag words cleared.
2. Thread t (t < TB), tile row t: (group scores, group ranks,) top-K; the
   weights go into the tile at the selected experts, whose flags are set.
3. All threads, coalesced, a quad per step: the flag word is the quad's
   ``routing_map`` word (one 4-byte store); ``probs`` (bf16: one 8-byte
   store), ``saved`` for post-softmax.

Ranks (CONTRACT section 2): the list holds int32 *keys*, an order-preserving
image of the fp32 scores (NaN as -inf, -0.0 as +0.0) in which an empty slot
ranks below every score, -inf included; the scan visits experts in
ascending order and a candidate displaces only strictly smaller keys, so
among equal scores the lower index wins.

No warp intrinsics: the kernels run on the CUDA simulator too.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .topk import (
    _EPS,
    _NEG_INF,
    _SOFTMAX,
    _ZERO,
    _activation,
    _adv,
    _exp,
    _normalise,
    _row_stats,
    _walk,
    nb_f32,
    nb_i32,
    nb_u8,
    quad_loader,
    quad_storer,
    quad_zeroer,
    stage_put,
)

_KEY_EMPTY = np.int32(-(2**31))  # below the key of every fp32, -inf and NaN included
_KEY_FLIP = np.int32(0x7FFFFFFF)


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
def _inserter(cap: int):
    """Device function ``insert(keys, idx, k, j)``: candidate ``(k, j)`` into the
    register list ``keys[0:cap]`` (descending; ``idx`` its experts), ``j``
    larger than every index already there.

    ``cap`` is a compile-time constant, so the loops unroll and the lists stay
    in registers (every index a constant).  A candidate displaces only
    strictly smaller keys: equal keys keep arrival (ascending expert) order.
    """

    @cuda.jit(device=True)
    def insert(keys, idx, k, j):
        # Branch-free (selects only): a branch would diverge within a warp on
        # nearly every candidate, its 32 threads' lists being independent.
        # Slot q takes slot q-1's entry when k beats that one (the list is
        # descending, so it then beats slot q's too), else k when k beats
        # slot q, else keeps its own.
        for q in range(cap - 1, 0, -1):
            up = k > keys[q - 1]
            here = k > keys[q]
            nk = keys[q - 1] if up else k
            ni = idx[q - 1] if up else j
            keys[q] = nk if here else keys[q]
            idx[q] = ni if here else idx[q]
        here = k > keys[0]
        keys[0] = k if here else keys[0]
        idx[0] = j if here else idx[0]

    return insert


@functools.cache
def _selector(kcap: int, gcap: int):
    """Device function ``select(smem, row, E, G, Kg, per_group, o_gs, keys, idx)``:
    one thread's (group-limited) top-K of its tile row ``smem[row:row+E]``
    into the register lists ``keys``/``idx`` (``kcap`` slots, the top K first).

    Grouped (``Kg > 0``): group ``g``'s score is the sum, in descending order,
    of its top ``per_group`` values (NaN as -inf), kept at ``smem[o_gs + g]``;
    a group is kept when fewer than Kg groups rank before it (larger score,
    NaN as -inf, then lower group); the expert scan visits the kept groups
    only, in ascending order, so dropped groups are never selected, not even
    as fillers.
    """
    insert_k = _inserter(kcap)
    insert_g = _inserter(gcap)

    @cuda.jit(device=True)
    def select(smem, row, num_experts, num_groups, group_topk, per_group, o_gs, keys, idx):
        for q in range(kcap):
            keys[q] = _KEY_EMPTY
            idx[q] = -1
        if group_topk <= 0:
            for j in range(num_experts):
                insert_k(keys, idx, _key(smem[row + j]), j)
            return
        gsize = num_experts // num_groups
        gk = cuda.local.array(gcap, nb_i32)
        gi = cuda.local.array(gcap, nb_i32)
        for g in range(num_groups):
            for q in range(gcap):
                gk[q] = _KEY_EMPTY
                gi[q] = -1
            base = row + g * gsize
            for i in range(gsize):
                insert_g(gk, gi, _key(smem[base + i]), i)
            gs = _value(gk[0])
            for q in range(1, gcap):
                if q < per_group:
                    gs = np.float32(gs + _value(gk[q]))
            smem[o_gs + g] = gs
        kept = 0
        for g in range(num_groups):
            v = smem[o_gs + g]
            if v != v:
                v = _NEG_INF
            rank = 0
            for h in range(num_groups):
                u = smem[o_gs + h]
                if u != u:
                    u = _NEG_INF
                if u > v or (u == v and h < g):
                    rank += 1
            if rank < group_topk:
                kept |= 1 << g
        g = 0
        for _ in range(group_topk):
            while (kept >> g) & 1 == 0:
                g += 1
            base = row + g * gsize
            for i in range(gsize):
                insert_k(keys, idx, _key(smem[base + i]), g * gsize + i)
            g += 1

    return select


# ----------------------------------------------------------------------------
# Staging
# ----------------------------------------------------------------------------


@functools.cache
def _quad_stager(kind: str):
    """Device function staging the forward tile, a quad per step and two quads'
    loads in flight: ``topk.stage_put`` on each element, the quad's flag word
    (``ism[o_flag + t*E/4 + q]``) cleared.  Ends with a barrier."""
    load4, _ = quad_loader(kind)

    @cuda.jit(device=True)
    def put4(x0, x1, x2, x3, t, q, t0, bias, saved, smem, stride, sf, has_bias):
        j = 4 * q
        b0 = b1 = b2 = b3 = _ZERO
        if has_bias:
            b0 = bias[j]
            b1 = bias[j + 1]
            b2 = bias[j + 2]
            b3 = bias[j + 3]
        stage_put(x0, b0, t, j, t0, saved, smem, stride, sf, has_bias)
        stage_put(x1, b1, t, j + 1, t0, saved, smem, stride, sf, has_bias)
        stage_put(x2, b2, t, j + 2, t0, saved, smem, stride, sf, has_bias)
        stage_put(x3, b3, t, j + 3, t0, saved, smem, stride, sf, has_bias)

    @cuda.jit(device=True)
    def stage(lg, bias, saved, smem, ism, o_flag, t0, nt, stride, sf, has_bias, tid, nthreads):
        eq = saved.shape[1] // 4
        t, q, dt, dq = _walk(tid, nthreads, eq)
        while t < nt:
            t1, q1 = _adv(t, q, dt, dq, eq)
            live = t1 < nt
            x0, x1, x2, x3 = load4(lg, t0 + t, q)
            y0 = y1 = y2 = y3 = _ZERO
            if live:
                y0, y1, y2, y3 = load4(lg, t0 + t1, q1)
            put4(x0, x1, x2, x3, t, q, t0, bias, saved, smem, stride, sf, has_bias)
            ism[o_flag + t * eq + q] = 0
            if live:
                put4(y0, y1, y2, y3, t1, q1, t0, bias, saved, smem, stride, sf, has_bias)
                ism[o_flag + t1 * eq + q1] = 0
            t, q = _adv(t1, q1, dt, dq, eq)
        cuda.syncthreads()

    return stage


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@functools.cache
def topk_fwd_kernel(kind: str, kcap: int, gcap: int):
    """The top-k forward for logits of ``kind``; ``kcap`` >= K, ``gcap`` >= K / Kg
    (powers of two: the register lists' sizes)."""
    stage = _quad_stager(kind)
    _, load_at = quad_loader(kind)
    store4 = quad_storer(kind)
    zero4 = quad_zeroer(kind)
    select = _selector(kcap, gcap)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind (bf16: [T, E/4] uint64)
        bias,  # [E] fp32 (any [E] fp32 array when has_bias is False; never read then)
        probs,  # [T, E] kind (bf16: [T, E/4] uint64), out
        routing_map,  # [T, E/4] uint32 over the [T, E] bool map, out
        saved,  # [T, E] fp32, out
        topk,  # K
        sf,  # score-function code
        pre,  # use_pre_softmax (softmax only)
        has_bias,
        num_groups,  # G
        group_topk,  # Kg (grouping on iff > 0)
        scale,  # fp32 scaling_factor
        tile_tokens,  # TB
        stride,  # P
        o_flag,  # word offsets (_launch.token_layout)
        o_gs,
        o_red,
    ):
        num_tokens = saved.shape[0]
        num_experts = saved.shape[1]
        smem = cuda.shared.array(0, nb_f32)  # one dynamic allocation, three views
        ism = cuda.shared.array(0, nb_i32)
        flags = cuda.shared.array(0, nb_u8)
        keys = cuda.local.array(kcap, nb_i32)
        idx = cuda.local.array(kcap, nb_i32)
        sv = cuda.local.array(kcap, nb_f32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)
        valid = tid < nt  # thread t owns tile row t
        row = tid * stride
        eq = num_experts // 4
        post_softmax = sf == _SOFTMAX and not pre

        # 1. All threads: r = s (+ bias) into the tile, saved; flags cleared.
        stage(logits, bias, saved, smem, ism, o_flag, t0, nt, stride, sf, has_bias, tid, nthreads)
        if sf == _SOFTMAX and pre:
            # softmax over all E first (max and sum by the row's thread), then
            # all threads normalise in place and write saved.
            _row_stats(smem, o_red, row, valid, num_experts, tid, 0, 1, nthreads, True)
            _normalise(smem, o_red, saved, saved, False, t0, nt, num_experts, stride, 1, tid,
                       nthreads, True)

        # 2. Thread per token: selection, then the weights from the UNBIASED
        # scores s (recomputed from the logit where the tile holds s + b),
        # written over the tile row at the selected experts, with their flags.
        if valid:
            per_group = topk // group_topk if group_topk > 0 else 1
            select(smem, row, num_experts, num_groups, group_topk, per_group,
                   o_gs + tid * num_groups, keys, idx)
            m = _NEG_INF
            for q in range(kcap):
                s = _ZERO
                if q < topk:
                    if has_bias:
                        s = _activation(load_at(logits, t0 + tid, idx[q]), sf)
                    else:
                        s = smem[row + idx[q]]
                    if s > m:
                        m = s
                sv[q] = s
            total = _ZERO
            if post_softmax:
                for q in range(kcap):
                    if q < topk:
                        total += _exp(sv[q] - m)
            elif sf != _SOFTMAX and topk > 1:
                for q in range(kcap):
                    if q < topk:
                        total += sv[q]
                total = np.float32(total + _EPS)
            for q in range(kcap):
                if q < topk:
                    w = sv[q]
                    if post_softmax:
                        w = np.float32(_exp(w - m) / total)
                    elif sf != _SOFTMAX and topk > 1:
                        w = np.float32(w / total)
                    smem[row + idx[q]] = w
                    flags[4 * o_flag + tid * num_experts + idx[q]] = 1
        # Barrier: phase 3 reads every token's flags and weights.
        cuda.syncthreads()

        # 3. All threads, a quad per step: the quad's four flags are one word,
        # which is also its routing-map word; probs and, for post-softmax,
        # saved (-inf at unselected, the selected-set softmax at selected).
        t, q, dt, dq = _walk(tid, nthreads, eq)
        while t < nt:
            fw = np.uint32(ism[o_flag + t * eq + q])
            routing_map[t0 + t, q] = fw
            w0 = w1 = w2 = w3 = _ZERO
            m0 = m1 = m2 = m3 = False
            if fw == 0:  # most quads: nothing selected, nothing to convert
                zero4(probs, t0 + t, q)
            else:
                base = t * stride + 4 * q
                m0 = fw & np.uint32(0xFF) != 0
                m1 = fw & np.uint32(0xFF00) != 0
                m2 = fw & np.uint32(0xFF0000) != 0
                m3 = fw & np.uint32(0xFF000000) != 0
                w0 = smem[base] if m0 else _ZERO
                w1 = smem[base + 1] if m1 else _ZERO
                w2 = smem[base + 2] if m2 else _ZERO
                w3 = smem[base + 3] if m3 else _ZERO
                store4(probs, t0 + t, q, np.float32(scale * w0) if m0 else _ZERO,
                       np.float32(scale * w1) if m1 else _ZERO,
                       np.float32(scale * w2) if m2 else _ZERO,
                       np.float32(scale * w3) if m3 else _ZERO)
            if post_softmax:
                j = 4 * q
                saved[t0 + t, j] = w0 if m0 else _NEG_INF
                saved[t0 + t, j + 1] = w1 if m1 else _NEG_INF
                saved[t0 + t, j + 2] = w2 if m2 else _NEG_INF
                saved[t0 + t, j + 3] = w3 if m3 else _NEG_INF
            t, q = _adv(t, q, dt, dq, eq)

    return kernel


@functools.cache
def aux_scores_fwd_kernel(kind: str, kcap: int):
    """The aux-score forward for logits of ``kind``; ``kcap`` >= K."""
    stage = _quad_stager(kind)
    select = _selector(kcap, 1)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind (bf16: [T, E/4] uint64)
        scores,  # [T, E] fp32, out
        routing_map,  # [T, E/4] uint32 over the [T, E] bool map, out
        saved,  # [T, E] fp32, out: softmax p / sigmoid a / raw x (sqrtsoftplus)
        topk,
        sf,
        tile_tokens,  # TB
        stride,  # P
        o_flag,  # word offsets (_launch.token_layout, no groups)
        o_red,
    ):
        num_tokens = saved.shape[0]
        num_experts = saved.shape[1]
        smem = cuda.shared.array(0, nb_f32)
        ism = cuda.shared.array(0, nb_i32)
        flags = cuda.shared.array(0, nb_u8)
        keys = cuda.local.array(kcap, nb_i32)
        idx = cuda.local.array(kcap, nb_i32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)
        valid = tid < nt
        row = tid * stride
        eq = num_experts // 4
        softmax = sf == _SOFTMAX

        # 1. All threads: x -> activation (x for softmax) into the tile, saved.
        stage(logits, saved[0], saved, smem, ism, o_flag, t0, nt, stride, sf, False, tid, nthreads)
        # 2. Thread per token: softmax max and sum, or sum_all v; then all
        # threads normalise: the scores, in place and to memory.
        _row_stats(smem, o_red, row, valid, num_experts, tid, 0, 1, nthreads, softmax)
        _normalise(smem, o_red, scores, saved, softmax, t0, nt, num_experts, stride, 1, tid,
                   nthreads, softmax)
        # 3. Thread per token: plain top-K of the scores, flagged.
        if valid:
            select(smem, row, num_experts, 1, 0, 1, 0, keys, idx)
            for q in range(kcap):
                if q < topk:
                    flags[4 * o_flag + tid * num_experts + idx[q]] = 1
        cuda.syncthreads()
        # 4. All threads, a quad per step: its flag word is its map word.
        t, q, dt, dq = _walk(tid, nthreads, eq)
        while t < nt:
            routing_map[t0 + t, q] = np.uint32(ism[o_flag + t * eq + q])
            t, q = _adv(t, q, dt, dq, eq)

    return kernel
