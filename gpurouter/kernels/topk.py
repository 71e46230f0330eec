"""Router top-k with a score function: Numba-CUDA kernels and launchers.

docs/contract.md sections 2 and 3.  Also holds the device functions shared by the
other row kernels (``aux_scores.py``): dtype conversion, score functions, the
staging, row statistics, shared-memory top-K lists and their tree merge.

Decomposition (see docs/kernels.md): a token is owned by W lanes (threads),
a block by ``TB`` consecutive tokens, its shared memory a padded fp32 copy of
their scores ``[TB, P]`` plus a top-K list per lane.

1. All threads, coalesced: load logits (four per thread in flight), convert
   to fp32, apply the score function, write ``saved_scores``; clear the flags.
2. W lanes per token: group scores and ranks, a lane-strided scan into each
   lane's sorted top-K list, a tree merge across the lanes (log2 W barriers);
   the weights, lane q taking the token's entries q, q + W, ...
3. All threads, coalesced: write ``probs`` and ``routing_map`` rows.

No warp intrinsics: shared memory and ``cuda.syncthreads()`` only, so the
same kernels run on the GPU and on the CUDA simulator.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools
import math

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import int32 as nb_i32
from numba import uint8 as nb_u8

from .._checks import check_topk_args
from . import _launch as L
from ._limits import check_limits
from ._plan import In, Out, Plan, Spec, Step, execute, map_spec, spec_of

OP = "topk_with_score_function"

# fp32 constants: numba types bare Python floats as float64, so every literal
# that meets fp32 data is one of these.
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_TWO = np.float32(2.0)
_EPS = np.float32(1e-20)  # TE's epsilon in every normalisation denominator
_SOFTPLUS_THRESHOLD = np.float32(20.0)  # softplus(x) = x above this
_EXP_CLAMP = np.float32(88.0)  # exp() argument cap: see _exp
_NEG_INF = np.float32(-np.inf)

_SIGMOID, _SOFTMAX, _SQRTSOFTPLUS = L.SIGMOID, L.SOFTMAX, L.SQRTSOFTPLUS


# ----------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------


if L.simulator_enabled():

    @cuda.jit(device=True)
    def _exp(a):
        """fp32 ``exp(a)`` (the simulator's: Python doubles, the argument capped at
        88 so that ``math.exp`` never raises OverflowError; the cap only matters
        where expf overflows to inf anyway)."""
        if a > _EXP_CLAMP:
            a = _EXP_CLAMP
        return np.float32(math.exp(a))

    @cuda.jit(device=True)
    def _rcp(a):
        return np.float32(_ONE / a)

    @cuda.jit(device=True)
    def _fmax(a, b):
        return max(a, b)

    @cuda.jit(device=True)
    def _fmin(a, b):
        return min(a, b)

    @cuda.jit(device=True)
    def _no_nan(a):
        return _NEG_INF if a != a else a

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _exp(a):
        """fp32 ``exp(a)`` as ``ex2.approx(a * log2 e)``: two instructions instead of
        libdevice's accurate ten (relative error ~2e-7, ~2e-6 at |a| = 20,
        inside docs/contract.md section 7's 1e-5; the stage's sigmoid was a third of
        the thread-per-token forward's instructions).  exp(+-inf) = inf, 0;
        NaN stays NaN."""
        return libdevice.fast_expf(a)

    @cuda.jit(device=True)
    def _rcp(a):
        """fp32 ``1 / a`` by ``rcp.approx`` (within 1 ulp; 0 for a = inf) instead of
        the IEEE division's range checks and slow-path call."""
        return libdevice.fast_fdividef(_ONE, a)

    @cuda.jit(device=True)
    def _fmax(a, b):
        """fp32 max, one instruction (numba's ``max`` is a compare and a select).
        Callers pass no NaN (fmaxf would drop it; Python's max keeps ``a``)."""
        return libdevice.fmaxf(a, b)

    @cuda.jit(device=True)
    def _fmin(a, b):
        return libdevice.fminf(a, b)

    @cuda.jit(device=True)
    def _no_nan(a):
        """``a``, NaN as -inf: one fmaxf (the max of NaN and -inf is -inf)."""
        return libdevice.fmaxf(a, _NEG_INF)


@cuda.jit(device=True)
def _sigmoid(x):
    return _rcp(np.float32(_ONE + _exp(-x)))


@cuda.jit(device=True)
def _sqrtsoftplus(x):
    """``sqrt(softplus(x))``, softplus taking ``x`` itself above 20 (PyTorch's threshold)."""
    if x > _SOFTPLUS_THRESHOLD:
        return np.float32(math.sqrt(x))
    return np.float32(math.sqrt(np.float32(math.log1p(_exp(x)))))


@cuda.jit(device=True)
def _activation(x, sf):
    """sigmoid or sqrtsoftplus of an fp32 logit (``sf`` is the score-function code)."""
    if sf == _SIGMOID:
        return _sigmoid(x)
    return _sqrtsoftplus(x)


@cuda.jit(device=True)
def _activation_grad(x, a, sf):
    """d activation / dx given the logit ``x`` and the activation ``a``.

    sigmoid: ``a (1 - a)``; sqrtsoftplus: ``sigmoid(x) / (2 v + eps)`` for
    ``x <= 20`` and ``1 / (2 v + eps)`` above.
    """
    if sf == _SIGMOID:
        return np.float32(a * (_ONE - a))
    num = _ONE if x > _SOFTPLUS_THRESHOLD else _sigmoid(x)
    return np.float32(num / (_TWO * a + _EPS))


@functools.cache
def loader(kind: str):
    """Device function ``load(a, i, j) -> fp32`` for a 2-D array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def load(a, i, j):
            # bf16 is the top half of an fp32: shift the word up, reinterpret.
            return np.uint32(np.uint32(a[i, j]) << np.uint32(16)).view(np.float32)

    else:

        @cuda.jit(device=True)
        def load(a, i, j):
            return np.float32(a[i, j])

    return load


@functools.cache
def loader1(kind: str):
    """Device function ``load(a, i) -> fp32`` for a 1-D array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def load(a, i):
            return np.uint32(np.uint32(a[i]) << np.uint32(16)).view(np.float32)

    else:

        @cuda.jit(device=True)
        def load(a, i):
            return np.float32(a[i])

    return load


@cuda.jit(device=True)
def _bf16_bits(v):
    """fp32 -> bf16 word, round to nearest even, like ml_dtypes' astype.

    NaN becomes the canonical quiet NaN with v's sign (0x7FC0 / 0xFFC0), as
    ml_dtypes (Eigen) does.
    """
    bits = np.float32(v).view(np.uint32)
    if v != v:
        sign = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(0x8000))
        return np.uint16(sign | np.uint32(0x7FC0))
    lsb = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(np.uint32(np.uint32(bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)))


@functools.cache
def storer(kind: str):
    """Device function ``store(a, i, j, v)`` writing fp32 ``v`` into a 2-D array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = _bf16_bits(v)

    elif kind == L.F16:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = np.float16(v)  # cvt.rn.f16.f32: round to nearest even

    else:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = v

    return store


@functools.cache
def storer1(kind: str):
    """Device function ``store(a, i, v)`` for a 1-D array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = _bf16_bits(v)

    elif kind == L.F16:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = np.float16(v)

    else:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = v

    return store


_U16 = np.uint32(16)
_HIGH = np.uint32(0xFFFF0000)


@cuda.jit(device=True)
def bf16_quad(v0, v1, v2, v3):
    """Four fp32 values as the uint64 of their bf16 words (``v0`` lowest)."""
    lo = np.uint32(_bf16_bits(v0)) | np.uint32(np.uint32(_bf16_bits(v1)) << _U16)
    hi = np.uint32(_bf16_bits(v2)) | np.uint32(np.uint32(_bf16_bits(v3)) << _U16)
    return np.uint64(lo) | np.uint64(np.uint64(hi) << np.uint64(32))


# Global-memory indices go through _u64: numba wraps signed indices (``i < 0``:
# ``i + n``), a few 64-bit instructions per access; unsigned ones it takes as
# they are.  (Shared-memory indices: np.uint32 likewise.)
_u64 = np.uint64


@functools.cache
def flat_io(kind: str):
    """Device functions on a row-major ``[T, E]`` array of ``kind`` seen flat
    (E a multiple of 4; ``array_views``), quad ``w`` = experts ``4(w % (E/4))
    .. +3`` of row ``w // (E/4)``, element ``f`` = ``4w + i``:

    ``load4(a, w) -> 4 x fp32``,
    ``store4(a, w, v0, v1, v2, v3)`` (fp32 values) and ``zero4(a, w)``.
    bf16: ``a`` is the array's uint64 words, a quad per load or store; fp32:
    one 16-byte access per quad (``_vec.quad_f32``); fp16: the elements.
    """
    if kind == L.BF16:

        @cuda.jit(device=True)
        def load4(a, w):
            x = a[_u64(w)]
            lo = np.uint32(x)
            hi = np.uint32(x >> np.uint64(32))
            return (np.uint32(lo << _U16).view(np.float32), np.uint32(lo & _HIGH).view(np.float32),
                    np.uint32(hi << _U16).view(np.float32), np.uint32(hi & _HIGH).view(np.float32))

        @cuda.jit(device=True)
        def store4(a, w, v0, v1, v2, v3):
            a[_u64(w)] = bf16_quad(v0, v1, v2, v3)

        @cuda.jit(device=True)
        def zero4(a, w):
            a[_u64(w)] = np.uint64(0)

    elif kind == L.F32:
        from ._vec import quad_f32

        load4, store4 = quad_f32()  # one 16-byte access per quad

        @cuda.jit(device=True)
        def zero4(a, w):
            store4(a, w, _ZERO, _ZERO, _ZERO, _ZERO)

    else:

        @cuda.jit(device=True)
        def load4(a, w):
            f = 4 * w
            return (np.float32(a[_u64(f)]), np.float32(a[_u64(f + 1)]),
                    np.float32(a[_u64(f + 2)]), np.float32(a[_u64(f + 3)]))

        @cuda.jit(device=True)
        def store4(a, w, v0, v1, v2, v3):
            f = 4 * w
            a[_u64(f)] = np.float16(v0)  # cvt.rn: round to nearest even
            a[_u64(f + 1)] = np.float16(v1)
            a[_u64(f + 2)] = np.float16(v2)
            a[_u64(f + 3)] = np.float16(v3)

        @cuda.jit(device=True)
        def zero4(a, w):
            store4(a, w, _ZERO, _ZERO, _ZERO, _ZERO)

    return load4, store4, zero4


def array_views(kind: str, shape):
    """``(view of a [T, E] array of kind, view of a [T, E] bool map, view of a
    [T, E] fp32 array)``: the flat Specs the quad kernels take (E a multiple
    of 4): bf16 as uint64 quads, other kinds as elements, the map as uint32
    quads (the four bools of a quad: one word)."""
    t, e = shape
    n = t * e
    words = Spec((n // 4,), np.uint64) if kind == L.BF16 else Spec((n,), L.DEVICE_DTYPE[kind])
    return words, Spec((n // 4,), np.uint32), Spec((n,), np.float32)


def topk_capacity(topk: int) -> int:
    """Compile-time size of the per-thread top-K list: 8, 16, 32 or 64."""
    cap = 8
    while cap < topk:
        cap *= 2
    return cap


# ----------------------------------------------------------------------------
# Row-kernel phases (shared by the top-k and aux-score kernels)
# ----------------------------------------------------------------------------


@cuda.jit(device=True)
def _before(u, k, v, j):
    """True when entry ``(u, k)`` ranks before ``(v, j)``: larger value, then lower index."""
    return u > v or (u == v and k < j)


@cuda.jit(device=True)
def _push(lv, li, d, base, n, cap, v, j):
    """Inserts candidate ``(v, j)`` into the shared list ``lv[base:base+n]`` (indices
    at ``li[base+d:]``), kept sorted by (value desc, index asc); returns the new length.

    The rank is the contract's total order (among equal values the lower
    index wins), whatever order the candidates arrive in.  NaN counts as
    -inf; -0.0 == +0.0 already under IEEE comparison.  Empty slots take any
    candidate, -inf included, so a list always holds ``min(cap, candidates)``
    distinct entries (the lowest-index ones fill what finite values cannot).
    """
    if v != v:
        v = _NEG_INF
    if n < cap:
        pos = n
        n += 1
    else:
        pos = cap - 1
        if not _before(v, j, lv[base + pos], li[base + d + pos]):
            return n
    while pos > 0:
        u = lv[base + pos - 1]
        if _before(u, li[base + d + pos - 1], v, j):
            break
        lv[base + pos] = u
        li[base + d + pos] = li[base + d + pos - 1]
        pos -= 1
    lv[base + pos] = v
    li[base + d + pos] = j
    return n


@cuda.jit(device=True)
def _merge(lv, li, d, a, na, b, nb, cap, tv, ti):
    """Top ``min(cap, na + nb)`` of two sorted shared lists, into list ``a``; returns its length.

    Both lists are sorted by (value desc, index asc) with NaN already -inf
    and hold distinct indices, so the merge under that total order is exact
    whatever the pairing of lists: the result is the top of the union.
    ``tv``/``ti``: per-thread scratch (``cuda.local.array``) of >= cap slots.
    """
    m = min(cap, na + nb)
    i = 0
    k = 0
    for q in range(m):
        take_a = k >= nb
        if i < na and not take_a:
            va = lv[a + i]
            vb = lv[b + k]
            take_a = _before(va, li[a + d + i], vb, li[b + d + k])
        if take_a:
            tv[q] = lv[a + i]
            ti[q] = li[a + d + i]
            i += 1
        else:
            tv[q] = lv[b + k]
            ti[q] = li[b + d + k]
            k += 1
    for q in range(m):
        lv[a + q] = tv[q]
        li[a + d + q] = ti[q]
    return m


@cuda.jit(device=True)
def _tree_merge(lv, li, d, o_list, o_cnt, lstride, tid, lane, levels, cap, tv, ti):
    """Merges the lists of aligned runs of ``2**levels`` lanes into the run's first lane.

    All threads of the block call it (``levels`` block-uniform): level ``h``
    has lane ``l`` (``l % 2**(h+1) == 0``) merge lane ``l + 2**h``'s list
    into its own; a barrier before each level and one at the end.
    """
    span = 1
    for _ in range(levels):
        cuda.syncthreads()
        if lane % (2 * span) == 0:
            a = o_list + tid * lstride
            li[o_cnt + tid] = _merge(lv, li, d, a, li[o_cnt + tid], a + span * lstride,
                                     li[o_cnt + tid + span], cap, tv, ti)
        span *= 2
    cuda.syncthreads()


@cuda.jit(device=True)
def _log2(w):
    levels = 0
    while (1 << levels) < w:
        levels += 1
    return levels


@cuda.jit(device=True)
def _tree_reduce(red, oa, ob, tid, lane, lanes, a_is_max):
    """Combines the token's lane partials ``red[oa + tid]`` (max or sum) and, when
    ``ob >= 0``, ``red[ob + tid]`` (sum) into the token's lane 0, in a fixed
    pairing (deterministic).  All threads call it; barrier before each level
    and at the end.  The max ignores NaN (``b > a`` is false), like the serial
    ``if v > m`` scans.
    """
    span = 1
    while span < lanes:  # lanes: a power of two, so lane % (2 span) is lane & (2 span - 1)
        cuda.syncthreads()
        if lane & (2 * span - 1) == 0:
            x = red[oa + tid + span]
            if a_is_max:
                if x > red[oa + tid]:
                    red[oa + tid] = x
            else:
                red[oa + tid] = np.float32(red[oa + tid] + x)
            if ob >= 0:
                red[ob + tid] = np.float32(red[ob + tid] + red[ob + tid + span])
        span *= 2
    cuda.syncthreads()


@cuda.jit(device=True)
def _walk(tid, nthreads, num_experts):
    """Start ``(t, j)`` and step ``(dt, dj)`` of the flat, coalesced tile loop:
    thread ``tid`` takes tile elements ``tid, tid + nthreads, ...`` (element
    ``e`` = token ``e // E``, expert ``e % E``) without a division per step."""
    t = tid // num_experts
    dt = nthreads // num_experts
    return t, tid - t * num_experts, dt, nthreads - dt * num_experts


@cuda.jit(device=True)
def _row_stats(smem, o_red, row, valid, num_experts, tid, lane, lanes, nthreads, softmax):
    """Per-token statistics of the tile rows, W lanes per token.

    softmax: row max (NaN ignored) then ``sum exp(x - max)``; else ``sum v``.
    Lane ``l`` takes experts ``l, l + W, ...`` in ascending order, then
    ``_tree_reduce`` combines the lanes.  Afterwards (all threads past the
    final barrier) token ``t``'s max is at ``smem[o_red + t*W]`` and its sum
    at ``smem[o_red + nthreads + t*W]``.
    """
    oa = o_red
    ob = o_red + nthreads
    m = _NEG_INF
    if softmax:
        if valid:
            for j in range(lane, num_experts, lanes):
                v = smem[row + j]
                if v > m:  # NaN never wins; it still makes the sum NaN below
                    m = v
        smem[oa + tid] = m
        _tree_reduce(smem, oa, -1, tid, lane, lanes, True)
        m = smem[oa + tid - lane]
    total = _ZERO
    if valid:
        for j in range(lane, num_experts, lanes):
            v = smem[row + j]
            if softmax:
                v = _exp(v - m)
            total += v
    smem[ob + tid] = total
    _tree_reduce(smem, ob, -1, tid, lane, lanes, False)


@cuda.jit(device=True)
def _normalise(smem, o_red, out1, out2, write2, t0, nt, num_experts, stride, lanes, tid,
               nthreads, softmax):
    """All threads, coalesced: the tile's rows divided by their statistics
    (``exp(x - max) / sum`` like jax.nn.softmax, an all -inf row giving NaN;
    or ``v / (sum + 1e-20)``), in place, to ``out1`` and (``write2``) ``out2``.
    Ends with a barrier."""
    t, j, dt, dj = _walk(tid, nthreads, num_experts)
    while t < nt:
        lead = o_red + t * lanes
        idx = t * stride + j
        if softmax:
            p = np.float32(_exp(smem[idx] - smem[lead]) / smem[lead + nthreads])
        else:
            p = np.float32(smem[idx] / np.float32(smem[lead + nthreads] + _EPS))
        smem[idx] = p
        out1[t0 + t, j] = p
        if write2:
            out2[t0 + t, j] = p
        t, j = _adv(t, j, dt, dj, num_experts)
    cuda.syncthreads()


@cuda.jit(device=True)
def _select(smem, ism, row, tok, valid, lane, tid, lanes, num_experts, topk, grouped,
            num_groups, group_topk, group_lanes, o_list, o_idx, o_cnt, o_grp, o_keep, lstride,
            tv, ti):
    """(Group-limited) top-K of the tile row ``row`` (selection scores), W lanes per token.

    All threads call it (every barrier is block-wide).  Afterwards the
    token's lane 0 list (``smem[o_list + (tid - lane)*lstride + q]``, indices
    at ``ism[o_idx + ...]``) holds its K experts, in (value desc, index asc)
    order.

    Groups: each group's score is the sum (in descending order) of its top
    ``K / Kg`` values, found by ``group_lanes`` lanes (a lane-strided scan
    plus a tree merge) or, when G does not divide W, by one lane per group
    (scans start at a group-dependent offset: no bank conflicts);
    each lane then ranks its groups against all G (NaN as -inf, ties to the
    lower group) and keeps those of rank < Kg.  Experts: lane ``l`` scans
    ``l, l + W, ...`` over kept groups into a local top-K, and a tree merge
    across the W lanes leaves the token's top-K in lane 0.
    """
    d = o_idx - o_list
    base = o_list + tid * lstride
    gsize = num_experts
    gbase = o_grp + tok * num_groups
    kbase = o_keep + tok * num_groups
    if grouped:
        gsize = num_experts // num_groups
        per_group = topk // group_topk
        if group_lanes > 1:
            g = lane // group_lanes
            sub = lane - g * group_lanes
            n = 0
            if valid:
                # this lane's experts g*gsize + sub + i*group_lanes, i < cnt, from
                # i = g % cnt on (rotated: lanes of different groups hit
                # different banks when gsize is a multiple of 32; _push ranks
                # in any arrival order)
                lo = g * gsize + sub
                cnt = (gsize - sub + group_lanes - 1) // group_lanes
                i = g % cnt if cnt > 0 else 0
                for _ in range(cnt):
                    j = lo + i * group_lanes
                    n = _push(smem, ism, d, base, n, per_group, smem[row + j], j)
                    i += 1
                    if i == cnt:
                        i = 0
            ism[o_cnt + tid] = n
            _tree_merge(smem, ism, d, o_list, o_cnt, lstride, tid, lane, _log2(group_lanes),
                        per_group, tv, ti)
            if valid and sub == 0:
                gs = smem[base]
                for q in range(1, per_group):
                    gs = np.float32(gs + smem[base + q])
                smem[gbase + g] = gs
        elif valid:
            for g in range(lane, num_groups, lanes):
                n = 0
                i = g % gsize  # rotated start, as above
                for _ in range(gsize):
                    n = _push(smem, ism, d, base, n, per_group, smem[row + g * gsize + i],
                              g * gsize + i)
                    i += 1
                    if i == gsize:
                        i = 0
                gs = smem[base]
                for q in range(1, per_group):
                    gs = np.float32(gs + smem[base + q])
                smem[gbase + g] = gs
        # Barrier: the ranking reads every group score of the token.
        cuda.syncthreads()
        if valid:
            for g in range(lane, num_groups, lanes):
                v = smem[gbase + g]
                if v != v:
                    v = _NEG_INF
                rank = 0
                for h in range(num_groups):
                    u = smem[gbase + h]
                    if u != u:
                        u = _NEG_INF
                    if u > v or (u == v and h < g):
                        rank += 1
                ism[kbase + g] = 1 if rank < group_topk else 0
        # Barrier: the expert scan reads the kept flags of every group.
        cuda.syncthreads()
    n = 0
    if valid:
        g = 0
        bound = gsize
        kept = True
        if grouped:
            kept = ism[kbase] != 0
        j = lane
        while j < num_experts:
            while j >= bound:
                g += 1
                bound += gsize
                kept = ism[kbase + g] != 0
            if kept:  # dropped groups are never selected, not even as fillers
                n = _push(smem, ism, d, base, n, topk, smem[row + j], j)
            j += lanes
    ism[o_cnt + tid] = n
    _tree_merge(smem, ism, d, o_list, o_cnt, lstride, tid, lane, _log2(lanes), topk, tv, ti)


@cuda.jit(device=True)
def _adv(t, j, dt, dj, num_experts):
    """The next ``(t, j)`` of the flat tile loop (see ``_walk``)."""
    t += dt
    j += dj
    if j >= num_experts:
        j -= num_experts
        t += 1
    return t, j


@cuda.jit(device=True)
def stage_put(x, b, t, j, t0, saved, smem, stride, sf, has_bias):
    """One element of the forward staging: score function, saved, bias, into the tile."""
    s = x
    if sf != _SOFTMAX:
        s = _activation(x, sf)
        saved[t0 + t, j] = s if sf == _SIGMOID else x
        if has_bias:
            s = np.float32(s + b)
    smem[t * stride + j] = s


@cuda.jit(device=True)
def _stage_put(x, b, t, j, t0, saved, smem, flags, o_flag, stride, sf, has_bias):
    """``stage_put`` and the element's selection flag cleared."""
    stage_put(x, b, t, j, t0, saved, smem, stride, sf, has_bias)
    flags[o_flag + t * stride + j] = 0


@functools.cache
def _stager(kind: str):
    """Device function staging the forward tile (shared by top-k fwd and aux scores fwd).

    All threads, coalesced (consecutive threads take consecutive experts):
    load the logits, convert to fp32, apply the score function, write
    ``saved`` (sigmoid: ``a``; sqrtsoftplus: the raw ``x``, TE's convention;
    softmax: nothing yet), add the expert bias (selection only), store into
    the tile, clear the flags.  Four elements per step, their loads issued
    before any is used (four loads in flight per thread: one would leave the
    loop latency-bound at a fraction of the memory bandwidth).  Ends with a
    barrier.
    """
    load = loader(kind)

    @cuda.jit(device=True)
    def stage(logits, bias, saved, smem, flags, o_flag, t0, nt, stride, sf, has_bias, tid,
              nthreads):
        num_experts = logits.shape[1]
        t, j, dt, dj = _walk(tid, nthreads, num_experts)
        while t < nt:
            t1, j1 = _adv(t, j, dt, dj, num_experts)
            t2, j2 = _adv(t1, j1, dt, dj, num_experts)
            t3, j3 = _adv(t2, j2, dt, dj, num_experts)
            x0 = load(logits, t0 + t, j)
            x1 = load(logits, t0 + t1, j1) if t1 < nt else _ZERO
            x2 = load(logits, t0 + t2, j2) if t2 < nt else _ZERO
            x3 = load(logits, t0 + t3, j3) if t3 < nt else _ZERO
            b0 = _ZERO
            b1 = _ZERO
            b2 = _ZERO
            b3 = _ZERO
            if has_bias:
                b0 = bias[j]
                b1 = bias[j1]
                b2 = bias[j2]
                b3 = bias[j3]
            _stage_put(x0, b0, t, j, t0, saved, smem, flags, o_flag, stride, sf, has_bias)
            if t1 < nt:
                _stage_put(x1, b1, t1, j1, t0, saved, smem, flags, o_flag, stride, sf, has_bias)
            if t2 < nt:
                _stage_put(x2, b2, t2, j2, t0, saved, smem, flags, o_flag, stride, sf, has_bias)
            if t3 < nt:
                _stage_put(x3, b3, t3, j3, t0, saved, smem, flags, o_flag, stride, sf, has_bias)
            t, j = _adv(t3, j3, dt, dj, num_experts)
        cuda.syncthreads()

    return stage


@cuda.jit(device=True)
def _pack_flags(flags, o_flag, routing_map, t0, nt, num_experts, stride, tid, nthreads):
    """All threads: the BITMAP_U8 routing map ``[T, ceil(E/8)]`` of the tile from
    its shared selection flags, a map byte per step, assembled by one thread
    from the octet's eight flags (bit ``i``: expert ``8b + i``; the last
    byte's padding bits 0) and stored whole (no other thread writes it)."""
    nbytes = (num_experts + 7) >> 3
    t, b, dt, db = _walk(tid, nthreads, nbytes)
    while t < nt:
        base = o_flag + t * stride + 8 * b
        n = min(8, num_experts - 8 * b)
        v = np.uint32(0)
        if n == 8:  # every byte but maybe the last: unrolled
            for i in range(8):
                v |= np.uint32(np.uint32(flags[base + i] != 0) << np.uint32(i))
        else:
            for i in range(n):
                v |= np.uint32(np.uint32(flags[base + i] != 0) << np.uint32(i))
        routing_map[t0 + t, b] = np.uint8(v)
        t, b = _adv(t, b, dt, db, nbytes)


# ----------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------


@functools.cache
def _topk_fwd_kernel(kind: str, kcap: int, bitmap: bool = False, indices: bool = False,
                     forced: bool = False):
    """The forward kernel for logits of ``kind``; ``kcap`` >= K sizes the merge
    scratch; ``bitmap`` (compile-time): the routing map is BITMAP_U8
    (``_pack_flags``), else the bool map.  ``indices`` (compile-time): lane-0's
    list, which is the selection order, goes to ``xarr`` (``[T, K]`` int32);
    ``forced`` (the routing replay; no bias, no groups): no selection, the
    list is ``xarr``'s row in its order (outside [0, E): skipped; a repeat:
    once), so the weights' sums run in the order a normal call that
    returned these indices used.  Otherwise ``xarr`` is never read."""
    load = loader(kind)
    store = storer(kind)
    stage = _stager(kind)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind
        bias,  # [E] fp32 (any [E] fp32 array when has_bias is False; never read then)
        probs,  # [T, E] kind, out
        routing_map,  # [T, E] bool (bitmap: [T, ceil(E/8)] uint8), out
        saved,  # [T, E] fp32, out
        topk,  # K
        sf,  # score-function code
        pre,  # use_pre_softmax (softmax only)
        has_bias,
        num_groups,  # G (grouping on iff group_topk > 0)
        group_topk,  # Kg
        scale,  # fp32 scaling_factor
        tile_tokens,  # TB, tokens per block
        lanes,  # W, threads per token (power of two)
        stride,  # P, tile row stride (words)
        lstride,  # LS, per-lane list stride (words)
        group_lanes,  # lanes per group in the group-score pass
        o_list,  # word offsets of the layout (_launch.select_layout)
        o_idx,
        o_cnt,
        o_grp,
        o_keep,
        o_flag,  # byte offset of the flags
        xarr,  # [T, K] int32: indices out (``indices``), forced in (``forced``); else unused
    ):
        num_tokens = logits.shape[0]
        num_experts = logits.shape[1]
        smem = cuda.shared.array(0, nb_f32)  # one dynamic allocation, three views
        ism = cuda.shared.array(0, nb_i32)
        flags = cuda.shared.array(0, nb_u8)
        tv = cuda.local.array(kcap, nb_f32)
        ti = cuda.local.array(kcap, nb_i32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)  # tokens of this (maybe partial) tile
        tok = tid // lanes  # this thread's token in the tile, lane within the token
        lane = tid - tok * lanes
        valid = tok < nt
        row = tok * stride
        post_softmax = sf == _SOFTMAX and not pre

        # Phase 1 (all threads, coalesced): r = s (+ bias) into the tile.
        stage(logits, bias, saved, smem, flags, o_flag, t0, nt, stride, sf, has_bias, tid,
              nthreads)
        if sf == _SOFTMAX and pre:
            # softmax over all E first: lane partials of max and sum, then
            # all threads normalise in place and write saved.
            _row_stats(smem, o_list, row, valid, num_experts, tid, lane, lanes, nthreads, True)
            _normalise(smem, o_list, saved, saved, False, t0, nt, num_experts, stride, lanes,
                       tid, nthreads, True)

        # Phase 2 (W lanes per token): selection into the token's lane-0 list.
        lead = o_list + (tid - lane) * lstride
        d = o_idx - o_list
        cnt = topk
        if forced:
            # the replay: lane 0 lists the token's forced experts, in order
            if valid and lane == 0:
                n = 0
                for a in range(topk):
                    j = xarr[t0 + tok, a]
                    ok = j >= 0 and j < num_experts
                    if ok:
                        for b in range(n):
                            if ism[lead + d + b] == j:
                                ok = False
                    if ok:
                        ism[lead + d + n] = j
                        n += 1
                ism[o_cnt + tid] = n
            cuda.syncthreads()
            if valid:
                cnt = ism[o_cnt + tid - lane]
        else:
            _select(smem, ism, row, tok, valid, lane, tid, lanes, num_experts, topk,
                    group_topk > 0, num_groups, group_topk, group_lanes, o_list, o_idx, o_cnt,
                    o_grp, o_keep, lstride, tv, ti)

        # Weights, gathered from the UNBIASED scores s (no (s + b) - b): lane
        # q takes list entries q, q + W, ...; first replace each list value by
        # s (the tile holds r = s + b with a bias: recompute s from the logit),
        if valid:
            for q in range(lane, cnt, lanes):
                j = ism[lead + d + q]
                if indices:
                    xarr[t0 + tok, q] = j
                if has_bias:
                    s = _activation(load(logits, t0 + tok, j), sf)
                else:
                    s = smem[row + j]
                smem[lead + q] = s
        # Barrier: every lane reads the token's K scores.
        cuda.syncthreads()
        # then every lane computes the token's normaliser from the K values
        # (the same fixed order in every lane) and writes its weights into
        # the tile row (read no more) with the flags.
        if valid:
            m = _NEG_INF
            total = _ZERO
            if post_softmax:
                for q in range(cnt):
                    if smem[lead + q] > m:
                        m = smem[lead + q]
                for q in range(cnt):
                    total += _exp(smem[lead + q] - m)
            elif sf != _SOFTMAX and topk > 1:
                for q in range(cnt):
                    total += smem[lead + q]
                total = np.float32(total + _EPS)
            for q in range(lane, cnt, lanes):
                w = smem[lead + q]
                if post_softmax:
                    w = np.float32(_exp(w - m) / total)
                elif sf != _SOFTMAX and topk > 1:
                    w = np.float32(w / total)
                j = ism[lead + d + q]
                smem[row + j] = w
                flags[o_flag + row + j] = 1
        # Barrier: phase 3 reads flags and weights of every token.
        cuda.syncthreads()

        # Phase 3 (all threads, coalesced): probs, routing_map, and saved for
        # post-softmax (-inf at unselected, the selected-set softmax at selected).
        t, j, dt, dj = _walk(tid, nthreads, num_experts)
        while t < nt:
            off = t * stride + j
            sel = flags[o_flag + off] != 0
            w = smem[off]
            if not bitmap:
                routing_map[t0 + t, j] = sel
            if sel:
                store(probs, t0 + t, j, np.float32(scale * w))
            else:
                store(probs, t0 + t, j, _ZERO)
            if post_softmax:
                saved[t0 + t, j] = w if sel else _NEG_INF
            t, j = _adv(t, j, dt, dj, num_experts)
        if bitmap:
            _pack_flags(flags, o_flag, routing_map, t0, nt, num_experts, stride, tid, nthreads)

    return kernel


# ----------------------------------------------------------------------------
# Backward kernel
#
# VJP (docs/contract.md section 3), m the routing mask, g = grad_probs * scaling_factor:
# - sigmoid/sqrtsoftplus, K > 1: probs_i = a_i / (S + eps), S = sum_m a, so
#   d/da_e = m_e (g_e / (S + eps) - D / (S + eps)^2) with D = sum_m g a;
#   then dx = that * da/dx.  K == 1: dx = m g da/dx.
# - softmax post: t = softmax over I of x, so dx = m q (g - sum_m g q).
# - softmax pre: probs = m p with p = softmax over E, so dx = p (m g - sum m g p).
# Per token: the sums (W lanes, tree-combined), then elementwise.
# ----------------------------------------------------------------------------


@functools.cache
def _pair_loader(kind: str):
    """Device function ``pair(saved, grad, token, j, needed)``: ``(saved[token, j],
    grad[token, j])`` as fp32 (``grad`` of ``kind``) where ``needed``, else zeros
    (no load: unselected experts' saved scores and gradients are never read)."""
    load = loader(kind)

    @cuda.jit(device=True)
    def pair(saved, grad, token, j, needed):
        if needed:
            return saved[token, j], load(grad, token, j)
        return _ZERO, _ZERO

    return pair


@cuda.jit(device=True)
def _accumulate(total, dot, x, g, scale, sf):
    """``(S + a, D + (g * scale) * a)`` for a selected expert (``a`` from saved ``x``)."""
    a = _sqrtsoftplus(x) if sf == _SQRTSOFTPLUS else x
    return np.float32(total + a), np.float32(dot + np.float32(np.float32(g * scale) * a))


@cuda.jit(device=True)
def _topk_dx(x, g, sel, dense, den, dsum, scale, topk, sf):
    """d logit of one element (docs/contract.md section 3), from saved ``x`` and the raw
    gradient ``g`` (scaled here); 0 for unselected experts unless ``dense``
    (softmax-pre, where every p contributes)."""
    if not (sel or dense):
        return _ZERO
    a = _sqrtsoftplus(x) if sf == _SQRTSOFTPLUS else x
    gs = np.float32(g * scale) if sel else _ZERO
    if sf == _SOFTMAX:
        return np.float32(a * (gs - dsum))
    gp = gs
    if topk > 1:
        gp = np.float32(gs / den - dsum / np.float32(den * den))
    return np.float32(gp * _activation_grad(x, a, sf))


@functools.cache
def _mask_reader(has_map: bool, bitmap: bool = False):
    """Device function ``mask(routing_map, token, j, inside)``: the routing map
    at ``[token, j]`` (False past the row's end; ``bitmap``: a BITMAP_U8
    ``[T, ceil(E/8)]`` map, bit ``j % 8`` of byte ``j // 8``), or, without a
    map (the aux-score backward: every expert counts), ``inside``."""
    if has_map and bitmap:

        @cuda.jit(device=True)
        def mask(routing_map, token, j, inside):
            if not inside:
                return False
            return (np.uint32(routing_map[token, j >> 3]) >> np.uint32(j & 7)) & np.uint32(1) != 0

    elif has_map:

        @cuda.jit(device=True)
        def mask(routing_map, token, j, inside):
            return routing_map[token, j] if inside else False

    else:

        @cuda.jit(device=True)
        def mask(routing_map, token, j, inside):
            return inside

    return mask


@functools.cache
def _topk_bwd_kernel(kind: str, bitmap: bool = False):
    """The top-k backward: ``_stream_bwd_kernel`` with the routing map (``bitmap``: BITMAP_U8)."""
    return _stream_bwd_kernel(kind, kind, True, bitmap)


@functools.cache
def _stream_bwd_kernel(grad_kind: str, out_kind: str, has_map: bool, bitmap: bool = False):
    """The backwards (top-k; aux scores: no map, every expert selected, scale 1,
    the K > 1 normalisation), streaming: W lanes per token read its row from
    global memory twice, with no shared-memory tile (occupancy is not limited
    by shared memory, and every thread runs few instructions per element),
    four experts per lane per step with their loads issued together.

    Pass 1 sums S and D over the token's selected experts only (its lanes'
    partials, combined by ``_tree_reduce`` in a fixed order). Pass 2 writes
    every element: 0 where the map is unset, except for softmax-pre, where
    ``p (m g - D)`` needs every p. The second read of the row mostly hits L1.
    """
    pair = _pair_loader(grad_kind)
    store = storer(out_kind)
    mask = _mask_reader(has_map, bitmap)

    @cuda.jit
    def kernel(
        routing_map,  # [T, E] bool; bitmap: [T, ceil(E/8)] uint8 (any array, never read, without a map)
        saved,  # [T, E] fp32 (TE's convention, see the forward)
        grad_probs,  # [T, E] grad_kind
        grad_logits,  # [T, E] out_kind, out
        topk,
        sf,
        pre,
        scale,  # fp32
        lanes,  # W; blockDim.x = tokens per block * W
    ):
        num_tokens = saved.shape[0]
        num_experts = saved.shape[1]
        red = cuda.shared.array(0, nb_f32)  # fp32 [2 * threads]: lane partials of S and D
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        tok = tid // lanes
        lane = tid - tok * lanes
        token = cuda.blockIdx.x * (nthreads // lanes) + tok
        live = token < num_tokens
        dense = sf == _SOFTMAX and pre

        # Pass 1: S = sum_m a, D = sum_m g a over this lane's experts, four
        # experts per step: their loads are all issued before any is used
        # (a branch on a loaded flag would otherwise wait for each in turn).
        total = _ZERO
        dot = _ZERO
        j = lane
        while live and j < num_experts:
            j1 = j + lanes
            j2 = j1 + lanes
            j3 = j2 + lanes
            m0 = mask(routing_map, token, j, True)
            m1 = mask(routing_map, token, j1, j1 < num_experts)
            m2 = mask(routing_map, token, j2, j2 < num_experts)
            m3 = mask(routing_map, token, j3, j3 < num_experts)
            a0, g0 = pair(saved, grad_probs, token, j, m0)
            a1, g1 = pair(saved, grad_probs, token, j1, m1)
            a2, g2 = pair(saved, grad_probs, token, j2, m2)
            a3, g3 = pair(saved, grad_probs, token, j3, m3)
            if m0:
                total, dot = _accumulate(total, dot, a0, g0, scale, sf)
            if m1:
                total, dot = _accumulate(total, dot, a1, g1, scale, sf)
            if m2:
                total, dot = _accumulate(total, dot, a2, g2, scale, sf)
            if m3:
                total, dot = _accumulate(total, dot, a3, g3, scale, sf)
            j = j3 + lanes
        red[tid] = total
        red[nthreads + tid] = dot
        _tree_reduce(red, 0, nthreads, tid, lane, lanes, False)

        # Pass 2: the gradient of every element of the row, four per step.
        if live:
            lead = tok * lanes
            den = np.float32(red[lead] + _EPS)
            dsum = red[nthreads + lead]
            j = lane
            while j < num_experts:
                j1 = j + lanes
                j2 = j1 + lanes
                j3 = j2 + lanes
                m0 = mask(routing_map, token, j, True)
                m1 = mask(routing_map, token, j1, j1 < num_experts)
                m2 = mask(routing_map, token, j2, j2 < num_experts)
                m3 = mask(routing_map, token, j3, j3 < num_experts)
                x0, g0 = pair(saved, grad_probs, token, j, m0 or dense)
                x1, g1 = pair(saved, grad_probs, token, j1, m1 or (dense and j1 < num_experts))
                x2, g2 = pair(saved, grad_probs, token, j2, m2 or (dense and j2 < num_experts))
                x3, g3 = pair(saved, grad_probs, token, j3, m3 or (dense and j3 < num_experts))
                store(grad_logits, token, j, _topk_dx(x0, g0, m0, dense, den, dsum, scale, topk, sf))
                if j1 < num_experts:
                    store(grad_logits, token, j1, _topk_dx(x1, g1, m1, dense, den, dsum, scale, topk, sf))
                if j2 < num_experts:
                    store(grad_logits, token, j2, _topk_dx(x2, g2, m2, dense, den, dsum, scale, topk, sf))
                if j3 < num_experts:
                    store(grad_logits, token, j3, _topk_dx(x3, g3, m3, dense, den, dsum, scale, topk, sf))
                j = j3 + lanes

    return kernel


_ALL_SET = np.uint32(0x01010101)  # the map word of a quad of four selected experts
_B0, _B1, _B2, _B3 = (np.uint32(0xFF << (8 * i)) for i in range(4))  # a quad word's bytes
_N0, _N1, _N2, _N3 = (np.uint32(1 << i) for i in range(4))  # a BITMAP_U8 quad nibble's bits


@functools.cache
def _quad_dx(sf: int, dense: bool):
    """Device function ``dx(x, g, sel, inv, c, dsum, scale, norm)``: d logit of
    one element (docs/contract.md section 3) from saved ``x`` and the raw gradient
    ``g``, the score function and ``dense`` fixed at compile time.  The
    token's sums enter as ``inv = 1 / (S + eps)`` and ``c = D inv^2`` (one
    division per token instead of two per element: ``g/den - D/den^2`` is
    ``g inv - c``) and ``dsum = D``; ``norm``: the K > 1 normalisation."""
    if sf == _SOFTMAX:

        @cuda.jit(device=True)
        def dx(x, g, sel, inv, c, dsum, scale, norm):
            if not (sel or dense):
                return _ZERO
            gs = np.float32(g * scale) if sel else _ZERO
            return np.float32(x * np.float32(gs - dsum))

    else:

        @cuda.jit(device=True)
        def dx(x, g, sel, inv, c, dsum, scale, norm):
            if not sel:
                return _ZERO
            a = _sqrtsoftplus(x) if sf == _SQRTSOFTPLUS else x
            gp = np.float32(g * scale)
            if norm:
                gp = np.float32(np.float32(gp * inv) - c)
            return np.float32(gp * _activation_grad(x, a, sf))

    return dx


@functools.cache
def quad_bwd_kernel(grad_kind: str, out_kind: str, has_map: bool, sf: int, dense: bool, hold: int,
                    bitmap: bool = False):
    """The backwards (top-k; aux scores: no map, every expert selected, scale 1,
    the K > 1 normalisation) for E a multiple of 4, a quad of four experts
    per step, every array seen flat (``array_views``): the map read as one
    uint32 word per quad (bf16 gradients as one uint64) and the quad skipped
    when its word is 0 (no selected expert: no gradient or saved load, zeros
    written), which is most quads.  ``sf`` and ``dense`` (softmax-pre, where
    ``p (m g - D)`` needs every p) are compile-time constants.

    W lanes per token (``_launch.quad_tiling``), lane ``l`` quads ``l, l + W,
    ...``; pass 1 sums S and D over the selected experts, ``_tree_reduce``
    combines the lanes in a fixed order, pass 2 writes every quad, loading
    it again (mostly from L1).  Without a map (aux scores), a lane's first
    ``hold`` quads (a compile-time count, ``_launch.quad_hold``) are loaded
    all at once, before any is used (their loads in flight together), and
    stay in registers for pass 2.  Loop counters are int32 and indices
    unsigned: numba's int64 ``range`` and wrapped signed indices cost several
    times the loop's own work.

    ``bitmap`` (a compile-time constant): the map is BITMAP_U8, seen flat
    (``[T * ceil(E/8)]`` uint8), and a quad's flags are a nibble of its
    octet's byte (bits 0..3: the quad's experts); the quad's tests take the
    nibble's bits instead of the bool word's bytes.
    """
    if hold and (has_map or grad_kind != L.F32):
        raise ValueError("quad_bwd_kernel: hold needs every quad selected (no map) and fp32 gradients")
    from ._vec import quad_f32_unchecked

    aligned, load_aligned = quad_f32_unchecked()
    load4 = flat_io(grad_kind)[0]
    load_saved = flat_io(L.F32)[0]
    _, out4, zero_out4 = flat_io(out_kind)
    dx = _quad_dx(sf, dense)
    held_values = 4 * max(1, hold)  # local arrays need a size >= 1; indexed by constants only
    # a quad's flags: the bool map's word (a byte per expert) or the bitmap's nibble
    c0, c1, c2, c3 = (_N0, _N1, _N2, _N3) if bitmap else (_B0, _B1, _B2, _B3)
    all_set = np.uint32(15) if bitmap else _ALL_SET  # the flags of a quad of four selected experts
    if has_map and bitmap:

        @cuda.jit(device=True)
        def word(routing_map, w, mrow, q):
            b = np.uint32(routing_map[_u64(mrow + (q >> 1))])
            return np.uint32(b >> np.uint32(4 * (q & 1))) & np.uint32(15)

    elif has_map:

        @cuda.jit(device=True)
        def word(routing_map, w, mrow, q):
            return routing_map[_u64(w)]

    else:

        @cuda.jit(device=True)
        def word(routing_map, w, mrow, q):
            return all_set

    @cuda.jit(device=True)
    def acc(total, dot, x, g, scale):
        """``(S + a, D + (g * scale) * a)`` for a selected expert (``a`` from saved ``x``)."""
        a = _sqrtsoftplus(x) if sf == _SQRTSOFTPLUS else x
        return np.float32(total + a), np.float32(dot + np.float32(np.float32(g * scale) * a))

    @cuda.jit(device=True)
    def acc4(total, dot, mw, x0, x1, x2, x3, g0, g1, g2, g3, scale):
        if mw & c0 != 0:
            total, dot = acc(total, dot, x0, g0, scale)
        if mw & c1 != 0:
            total, dot = acc(total, dot, x1, g1, scale)
        if mw & c2 != 0:
            total, dot = acc(total, dot, x2, g2, scale)
        if mw & c3 != 0:
            total, dot = acc(total, dot, x3, g3, scale)
        return total, dot

    @cuda.jit(device=True)
    def hold4(held, h, v0, v1, v2, v3):
        held[4 * h] = v0
        held[4 * h + 1] = v1
        held[4 * h + 2] = v2
        held[4 * h + 3] = v3

    def held_loader(load):
        """Device function: a lane's ``hold`` quads of both fp32 arrays into
        ``hg``, ``hx``, all loads before any use (``load``: with or without
        the alignment test; inlined, so the arrays stay registers)."""

        @cuda.jit(device=True)
        def load_held(hg, hx, grad_probs, saved, wlast, lane, step, eq):
            for h in range(hold):
                w = wlast + min(np.int32(lane + h * step), np.int32(eq - 1))
                g0, g1, g2, g3 = load(grad_probs, w)
                hold4(hg, h, g0, g1, g2, g3)
                x0, x1, x2, x3 = load(saved, w)
                hold4(hx, h, x0, x1, x2, x3)

        return load_held

    load_held_aligned = held_loader(load_aligned)
    load_held_checked = held_loader(load_saved)  # hold > 0: fp32 gradients, saved's loader

    @cuda.jit(device=True)
    def write4(grad_logits, w, mw, x0, x1, x2, x3, g0, g1, g2, g3, inv, c, dsum, scale, norm):
        out4(grad_logits, w, dx(x0, g0, mw & c0 != 0, inv, c, dsum, scale, norm),
             dx(x1, g1, mw & c1 != 0, inv, c, dsum, scale, norm),
             dx(x2, g2, mw & c2 != 0, inv, c, dsum, scale, norm),
             dx(x3, g3, mw & c3 != 0, inv, c, dsum, scale, norm))

    @cuda.jit
    def kernel(
        routing_map,  # [T*E/4] uint32 over the bool map; bitmap: [T*ceil(E/8)] uint8
                      # (any array, never read, without a map)
        saved,  # [T*E] fp32
        grad_probs,  # [T, E] grad_kind, flat (bf16: [T*E/4] uint64)
        grad_logits,  # [T, E] out_kind, flat (bf16: [T*E/4] uint64), out
        num_tokens,
        num_experts,
        topk,
        scale,  # fp32
        lanes,  # W; blockDim.x = tokens per block * W
    ):
        eq = np.int32(num_experts // 4)
        red = cuda.shared.array(0, nb_f32)  # fp32 [2 * threads]: lane partials of S and D
        hx = cuda.local.array(held_values, nb_f32)  # the held quads' saved x and g: registers
        hg = cuda.local.array(held_values, nb_f32)  # (indexed by constants once unrolled)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        tok = tid // lanes
        lane = np.int32(tid - tok * lanes)
        step = np.int32(lanes)
        token = cuda.blockIdx.x * (nthreads // lanes) + tok
        live = token < num_tokens
        wbase = token * eq  # the token's first quad (int64)
        mrow = token * ((eq + 1) >> 1)  # bitmap: the token's first map byte (int64)
        norm = sf != _SOFTMAX and topk > 1

        total = _ZERO
        dot = _ZERO
        if hold > 0:
            # Every load first, with no branch between them (the alignment
            # tested once), at indices clamped into the array (a dead token
            # or a missing quad reads the last token's last quad and is not
            # used); then the sums.
            wlast = min(token, num_tokens - 1) * eq
            if aligned(grad_probs) and aligned(saved):
                load_held_aligned(hg, hx, grad_probs, saved, wlast, lane, step, eq)
            else:
                load_held_checked(hg, hx, grad_probs, saved, wlast, lane, step, eq)
            for h in range(hold):
                if live and lane + h * step < eq:
                    total, dot = acc4(total, dot, all_set, hx[4 * h], hx[4 * h + 1], hx[4 * h + 2],
                                      hx[4 * h + 3], hg[4 * h], hg[4 * h + 1], hg[4 * h + 2],
                                      hg[4 * h + 3], scale)
        q = np.int32(lane + hold * step)
        while live and q < eq:
            w = wbase + q
            mw = word(routing_map, w, mrow, q)
            if mw != 0:
                g0, g1, g2, g3 = load4(grad_probs, w)
                x0, x1, x2, x3 = load_saved(saved, w)
                total, dot = acc4(total, dot, mw, x0, x1, x2, x3, g0, g1, g2, g3, scale)
            q = np.int32(q + step)
        red[tid] = total
        red[nthreads + tid] = dot
        _tree_reduce(red, 0, nthreads, tid, lane, lanes, False)

        if live:
            lead = tok * lanes
            inv = np.float32(_ONE / np.float32(red[lead] + _EPS))
            dsum = red[nthreads + lead]
            c = np.float32(np.float32(dsum * inv) * inv)
            for h in range(hold):
                q = np.int32(lane + h * step)
                if q < eq:
                    write4(grad_logits, wbase + q, all_set, hx[4 * h], hx[4 * h + 1], hx[4 * h + 2],
                           hx[4 * h + 3], hg[4 * h], hg[4 * h + 1], hg[4 * h + 2], hg[4 * h + 3], inv,
                           c, dsum, scale, norm)
            q = np.int32(lane + hold * step)
            while q < eq:
                w = wbase + q
                mw = word(routing_map, w, mrow, q)
                if mw == 0 and not dense:
                    zero_out4(grad_logits, w)
                else:
                    g0, g1, g2, g3 = load4(grad_probs, w)
                    x0, x1, x2, x3 = load_saved(saved, w)  # one 16-byte load, whichever are selected
                    write4(grad_logits, w, mw, x0, x1, x2, x3, g0, g1, g2, g3, inv, c, dsum, scale, norm)
                q = np.int32(q + step)

    return kernel


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _check_config(op, num_experts, topk, num_groups, group_topk, sf, pre, scaling_factor, bias_given, fmt):
    """The launcher's configuration, by the rules of ``gpurouter._checks`` (the
    one place they are written; the public ops apply them at trace time), then
    the kernel limits."""
    cfg = check_topk_args((1, num_experts), np.float32, topk, pre, num_groups, group_topk, scaling_factor, sf,
                          (num_experts,) if bias_given else None, np.float32, False, fmt, op=op)
    check_limits(op, num_experts, cfg.topk, cfg.num_groups if cfg.grouped else 1)
    return cfg.grouped


def topk_with_score_function_fwd(
    logits,
    topk,
    use_pre_softmax=False,
    num_groups=-1,
    group_topk=-1,
    scaling_factor=1.0,
    score_function="softmax",
    expert_bias=None,
    routing_map_format=0,
    *,
    return_indices=False,
    forced_indices=None,
    out=None,
    stream=0,
):
    """Router forward: scores, (group-limited) top-K, weights.

    Args:
      logits: (T, E) float32 | bfloat16 | float16, host or device.
      topk: K, ``1 <= K <= E``.
      use_pre_softmax: softmax over all E before the top-K (softmax only).
      num_groups: G; grouping is on iff ``group_topk > 0``.
      group_topk: Kg; ``E % G == 0``, ``K % Kg == 0``, ``Kg <= G``, ``K / Kg <= E / G``.
      scaling_factor: multiplies the final probs.
      score_function: "softmax" | "sigmoid" | "sqrtsoftplus" | 0..2.
      expert_bias: (E,) float32 or None; sigmoid/sqrtsoftplus only, selection only.
      routing_map_format: 0 (BYTEMAP): the map is (T, E) bool; 1 (BITMAP_U8):
        (T, ceil(E/8)) uint8, bit ``e % 8`` of byte ``e // 8`` set iff the
        token routes to expert ``e`` (``np.packbits(map, -1, bitorder="little")``).
      return_indices: also return ``indices (T, K) int32``, the selected
        experts in selection order (larger ``s + bias`` first, the lower index
        among equal scores, NaN as -inf), written by the selecting kernel.
      forced_indices: (T, K) integers, host or device (int32 on the device):
        the routing replay.  No selection: token t's experts are
        ``forced_indices[t]`` (entries outside [0, E) select nothing, a repeat
        selects its expert once); the bias is not read and the groups are
        ignored; everything after the selection is the normal call's.  An
        ``expert_bias`` given here only says that the replayed call had one
        (the weights' normaliser is then summed in that call's order, so a
        replay of returned indices is bit for bit the call).  Not with
        ``return_indices``.
      out: optional ``(probs, routing_map, saved_scores[, indices])`` device arrays to write.
      stream: numba stream or int CUDA stream handle (0: default).

    Returns:
      ``(probs (T, E) logits dtype, routing_map (T, E) bool or (T, ceil(E/8))
      uint8, saved_scores (T, E) float32)``, and ``indices (T, K) int32``
      with ``return_indices``; probs and saved_scores are the same bits in
      both formats.

    Notes:
      fp32 math throughout.  Ties: the lower expert index wins; NaN counts
      as -inf for selection; exactly K experts per token.
    """
    op = OP + "_fwd"
    sf = L.score_function_code(score_function, op)
    fmt = L.map_format_code(routing_map_format, op)
    s = L.resolve_stream(stream)
    d_logits, kind = L.device_input(logits, "logits", op, s, ndim=2)
    num_tokens, num_experts = (int(v) for v in d_logits.shape)
    topk = int(topk)
    _check_config(op, num_experts, topk, num_groups, group_topk, sf, use_pre_softmax, scaling_factor,
                  expert_bias is not None, fmt)
    forced = forced_indices is not None
    if forced and return_indices:
        raise ValueError(f"{op}: return_indices with forced_indices: the indices are the forced ones.")
    to_host = not L.any_on_device(logits, expert_bias, forced_indices) and out is None
    d_bias = None
    if expert_bias is not None and sf != _SOFTMAX:
        d_bias, bkind = L.device_input(expert_bias, "expert_bias", op, s, ndim=1)
        if bkind != L.F32 or tuple(d_bias.shape) != (num_experts,):
            raise ValueError(f"{op}: expert_bias must be float32 of shape ({num_experts},), "
                             f"got {tuple(d_bias.shape)} {d_bias.dtype}.")
    plan = topk_with_score_function_fwd_plan(
        spec_of(d_logits.shape, kind), d_bias is not None, topk, bool(use_pre_softmax),
        num_groups, group_topk, np.float32(scaling_factor), sf, fmt, bool(return_indices), forced)
    if forced:
        d_forced = L.index_input(forced_indices, "forced_indices", op, s, (num_tokens, topk))
        return execute(plan, [d_logits, d_forced], out, s, to_host)
    return execute(plan, [d_logits] if d_bias is None else [d_logits, d_bias], out, s, to_host)


@functools.cache
def topk_with_score_function_fwd_plan(logits: Spec, has_bias: bool, topk: int, pre: bool,
                                      num_groups, group_topk, scale: np.float32, sf: int,
                                      map_format: int = 0, return_indices: bool = False,
                                      forced: bool = False) -> Plan:
    """The launches of the forward (inputs: logits, bias; outputs: probs, map, saved).

    Arguments are validated (by the launcher or, under JAX, at trace time);
    ``map_format`` is checked here too.  The map's Spec: ``bool [T, E]``
    (0, BYTEMAP) or ``uint8 [T, ceil(E/8)]`` (1, BITMAP_U8).
    ``return_indices``: a fourth output, ``indices`` ``int32 [T, K]`` (the
    selection order).  ``forced`` (the routing replay): the inputs are
    ``(logits, forced int32 [T, K])``, never a bias; ``has_bias`` then says
    whether the replayed call had one (the order of the weights' sum), and
    the groups choose only the kernel path the replayed call took.
    """
    fmt = L.map_format_code(map_format, OP + "_fwd_plan", "map_format")
    bitmap = fmt == L.BITMAP_U8
    indices = bool(return_indices) and not forced
    num_tokens, num_experts = logits.shape
    grouped = group_topk is not None and group_topk > 0
    shape = (num_tokens, num_experts)
    idx_spec = Spec((num_tokens, int(topk)), np.int32)
    outs = (spec_of(shape, logits.kind), map_spec(num_tokens, num_experts, fmt),
            spec_of(shape, L.F32)) + ((idx_spec,) if indices else ())
    bias_spec = spec_of((num_experts,), L.F32)
    if forced:
        ins = (logits, idx_spec)
    else:
        ins = (logits, bias_spec) if has_bias else (logits,)
    if num_tokens == 0:
        return Plan(OP + "_fwd", ins, outs)
    # without a bias the kernel gets any [E] fp32 array (never read): saved's first row
    bias = In(1) if has_bias and not forced else Out(2, bias_spec)
    G = int(num_groups) if grouped else 1
    flat_idx = Spec((num_tokens * int(topk),), np.int32)
    # indices out, forced in, or (never read) any int32 array: saved's first words
    xarr = In(1, flat_idx) if forced else Out(3, flat_idx) if indices else Out(2, Spec((1,), np.int32))
    # (the replay takes the kernel path of the call it replays: the same sums)
    if L.token_path(num_experts, int(topk), G if grouped else 0, bool(has_bias)):
        from .token_rows import topk_fwd_kernel

        post = sf == _SOFTMAX and not pre
        if forced:  # no groups, no bias: the bits say which experts
            lay = L.token_layout(num_tokens, num_experts)
            kern = topk_fwd_kernel(logits.kind, int(topk), 0, int(sf), False, bool(pre) and sf == _SOFTMAX,
                                   bitmap, False, True, bool(has_bias) and not post)
            G, Kg = 1, -1
        else:
            gcap = L.pow2_at_least(int(topk) // int(group_topk)) if grouped else 0
            lay = L.token_layout(num_tokens, num_experts, G if grouped else 0, bool(has_bias))
            kern = topk_fwd_kernel(logits.kind, int(topk), gcap, int(sf), bool(has_bias),
                                   bool(pre) and sf == _SOFTMAX, bitmap, *((True,) if indices else ()))
            Kg = int(group_topk) if grouped else -1
        words, quads, flat = array_views(logits.kind, shape)
        step = Step(kern, lay.grid, lay.threads, lay.shared,
                      (In(0, words), bias, Out(0, words), Out(1, map_view(outs[1], quads)),
                       Out(2, flat),
                       num_tokens, num_experts, G, Kg,
                       np.float32(scale), lay.tb, lay.stride, lay.o_flag, lay.o_gs, lay.o_red,
                       lay.o_thr, lay.o_bias, xarr))
        return Plan(OP + "_fwd", ins, outs, (), (step,))
    if forced:
        lay = L.select_layout(num_tokens, num_experts, int(topk))
        kern = _topk_fwd_kernel(logits.kind, topk_capacity(topk), bitmap, False, True)
        has_bias, G, Kg = False, 1, -1
    else:
        lay = L.select_layout(num_tokens, num_experts, int(topk), G if grouped else 0)
        kern = _topk_fwd_kernel(logits.kind, topk_capacity(topk), bitmap, *((True,) if indices else ()))
        Kg = int(group_topk) if grouped else -1
    xarr2 = In(1) if forced else Out(3) if indices else Out(2, Spec((1, 1), np.int32))
    step = Step(kern, lay.grid, lay.threads, lay.shared,
                  (In(0), bias, Out(0), Out(1), Out(2), int(topk), int(sf), bool(pre),
                   bool(has_bias), G, Kg, np.float32(scale),
                   lay.tb, lay.lanes, lay.stride, lay.list_stride, lay.group_lanes, lay.o_list,
                   lay.o_idx, lay.o_cnt, lay.o_grp, lay.o_keep, lay.o_flag, xarr2))
    return Plan(OP + "_fwd", ins, outs, (), (step,))


def topk_with_score_function_bwd(
    routing_map,
    saved_scores,
    grad_probs,
    topk,
    use_pre_softmax=False,
    scaling_factor=1.0,
    score_function="softmax",
    *,
    out=None,
    stream=0,
):
    """Router backward: ``grad_probs`` -> ``grad_logits`` (docs/contract.md section 3).

    Args:
      routing_map: from the forward, either format (told by its dtype): (T, E)
        bool (BYTEMAP) or (T, ceil(E/8)) uint8 (BITMAP_U8; padding bits ignored).
      saved_scores: (T, E) float32, from the forward.
      grad_probs: (T, E) float32 | bfloat16 | float16.
      topk, use_pre_softmax, scaling_factor, score_function: as in the forward.
      out: optional device array for grad_logits.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_logits (T, E), dtype of grad_probs.
    """
    op = OP + "_bwd"
    sf = L.score_function_code(score_function, op)
    s = L.resolve_stream(stream)
    d_saved, skind = L.device_input(saved_scores, "saved_scores", op, s, ndim=2)
    if skind != L.F32:
        raise TypeError(f"{op}: saved_scores must be float32, got {d_saved.dtype}.")
    d_grad, kind = L.device_input(grad_probs, "grad_probs", op, s, ndim=2)
    shape = tuple(int(v) for v in d_saved.shape)
    to_host = not L.any_on_device(routing_map, saved_scores, grad_probs) and out is None
    if tuple(d_grad.shape) != shape:
        raise ValueError(f"{op}: grad_probs shape {tuple(d_grad.shape)} != saved_scores {shape}.")
    d_map, fmt = L.map_input(routing_map, "routing_map", op, s, shape)
    plan = topk_with_score_function_bwd_plan(spec_of(shape, kind), int(topk), bool(use_pre_softmax),
                                             np.float32(scaling_factor), sf, fmt)
    return execute(plan, [d_map, d_saved, d_grad], out, s, to_host)[0]


def map_view(spec: Spec, quads: Spec) -> Spec:
    """The flat view a quad kernel takes of a routing map of ``spec``: the bool
    map as uint32 quad words (``quads``, from ``array_views``), a BITMAP_U8
    map as its bytes."""
    if spec.dtype == np.uint8:
        return Spec((spec.shape[0] * spec.shape[1],), np.uint8)
    return quads


@functools.cache
def topk_with_score_function_bwd_plan(grad_probs: Spec, topk: int, pre: bool, scale: np.float32,
                                      sf: int, map_format: int = 0) -> Plan:
    """The launches of the backward (inputs: map, saved, grad_probs; output:
    grad_logits).  The map's Spec: ``bool [T, E]`` (``map_format`` 0) or
    ``uint8 [T, ceil(E/8)]`` (1, BITMAP_U8)."""
    fmt = L.map_format_code(map_format, OP + "_bwd_plan", "map_format")
    bitmap = fmt == L.BITMAP_U8
    shape = grad_probs.shape
    ins = (map_spec(shape[0], shape[1], fmt), spec_of(shape, L.F32), grad_probs)
    outs = (grad_probs,)
    if shape[0] == 0:
        return Plan(OP + "_bwd", ins, outs)
    if shape[1] % 4 == 0:
        dense = bool(pre) and sf == _SOFTMAX
        grid, threads, lanes = L.quad_tiling(shape[0], shape[1], dense=dense)
        words, quads, flat = array_views(grad_probs.kind, shape)
        step = Step(quad_bwd_kernel(grad_probs.kind, grad_probs.kind, True, int(sf), dense, 0, bitmap),
                      grid, threads, 8 * threads,
                      (In(0, map_view(ins[0], quads)), In(1, flat), In(2, words), Out(0, words),
                       shape[0], shape[1], int(topk), np.float32(scale), lanes))
        return Plan(OP + "_bwd", ins, outs, (), (step,))
    grid, threads, lanes = L.stream_tiling(shape[0], shape[1])
    step = Step(_topk_bwd_kernel(grad_probs.kind, bitmap), grid, threads, 8 * threads,
                  (In(0), In(1), In(2), Out(0), int(topk), int(sf), bool(pre),
                   np.float32(scale), lanes))
    return Plan(OP + "_bwd", ins, outs, (), (step,))
