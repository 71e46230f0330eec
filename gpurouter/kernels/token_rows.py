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
selection bit per expert (written by the bit way only), the group scores,
per-row statistics and thresholds, and the expert bias (``_launch.TokenLayout``).
Global arrays are seen flat (``topk.array_views``); fp32 rows are read and
written a quad (16 bytes) at a time (``_vec``).

1. All threads, coalesced, four experts (a quad) per step, four quads in
   flight (bf16 logits as one 8-byte load per quad): the score function,
   ``saved``, the tile; the bias.
2. Thread t (t < TB), tile row t: (group scores, group ranks,) the K + 1
   largest scores; the K-th is the threshold.  Then one of two ways to say
   which experts are selected (below); the weights' statistics into shared
   memory.
3. All threads, coalesced, a quad per step: the quad's four selection flags
   are its ``routing_map`` word (one 4-byte store); the weights, ``probs``
   (bf16: one 8-byte store), ``saved`` for post-softmax.  A BITMAP_U8 map
   (``bitmap``, a compile-time constant): an octet (two quads) per step, a
   warp on 4 octets of 8 tokens, the map byte assembled in a register and
   stored by its thread alone (bf16 probs: one 16-byte store per octet).

Ranks (docs/contract.md section 2): the register list holds fp32 scores only, no
indices, NaN as -inf (one fmaxf with -inf), empty slots -inf; keeping the
K + 1 largest costs one fminf and one fmaxf per slot (an earlier int32 key
image took five more instructions per expert).  The K-th largest is the
token's threshold, and which experts own the K places is said one of two
ways:

- Threshold way (every token with K kept scores above -inf): expert ``j``
  is selected when its score ``r > thr``, or ``r == thr`` and ``j <= cut``.
  ``cut`` is E unless a tie crosses the threshold (the (K+1)-th largest equals
  the K-th: frequent with bf16 logits); then a scan in ascending order
  finds the index of the last tied expert that still gets a place, so among
  equal scores the lower index wins.  Phase 3 applies the rule to each
  expert; experts of dropped groups were set to -inf in the tile, which
  never passes.
- Bit way (the threshold is -inf: fewer than K kept scores above it, so
  -inf and NaN are tied fillers): a second scan in ascending expert order
  sets a bit for each expert whose score beats the threshold, or equals it
  while places remain; the token's threshold is stored as NaN and phase 3
  reads the bits.

Instruction counts (SASS, sm_90) drove the code's shape: loop counters are
int32 ``while`` loops and indices unsigned, because numba's int64 ``range``
loops and wrapped signed indices cost several times a loop's own work;
K, the score function, bias and softmax order are compile-time constants.

No warp intrinsics: the kernels run on the CUDA simulator too.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import uint32 as nb_u32  # array declarations take numba types

from . import _launch as L
from ._vec import pair_u64, quad_f32
from .topk import (
    _B0,
    _B1,
    _B2,
    _B3,
    _EPS,
    _N0,
    _N1,
    _N2,
    _N3,
    _NEG_INF,
    _ONE,
    _SIGMOID,
    _SOFTMAX,
    _ZERO,
    _activation,
    _exp,
    _fmax,
    _fmin,
    _no_nan,
    _u64,
    bf16_quad,
    flat_io,
    nb_f32,
    nb_i32,
)

_u32 = np.uint32  # shared-memory indices (see topk._u64)
_STAGE = 4  # quads per step of the staging, their loads in flight together
_STAGE_X = 4 * _STAGE  # (local-array sizes must be plain constants on the GPU)
_NAN = np.float32(np.nan)


# ----------------------------------------------------------------------------
# Register top-K lists
# ----------------------------------------------------------------------------


@functools.cache
def _pusher(cap: int):
    """Device function ``push(keys, v)``: fp32 ``v`` (no NaN) into the register
    list ``keys[0:cap]`` (descending, empty slots -inf), which keeps the
    ``cap`` largest values seen, repeats included.  ``cap`` is a compile-time
    constant: the loop unrolls and the list stays in registers; one fminf and
    one fmaxf per slot, no branches (a warp's 32 threads hold 32 independent
    lists)."""

    @cuda.jit(device=True)
    def push(keys, v):
        for q in range(cap - 1, 0, -1):
            keys[q] = _fmax(keys[q], _fmin(keys[q - 1], v))
        keys[0] = _fmax(keys[0], v)

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


@cuda.jit(device=True)
def _octet_walk(tid, nthreads, nt, nb):
    """The BITMAP_U8 phase 3's walk over a tile's ``[nt, nb]`` octets: a warp
    takes a group of 8 consecutive tokens by a chunk of 4 consecutive octets,
    lane ``l`` token ``l % 8`` and octet ``l / 8`` (a row-major walk would
    put a warp's 32 lanes on one row at an 8-word stride: 8-way bank
    conflicts on every tile read; here the odd row stride spreads the 8
    rows over the banks: none).  ``(lt, lo, ngroups, nchunks, g, c, dg,
    dc)``: the lane's token and octet in the group and chunk, the counts,
    and the warp's start and step over ``[ngroups, nchunks]`` (``_adv32``).
    ``nthreads``: a multiple of 32."""
    lane = np.int32(tid & 31)
    nchunks = np.int32((nb + 3) >> 2)
    g, c, dg, dc = _walk32(np.int32(tid >> 5), np.int32(nthreads >> 5), nchunks)
    return np.int32(lane & 7), np.int32(lane >> 3), np.int32((nt + 7) >> 3), nchunks, g, c, dg, dc


@functools.cache
def _selector(topk: int, gcap: int, has_bias: bool, post: bool, scaled: bool = False,
              indices: bool = False, forced: bool = False, asc: bool = False):
    """Device function ``select(smem, row, E, G, Kg, o_gs, o_bias, bits, fword, xarr, xb) -> (total, m, thr, cut)``:
    one thread's (group-limited) top-K (``topk``, a compile-time constant)
    of its tile row ``smem[row:row+E]`` plus, with ``has_bias``, the bias at
    ``smem[o_bias:o_bias+E]``; with ``scaled`` (the aux scores of sigmoid and
    sqrtsoftplus, no groups, no bias) the top-K of the row times ``1 / (sum
    + 1e-20)``, ``total`` the row's sum (see below).

    ``thr``, ``cut``: expert ``j`` is selected when its score (plus bias)
    ``r > thr``, or ``r == thr`` and ``j <= cut`` (the threshold way); or
    ``thr`` is NaN and the bits ``bits[fword:]`` (bit ``j % 32`` of word
    ``j // 32``) say which experts are (the bit way; module docstring).  ``total``: the
    sum of the selected tile values (any order; ``m`` 0); with ``post``
    (softmax after the top-K, no bias), ``m`` their max and ``total`` the sum
    of ``exp(v - m)``, both from the list (NaN when the values' sum is: a
    selected NaN, or +inf with -inf).

    1. Grouped (``gcap > 0``): group ``g``'s score is the sum, in descending
       order, of its top ``K / Kg`` values (NaN as -inf), kept at
       ``smem[o_gs + g]``; a group is kept when fewer than Kg groups rank
       before it (larger score, NaN as -inf, then lower group).
    2. The K + 1 largest scores of the kept experts (all E ungrouped): a
       register list, no indices.  ``thr``, the K-th largest, is the
       threshold; ``need`` of the K places go to experts scoring exactly
       ``thr``.  Among equal scores the lower index wins (docs/contract.md section
       2), so when the (K+1)-th equals ``thr`` too (a tie crosses the
       threshold: frequent with bf16 logits), a scan in ascending order
       finds ``cut``, the need-th expert scoring ``thr``.
       ``scaled``: the one scan also sums the row, and the list is then
       scaled, so the normalised scores need no pass of their own
       (multiplying by a positive number keeps the order, and the scaled
       list is compared with the scaled scores, ties included).
    3. Threshold way (``thr`` above -inf): experts of dropped groups become
       -inf in the tile, which never passes; with a bias the selected
       experts' values are summed (ascending order).  Bit way (``thr`` is
       -inf: fewer than K kept scores above it, so -inf and NaN are tied
       fillers): the token's bits are cleared, then the kept experts again,
       in ascending order: selected when the score beats ``thr``, or equals it
       while places remain; dropped groups are never selected, not even as
       fillers.

    ``indices`` (compile-time): the selected experts in selection order go
    to ``xarr[xb:xb+K]`` (flat int32): the scans that test each kept expert
    (``selected_sum``, ``mark``, or ``collect`` where neither runs) list the
    hits in ascending index order with their scores, and each hit's place is
    the number of list values above its score plus the earlier hits of equal
    score (``place``: register compares, no sort).  ``forced``
    (compile-time, the routing replay): no selection; the token's experts
    are ``xarr[xb:xb+K]`` (outside [0, E): none; a repeat: once), set as
    bits (the bit way), and the weights' statistics are those the normal
    call that selected them computes, in its order (``replay``).
    """
    kcap = topk + 1  # the list: K + 1 scores, to see whether a tie crosses the threshold
    push_k = _pusher(kcap)
    glist = max(1, gcap)  # the group list's size (a constant: numba sizes local arrays at compile time)
    push_g = _pusher(glist)
    norm = topk > 1  # (only read by sigmoid / sqrtsoftplus rows: softmax-pre needs no total)

    @cuda.jit(device=True)
    def score_at(smem, row, o_bias, j, scale):
        v = smem[_u32(row + j)]
        if has_bias:
            v = np.float32(v + smem[_u32(o_bias + j)])
        if scaled:
            v = np.float32(v * scale)
        return v

    @cuda.jit(device=True)
    def scan(smem, row, o_bias, lo, hi, keys, scale):
        # (Two lists on alternate experts, merged at the end, measured slower:
        # DeepSeek-V3 forward 224 vs 186 us on an H200.)
        j = np.int32(lo)
        while j < hi:
            push_k(keys, _no_nan(score_at(smem, row, o_bias, j, scale)))
            j = np.int32(j + 1)

    @cuda.jit(device=True)
    def scan_sum(smem, row, num_experts, keys):
        # ``scaled``: the list of the raw row, and its sum (two accumulators,
        # even and odd experts: E is even).
        total = _ZERO
        total2 = _ZERO
        j = np.int32(0)
        while j < num_experts:
            v = smem[_u32(row + j)]
            v2 = smem[_u32(row + j + 1)]
            push_k(keys, _no_nan(v))
            push_k(keys, _no_nan(v2))
            total = np.float32(total + v)
            total2 = np.float32(total2 + v2)
            j = np.int32(j + 2)
        return np.float32(total + total2)

    @cuda.jit(device=True)
    def selected_sum(smem, row, o_bias, lo, hi, thr, cut, total, sel, rv, n):
        # With a bias: the selected experts' own scores (not s + b), ascending.
        j = np.int32(lo)
        while j < hi:
            v = smem[_u32(row + j)]
            r = np.float32(v + smem[_u32(o_bias + j)])
            hit = (r > thr) | ((r == thr) & (j <= cut))
            total = np.float32(total + (v if hit else _ZERO))
            if indices:
                if hit & (n < topk):
                    sel[n] = j
                    rv[n] = r
                    n = np.int32(n + 1)
            j = np.int32(j + 1)
        return total, n

    @cuda.jit(device=True)
    def collect(smem, row, o_bias, lo, hi, thr, cut, sel, rv, n, scale):
        # ``indices`` without a bias: the selected experts, ascending.
        j = np.int32(lo)
        while j < hi:
            r = score_at(smem, row, o_bias, j, scale)
            if ((r > thr) | ((r == thr) & (j <= cut))) & (n < topk):
                sel[n] = j
                rv[n] = r
                n = np.int32(n + 1)
            j = np.int32(j + 1)
        return n

    @cuda.jit(device=True)
    def place(keys, sel, rv, n, xarr, xb):
        # Hit a (ascending index) goes to the place after the list values
        # above its score and the earlier hits of the same score.
        for a in range(topk):
            if a < n:
                r = rv[a]
                pos = np.int32(0)
                for q in range(topk):
                    pos = np.int32(pos + np.int32(keys[q] > r))
                b = np.int32(0)
                while b < a:
                    pos = np.int32(pos + np.int32(rv[b] == r))
                    b = np.int32(b + 1)
                xarr[_u64(xb + pos)] = sel[a]

    @cuda.jit(device=True)
    def tie_cut(smem, row, o_bias, lo, hi, thr, need, cut, scale):
        # The index of the need-th expert scoring exactly thr, in ascending
        # order (a tie crosses the threshold: only the first ones are in).
        j = np.int32(lo)
        while (j < hi) & (need > 0):
            if score_at(smem, row, o_bias, j, scale) == thr:
                need = np.int32(need - 1)
                cut = j
            j = np.int32(j + 1)
        return need, cut

    @cuda.jit(device=True)
    def drop(smem, row, lo, hi):
        j = np.int32(lo)
        while j < hi:
            smem[_u32(row + j)] = _NEG_INF
            j = np.int32(j + 1)

    @cuda.jit(device=True)
    def mark(smem, row, o_bias, lo, hi, thr, need, bits, fword, total, scale, sel, rv, n):
        # The bit way (rare: rows with fewer than K scores above -inf), kept
        # simple: one expert a step, no branch on the data.
        j = np.int32(lo)
        while j < hi:
            v = smem[_u32(row + j)]
            r = _no_nan(score_at(smem, row, o_bias, j, scale))
            tie = r == thr
            hit = (r > thr) | (tie & (need > 0))
            need = np.int32(need - np.int32(hit & tie))
            total = np.float32(total + (v if hit else _ZERO))
            a = _u32(fword + (j >> 5))
            bits[a] = bits[a] | np.uint32(np.uint32(hit) << np.uint32(j & 31))
            if indices:
                if hit & (n < topk):
                    sel[n] = j
                    rv[n] = r
                    n = np.int32(n + 1)
            j = np.int32(j + 1)
        return need, total, n

    push_asc = _pusher(topk)

    @cuda.jit(device=True)
    def replay(smem, row, num_experts, bits, fword, xarr, xb):
        # The routing replay: the forced experts as bits; their scores (NaN as
        # -inf) into the register list, as the normal call's K selected; their
        # indices, negated, into a second list (descending: ascending index).
        keys = cuda.local.array(kcap, nb_f32)
        up = cuda.local.array(topk, nb_f32)
        for q in range(kcap):
            keys[q] = _NEG_INF
        for q in range(topk):
            up[q] = _NEG_INF
        w = np.int32(0)
        while w < (num_experts + 31) >> 5:
            bits[_u32(fword + w)] = np.uint32(0)
            w = np.int32(w + 1)
        for a in range(topk):
            j = np.int32(xarr[_u64(xb + a)])
            if (j >= 0) & (j < num_experts):
                wa = _u32(fword + (j >> 5))
                bit = np.uint32(np.uint32(1) << np.uint32(j & 31))
                if bits[wa] & bit == 0:  # a repeat selects its expert once
                    bits[wa] = bits[wa] | bit
                    push_k(keys, _no_nan(smem[_u32(row + j)]))
                    push_asc(up, np.float32(-np.float32(j)))
        # The normal call's sums: of the selected tile values in ascending
        # index order (with a bias, ``asc``, or on the bit way: a K-th score
        # of -inf), else of the list (descending).
        rawsum = _ZERO
        for q in range(topk):
            if up[q] > _NEG_INF:
                rawsum = np.float32(rawsum + smem[_u32(row + np.int32(-up[q]))])
        total = rawsum
        m = _ZERO
        if post:
            m = keys[0]
            e = _ZERO
            for q in range(topk):
                e += _exp(keys[q] - m)
            if total == total:
                total = e
        elif not asc:
            if keys[topk - 1] > _NEG_INF:
                total = _ZERO
                for q in range(topk):
                    total = np.float32(total + keys[q])
        return total, m, _NAN, np.int32(num_experts)

    @cuda.jit(device=True)
    def select(smem, row, num_experts, num_groups, group_topk, o_gs, o_bias, bits, fword, xarr, xb):
        if forced:
            return replay(smem, row, num_experts, bits, fword, xarr, xb)
        sel = cuda.local.array(topk, nb_i32)  # ``indices``: the hits, ascending, and their scores
        rv = cuda.local.array(topk, nb_f32)
        n = np.int32(0)
        keys = cuda.local.array(kcap, nb_f32)
        for q in range(kcap):
            keys[q] = _NEG_INF
        kept = 0
        gsize = np.int32(num_experts)
        ngroups = 1
        if gcap > 0:
            ngroups = np.int32(num_groups)
            gsize = np.int32(num_experts // num_groups)
            per_group = topk // group_topk
            gk = cuda.local.array(glist, nb_f32)
            g = np.int32(0)
            while g < ngroups:
                for q in range(gcap):
                    gk[q] = _NEG_INF
                j = np.int32(g * gsize)
                end = np.int32(j + gsize)
                while j < end:
                    push_g(gk, _no_nan(score_at(smem, row, o_bias, j, _ONE)))
                    j = np.int32(j + 1)
                gs = gk[0]
                for q in range(1, gcap):
                    if q < per_group:
                        gs = np.float32(gs + gk[q])
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
        scale = _ONE
        rowsum = _ZERO
        if scaled:
            rowsum = scan_sum(smem, row, num_experts, keys)
            scale = np.float32(_ONE / np.float32(rowsum + _EPS))
            if rowsum - rowsum == _ZERO:  # finite: every score finite and >= 0, the order kept
                for q in range(kcap):
                    keys[q] = np.float32(keys[q] * scale)
            else:
                # an inf or NaN sum makes the scores 0 or NaN (inf / inf):
                # the scaled list is out of order, so list the scores themselves
                for q in range(kcap):
                    keys[q] = _NEG_INF
                scan(smem, row, o_bias, 0, num_experts, keys, scale)
        else:
            g = np.int32(0)
            while g < ngroups:
                if (kept >> g) & 1:
                    scan(smem, row, o_bias, np.int32(g * gsize), np.int32((g + 1) * gsize), keys, _ONE)
                g = np.int32(g + 1)
        thr = keys[topk - 1]
        need = np.int32(topk)
        for q in range(topk):
            if keys[q] > thr:
                need = np.int32(need - 1)
        total = _ZERO
        cut = np.int32(num_experts)  # every expert scoring thr is in
        if thr > _NEG_INF:
            # By threshold: r > thr, or r == thr up to expert ``cut`` (thr is
            # not -inf, so NaN, which counts as -inf, never ties with it;
            # -0.0 == +0.0).
            if keys[topk] == thr:
                g = np.int32(0)
                while g < ngroups:
                    if (kept >> g) & 1:
                        need, cut = tie_cut(smem, row, o_bias, np.int32(g * gsize), np.int32((g + 1) * gsize),
                                            thr, need, cut, scale)
                    g = np.int32(g + 1)
            g = np.int32(0)
            while g < ngroups:
                lo = np.int32(g * gsize)
                hi = np.int32(lo + gsize)
                if (kept >> g) & 1:
                    if has_bias and norm:
                        total, n = selected_sum(smem, row, o_bias, lo, hi, thr, cut, total, sel, rv, n)
                    elif indices:
                        n = collect(smem, row, o_bias, lo, hi, thr, cut, sel, rv, n, scale)
                else:
                    drop(smem, row, lo, hi)
                g = np.int32(g + 1)
            if not has_bias:
                for q in range(topk):
                    total = np.float32(total + keys[q])
        else:
            # Fewer than K kept scores above -inf: -inf and NaN are tied
            # fillers, the bits say which.
            w = np.int32(0)
            while w < (num_experts + 31) >> 5:
                bits[_u32(fword + w)] = np.uint32(0)
                w = np.int32(w + 1)
            g = np.int32(0)
            while g < ngroups:
                if (kept >> g) & 1:
                    need, total, n = mark(smem, row, o_bias, np.int32(g * gsize), np.int32((g + 1) * gsize),
                                          thr, need, bits, fword, total, scale, sel, rv, n)
                g = np.int32(g + 1)
            thr = _NAN  # phase 3: read the bits
        if indices:
            place(keys, sel, rv, n, xarr, xb)
        m = _ZERO
        if post:
            m = keys[0]
            e = _ZERO
            for q in range(topk):
                e += _exp(keys[q] - m)
            if total == total:
                total = e
        if scaled:
            total = rowsum
        return total, m, thr, cut

    return select


@cuda.jit(device=True)
def _flags_of(r0, r1, r2, r3, q, thr, cut, bits, fword):
    """Quad ``q``'s four selection flags, a byte per expert (its ``routing_map``
    word): its four scores ``r0..r3`` against the token's threshold ``thr``
    and tie cutoff ``cut``, or (``thr`` NaN) the token's bits at
    ``bits[fword:]``."""
    if thr != thr:
        n = np.uint32(bits[_u32(fword + (q >> 3))] >> np.uint32(4 * (q & 7)))
        return np.uint32((n & np.uint32(1)) | ((n & np.uint32(2)) << np.uint32(7))
                         | ((n & np.uint32(4)) << np.uint32(14)) | ((n & np.uint32(8)) << np.uint32(21)))
    j = 4 * q
    return (np.uint32((r0 > thr) | ((r0 == thr) & (j <= cut)))
            | np.uint32(np.uint32((r1 > thr) | ((r1 == thr) & (j + 1 <= cut))) << np.uint32(8))
            | np.uint32(np.uint32((r2 > thr) | ((r2 == thr) & (j + 2 <= cut))) << np.uint32(16))
            | np.uint32(np.uint32((r3 > thr) | ((r3 == thr) & (j + 3 <= cut))) << np.uint32(24)))


@cuda.jit(device=True)
def _nibble_of(r0, r1, r2, r3, q, thr, cut, bits, fword):
    """``_flags_of`` for a BITMAP_U8 map: quad ``q``'s four selection flags as
    bits 0..3 (expert ``4q + i``: bit ``i``), half of its map byte.  The bit
    way's nibble is the bits themselves."""
    if thr != thr:
        return np.uint32(np.uint32(bits[_u32(fword + (q >> 3))] >> np.uint32(4 * (q & 7))) & np.uint32(15))
    j = 4 * q
    return (np.uint32((r0 > thr) | ((r0 == thr) & (j <= cut)))
            | np.uint32(np.uint32((r1 > thr) | ((r1 == thr) & (j + 1 <= cut))) << np.uint32(1))
            | np.uint32(np.uint32((r2 > thr) | ((r2 == thr) & (j + 2 <= cut))) << np.uint32(2))
            | np.uint32(np.uint32((r3 > thr) | ((r3 == thr) & (j + 3 <= cut))) << np.uint32(3)))


# ----------------------------------------------------------------------------
# Staging and row statistics
# ----------------------------------------------------------------------------


@functools.cache
def _stager(kind: str, sf: int, has_bias: bool):
    """Device function staging the forward tile, ``_STAGE`` quads per step, their
    loads in flight together: the score function, ``saved`` (sigmoid: ``a``;
    sqrtsoftplus: the raw ``x``, TE's convention; softmax: nothing yet; one
    16-byte store per quad), the tile; with ``has_bias`` the bias into
    ``smem[o_bias:o_bias+E]``.  Ends with a barrier."""
    load4 = flat_io(kind)[0]
    store_f32 = quad_f32()[1]

    @cuda.jit(device=True)
    def put4(x0, x1, x2, x3, w, tile, saved, smem):
        s0, s1, s2, s3 = x0, x1, x2, x3
        if sf != _SOFTMAX:
            s0 = _activation(x0, sf)
            s1 = _activation(x1, sf)
            s2 = _activation(x2, sf)
            s3 = _activation(x3, sf)
            if sf == _SIGMOID:
                store_f32(saved, w, s0, s1, s2, s3)
            else:
                store_f32(saved, w, x0, x1, x2, x3)
        smem[_u32(tile)] = s0
        smem[_u32(tile + 1)] = s1
        smem[_u32(tile + 2)] = s2
        smem[_u32(tile + 3)] = s3

    @cuda.jit(device=True)
    def stage(lg, bias, saved, smem, o_bias, wb, nt, eq, stride, tid, nthreads):
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
            t, q = _adv32(ts[_STAGE - 1], qs[_STAGE - 1], dt, dq, eq)
        cuda.syncthreads()

    return stage


@functools.cache
def _softmax_rows():
    """Device functions of the softmax rows: ``stats(smem, row, valid, E, o_m,
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
            m = _NEG_INF
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
            total = _ZERO
            total2 = _ZERO
            j = np.int32(0)
            while j < num_experts:
                total += _exp(smem[_u32(row + j)] - m)
                total2 += _exp(smem[_u32(row + j + 1)] - m)
                j = np.int32(j + 2)
            smem[_u32(o_m)] = m
            smem[_u32(o_s)] = np.float32(_ONE / np.float32(total + total2))
        cuda.syncthreads()

    @cuda.jit(device=True)
    def one(v, m, inv):
        return np.float32(_exp(v - m) * inv)

    @cuda.jit(device=True)
    def normalise(smem, o_red, tb, out1, out2, write2, wb, nt, eq, stride, tid, nthreads):
        t, q, dt, dq = _walk32(tid, nthreads, eq)
        while t < nt:
            m = smem[_u32(o_red + t)]
            inv = smem[_u32(o_red + tb + t)]
            base = np.int32(t * stride + 4 * q)
            p0 = one(smem[_u32(base)], m, inv)
            p1 = one(smem[_u32(base + 1)], m, inv)
            p2 = one(smem[_u32(base + 2)], m, inv)
            p3 = one(smem[_u32(base + 3)], m, inv)
            smem[_u32(base)] = p0
            smem[_u32(base + 1)] = p1
            smem[_u32(base + 2)] = p2
            smem[_u32(base + 3)] = p3
            w = wb + np.int32(t * eq + q)
            store_f32(out1, w, p0, p1, p2, p3)
            if write2:
                store_f32(out2, w, p0, p1, p2, p3)
            t, q = _adv32(t, q, dt, dq, eq)
        cuda.syncthreads()

    return stats, normalise


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@functools.cache
def topk_fwd_kernel(kind: str, topk: int, gcap: int, sf: int, has_bias: bool, pre: bool,
                    bitmap: bool = False, indices: bool = False, forced: bool = False, asc: bool = False):
    """The top-k forward for logits of ``kind``; ``topk`` (K) and ``gcap`` >=
    K / Kg (0: no groups; a power of two) size the register lists; the score
    function, the bias, ``use_pre_softmax`` (softmax only) and the map format
    (``bitmap``: BITMAP_U8, else the bool map) are compile-time constants.
    ``indices``: the selected experts in selection order into ``xarr``
    (``[T*K]`` int32, written by each token's thread as it selects);
    ``forced`` (the routing replay, no bias, no groups): ``xarr`` holds the
    experts, and ``asc`` says that the replayed call had a bias (its weights'
    sum runs in ascending expert order: ``_selector``).  Without them
    ``xarr`` is never read."""
    stage = _stager(kind, sf, has_bias)
    _, store4, zero4 = flat_io(kind)
    store_f32 = quad_f32()[1]
    select = _selector(topk, gcap, has_bias, sf == _SOFTMAX and not pre, False, indices, forced, asc)
    stats, normalise = _softmax_rows()
    pre_softmax = sf == _SOFTMAX and pre
    post_softmax = sf == _SOFTMAX and not pre
    norm = sf != _SOFTMAX and topk > 1

    @cuda.jit(device=True)
    def weight(v, m, inv):
        """The routing weight of a selected expert of tile value ``v``; ``inv``:
        1 / the token's sum (a product instead of a division: within one ulp)."""
        if post_softmax:
            return np.float32(_exp(v - m) * inv)
        if norm:
            return np.float32(v * inv)
        return v

    @cuda.jit(device=True)
    def put_word(probs, saved, smem, w, fw, v0, v1, v2, v3, t, o_red, tile_tokens, scale):
        """BYTEMAP: quad ``w``'s probs (and, post-softmax, saved) from its tile
        values and its map word ``fw``."""
        w0 = w1 = w2 = w3 = _ZERO
        m0 = m1 = m2 = m3 = False
        if fw == 0:  # most quads: nothing selected, nothing to convert
            zero4(probs, w)
        else:
            inv = smem[_u32(o_red + t)]
            m = smem[_u32(o_red + tile_tokens + t)]
            m0 = fw & _B0 != 0
            m1 = fw & _B1 != 0
            m2 = fw & _B2 != 0
            m3 = fw & _B3 != 0
            w0 = weight(v0, m, inv) if m0 else _ZERO
            w1 = weight(v1, m, inv) if m1 else _ZERO
            w2 = weight(v2, m, inv) if m2 else _ZERO
            w3 = weight(v3, m, inv) if m3 else _ZERO
            store4(probs, w, np.float32(scale * w0), np.float32(scale * w1),
                   np.float32(scale * w2), np.float32(scale * w3))
        if post_softmax:
            store_f32(saved, w, w0 if m0 else _NEG_INF, w1 if m1 else _NEG_INF,
                      w2 if m2 else _NEG_INF, w3 if m3 else _NEG_INF)

    @cuda.jit(device=True)
    def quad_weights(saved, smem, wb, eq, t, q, stride, o_bias, thr, cut, bits, fword, o_red, tile_tokens):
        """BITMAP_U8: quad ``q`` of tile token ``t``: ``(nibble, w0..w3)``, its
        four flags (bit i: expert 4q + i) and weights (0 where unselected);
        post-softmax, its saved written."""
        base = np.int32(t * stride + 4 * q)
        v0 = smem[_u32(base)]
        v1 = smem[_u32(base + 1)]
        v2 = smem[_u32(base + 2)]
        v3 = smem[_u32(base + 3)]
        r0, r1, r2, r3 = v0, v1, v2, v3
        if has_bias:
            r0 = np.float32(v0 + smem[_u32(o_bias + 4 * q)])
            r1 = np.float32(v1 + smem[_u32(o_bias + 4 * q + 1)])
            r2 = np.float32(v2 + smem[_u32(o_bias + 4 * q + 2)])
            r3 = np.float32(v3 + smem[_u32(o_bias + 4 * q + 3)])
        nib = _nibble_of(r0, r1, r2, r3, q, thr, cut, bits, fword)
        w0 = w1 = w2 = w3 = _ZERO
        if nib != 0:
            inv = smem[_u32(o_red + t)]
            m = smem[_u32(o_red + tile_tokens + t)]
            w0 = weight(v0, m, inv) if nib & _N0 != 0 else _ZERO
            w1 = weight(v1, m, inv) if nib & _N1 != 0 else _ZERO
            w2 = weight(v2, m, inv) if nib & _N2 != 0 else _ZERO
            w3 = weight(v3, m, inv) if nib & _N3 != 0 else _ZERO
        if post_softmax:
            store_f32(saved, wb + np.int32(t * eq + q), w0 if nib & _N0 != 0 else _NEG_INF,
                      w1 if nib & _N1 != 0 else _NEG_INF, w2 if nib & _N2 != 0 else _NEG_INF,
                      w3 if nib & _N3 != 0 else _NEG_INF)
        return nib, w0, w1, w2, w3

    @cuda.jit(device=True)
    def probs_quad(probs, w, nib, w0, w1, w2, w3, scale):
        if nib == 0:
            zero4(probs, w)
        else:
            store4(probs, w, np.float32(scale * w0), np.float32(scale * w1), np.float32(scale * w2),
                   np.float32(scale * w3))

    @cuda.jit(device=True)
    def probs_quads(probs, w, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3, scale):
        probs_quad(probs, w, n0, a0, a1, a2, a3, scale)
        if two:
            probs_quad(probs, w + 1, n1, b0, b1, b2, b3, scale)

    if kind == L.BF16:
        pair_store = pair_u64()

        @cuda.jit(device=True)
        def probs_octet(probs, w, mi, paired, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3, scale):
            """The octet's probs: (bf16, E % 8 == 0) its eight words in one
            16-byte store, index ``mi`` (the map byte's), or a quad at a time."""
            if paired:
                if (n0 | n1) == 0:
                    pair_store(probs, mi, np.uint64(0), np.uint64(0))
                else:
                    pair_store(probs, mi, bf16_quad(np.float32(scale * a0), np.float32(scale * a1),
                                                    np.float32(scale * a2), np.float32(scale * a3)),
                               bf16_quad(np.float32(scale * b0), np.float32(scale * b1),
                                         np.float32(scale * b2), np.float32(scale * b3)))
            else:
                probs_quads(probs, w, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3, scale)

    else:

        @cuda.jit(device=True)
        def probs_octet(probs, w, mi, paired, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3, scale):
            probs_quads(probs, w, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3, scale)

    @cuda.jit(device=True)
    def octet(probs, saved, routing_map, smem, bits, t, o, wb, eq, nb, mb, paired, stride, o_bias, o_thr, o_flag,
              fstride, o_red, tile_tokens, scale):
        """BITMAP_U8: octet ``o`` (quads 2o, 2o + 1) of tile token ``t``: its
        weights and its map byte, assembled here and stored by this thread
        alone."""
        thr = smem[_u32(o_thr + t)]
        cut = np.int32(bits[_u32(o_thr + tile_tokens + t)])
        fword = o_flag + t * fstride
        q = np.int32(2 * o)
        n0, a0, a1, a2, a3 = quad_weights(saved, smem, wb, eq, t, q, stride, o_bias, thr, cut, bits, fword, o_red,
                                          tile_tokens)
        n1 = np.uint32(0)
        b0 = b1 = b2 = b3 = _ZERO
        two = q + 1 < eq
        if two:
            n1, b0, b1, b2, b3 = quad_weights(saved, smem, wb, eq, t, np.int32(q + 1), stride, o_bias, thr, cut,
                                              bits, fword, o_red, tile_tokens)
        mi = mb + np.int32(t * nb + o)
        routing_map[_u64(mi)] = np.uint8(n0 | np.uint32(n1 << np.uint32(4)))
        probs_octet(probs, wb + np.int32(t * eq + q), mi, paired, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3,
                    scale)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind, flat (bf16: [T*E/4] uint64)
        bias,  # [E] fp32 (any fp32 array without a bias; never read then)
        probs,  # [T, E] kind, flat (bf16: [T*E/4] uint64), out
        routing_map,  # out: [T*E/4] uint32 over the [T, E] bool map; bitmap: [T*ceil(E/8)] uint8
        saved,  # [T*E] fp32, out
        num_tokens,
        num_experts,
        num_groups,  # G
        group_topk,  # Kg
        scale,  # fp32 scaling_factor
        tile_tokens,  # TB
        stride,  # P
        o_flag,  # word offsets (_launch.token_layout)
        o_gs,
        o_red,
        o_thr,
        o_bias,
        xarr,  # [T*K] int32: indices out (``indices``), forced in (``forced``); else unused
    ):
        smem = cuda.shared.array(0, nb_f32)  # one dynamic allocation, two views
        bits = cuda.shared.array(0, nb_u32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = np.int32(min(tile_tokens, num_tokens - t0))
        valid = tid < nt  # thread t owns tile row t
        row = np.int32(tid * stride)
        eq = np.int32(num_experts // 4)
        fstride = np.int32(((num_experts + 31) >> 5) | 1)  # _launch.token_flag_stride
        wb = t0 * eq  # the tile's first quad (int64)

        # 1. All threads: s (the bias into shared memory), saved.
        stage(logits, bias, saved, smem, o_bias, wb, nt, eq, stride, tid, nthreads)
        if pre_softmax:
            # softmax over all E first (max and sum by the row's thread), then
            # all threads normalise in place and write saved.
            stats(smem, row, valid, num_experts, o_red + tid, o_red + tile_tokens + tid)
            normalise(smem, o_red, tile_tokens, saved, saved, False, wb, nt, eq, stride, tid, nthreads)

        # 2. Thread per token: selection, then the weights' statistics:
        # post-softmax the max and sum exp(s - max) of the selected scores,
        # normalised the sum of the selected scores + eps.  (Selection reads
        # s + bias; the weights, s itself.)
        if valid:
            total, m, thr, cut = select(smem, row, num_experts, num_groups, group_topk,
                                        o_gs + tid * (num_groups | 1), o_bias, bits, o_flag + tid * fstride,
                                        xarr, (t0 + tid) * topk)
            if norm:
                total = np.float32(total + _EPS)
            smem[_u32(o_red + tid)] = np.float32(_ONE / total)  # phase 3 multiplies
            smem[_u32(o_red + tile_tokens + tid)] = m
            smem[_u32(o_thr + tid)] = thr
            bits[_u32(o_thr + tile_tokens + tid)] = np.uint32(cut)
        # Barrier: phase 3 reads every token's tile row, bits and statistics.
        cuda.syncthreads()

        # 3. All threads: probs and, for post-softmax, saved (-inf at
        # unselected, the selected-set softmax at selected), and the map.
        if bitmap:
            # An octet (two quads, 8 experts) per step: one thread assembles
            # the octet's map byte in a register and stores it (a plain uint8
            # store: no other thread writes that byte).  E % 8 == 4 leaves a
            # last octet of one quad (its high nibble: the padding, 0).  bf16
            # probs with E % 8 == 0: the octet's eight words in one 16-byte
            # store (two 8-byte stores at a 16-byte stride would each write
            # half of every sector they touch), whose index is the map byte's.
            # A warp takes 4 consecutive octets of 8 consecutive tokens
            # (``_octet_walk``): its 32 lanes' tile reads hit 32 banks.
            nb = np.int32((eq + 1) >> 1)
            mb = t0 * nb  # the tile's first map byte (int64)
            paired = (eq & 1) == 0
            lt, lo, ngroups, nchunks, g, c, dg, dc = _octet_walk(tid, nthreads, nt, nb)
            while g < ngroups:
                t = np.int32(8 * g + lt)
                o = np.int32(4 * c + lo)
                if (t < nt) & (o < nb):
                    octet(probs, saved, routing_map, smem, bits, t, o, wb, eq, nb, mb, paired, stride, o_bias,
                          o_thr, o_flag, fstride, o_red, tile_tokens, scale)
                g, c = _adv32(g, c, dg, dc, nchunks)
        else:
            # A quad per step: the quad's four flags are one word, which is
            # also its routing-map word.
            t, q, dt, dq = _walk32(tid, nthreads, eq)
            while t < nt:
                w = wb + np.int32(t * eq + q)
                base = np.int32(t * stride + 4 * q)
                v0 = smem[_u32(base)]
                v1 = smem[_u32(base + 1)]
                v2 = smem[_u32(base + 2)]
                v3 = smem[_u32(base + 3)]
                r0, r1, r2, r3 = v0, v1, v2, v3
                if has_bias:  # the selection's scores: s + bias
                    r0 = np.float32(v0 + smem[_u32(o_bias + 4 * q)])
                    r1 = np.float32(v1 + smem[_u32(o_bias + 4 * q + 1)])
                    r2 = np.float32(v2 + smem[_u32(o_bias + 4 * q + 2)])
                    r3 = np.float32(v3 + smem[_u32(o_bias + 4 * q + 3)])
                fw = _flags_of(r0, r1, r2, r3, q, smem[_u32(o_thr + t)],
                               np.int32(bits[_u32(o_thr + tile_tokens + t)]), bits, o_flag + t * fstride)
                routing_map[_u64(w)] = fw
                put_word(probs, saved, smem, w, fw, v0, v1, v2, v3, t, o_red, tile_tokens, scale)
                t, q = _adv32(t, q, dt, dq, eq)

    return kernel


@functools.cache
def aux_scores_fwd_kernel(kind: str, topk: int, sf: int, bitmap: bool = False, indices: bool = False):
    """The aux-score forward for logits of ``kind``; K (``topk``), the score
    function and the map format (``bitmap``: BITMAP_U8) are compile-time
    constants; ``indices``: the top-K in selection order into ``xarr``
    (``[T*K]`` int32; never read otherwise)."""
    softmax = sf == _SOFTMAX
    stage = _stager(kind, sf, False)
    # softmax: select on the normalised tile; sigmoid / sqrtsoftplus: one
    # scan of the raw row gives its sum and the (scaled) list
    select = _selector(topk, 0, False, False, not softmax, indices)
    stats, normalise = _softmax_rows()
    store_f32 = quad_f32()[1]

    @cuda.jit(device=True)
    def scores_quad(scores, smem, w, base, inv):
        """The quad's scores (sigmoid / sqrtsoftplus: the tile times ``inv``,
        written to ``scores``)."""
        p0 = smem[_u32(base)]
        p1 = smem[_u32(base + 1)]
        p2 = smem[_u32(base + 2)]
        p3 = smem[_u32(base + 3)]
        if not softmax:
            p0 = np.float32(p0 * inv)
            p1 = np.float32(p1 * inv)
            p2 = np.float32(p2 * inv)
            p3 = np.float32(p3 * inv)
            store_f32(scores, w, p0, p1, p2, p3)
        return p0, p1, p2, p3

    @cuda.jit(device=True)
    def octet(scores, routing_map, smem, bits, t, o, wb, eq, nb, mb, stride, o_thr, o_flag, fstride, o_red,
              tile_tokens):
        """BITMAP_U8: octet ``o`` of tile token ``t``: (sigmoid / sqrtsoftplus)
        its scores, and its map byte, stored by this thread alone."""
        thr = smem[_u32(o_thr + t)]
        cut = np.int32(bits[_u32(o_thr + tile_tokens + t)])
        inv = _ONE if softmax else smem[_u32(o_red + tile_tokens + t)]
        fword = o_flag + t * fstride
        q = np.int32(2 * o)
        p0, p1, p2, p3 = scores_quad(scores, smem, wb + np.int32(t * eq + q), np.int32(t * stride + 4 * q), inv)
        byte = _nibble_of(p0, p1, p2, p3, q, thr, cut, bits, fword)
        q = np.int32(q + 1)
        if q < eq:
            p0, p1, p2, p3 = scores_quad(scores, smem, wb + np.int32(t * eq + q), np.int32(t * stride + 4 * q), inv)
            byte |= np.uint32(_nibble_of(p0, p1, p2, p3, q, thr, cut, bits, fword) << np.uint32(4))
        routing_map[_u64(mb + np.int32(t * nb + o))] = np.uint8(byte)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind, flat (bf16: [T*E/4] uint64)
        scores,  # [T*E] fp32, out
        routing_map,  # out: [T*E/4] uint32 over the [T, E] bool map; bitmap: [T*ceil(E/8)] uint8
        saved,  # [T*E] fp32, out: softmax p / sigmoid a / raw x (sqrtsoftplus)
        num_tokens,
        num_experts,
        tile_tokens,  # TB
        stride,  # P
        o_flag,  # word offsets (_launch.token_layout, no groups)
        o_red,
        o_thr,
        xarr,  # [T*K] int32, out (``indices``; else unused)
    ):
        smem = cuda.shared.array(0, nb_f32)
        bits = cuda.shared.array(0, nb_u32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = np.int32(min(tile_tokens, num_tokens - t0))
        valid = tid < nt
        row = np.int32(tid * stride)
        eq = np.int32(num_experts // 4)
        fstride = np.int32(((num_experts + 31) >> 5) | 1)  # _launch.token_flag_stride
        wb = t0 * eq

        # 1. All threads: x -> activation (x for softmax) into the tile, saved.
        stage(logits, saved, saved, smem, 0, wb, nt, eq, stride, tid, nthreads)
        # 2. Thread per token: softmax: max and sum exp, then (all threads)
        # the scores, in place and to memory, then the top-K of the scores;
        # sigmoid / sqrtsoftplus: the row's sum and top-K in one scan.  The
        # selection is a threshold and tie cutoff, or bits.
        if softmax:
            stats(smem, row, valid, num_experts, o_red + tid, o_red + tile_tokens + tid)
            normalise(smem, o_red, tile_tokens, scores, saved, True, wb, nt, eq, stride, tid, nthreads)
        if valid:
            total, _, thr, cut = select(smem, row, num_experts, 1, 0, 0, 0, bits, o_flag + tid * fstride,
                                        xarr, (t0 + tid) * topk)
            if not softmax:
                smem[_u32(o_red + tile_tokens + tid)] = np.float32(_ONE / np.float32(total + _EPS))
            smem[_u32(o_thr + tid)] = thr
            bits[_u32(o_thr + tile_tokens + tid)] = np.uint32(cut)
        # Barrier: phase 3 reads every token's statistics, threshold and bits.
        cuda.syncthreads()
        # 3. All threads: (sigmoid / sqrtsoftplus: the scores, times the
        # reciprocal the selection used;) the map.
        if bitmap:
            # An octet (two quads) per step, its map byte assembled in a
            # register and stored by this thread alone; a warp takes 4 octets
            # of 8 tokens (see topk_fwd_kernel).
            nb = np.int32((eq + 1) >> 1)
            mb = t0 * nb
            lt, lo, ngroups, nchunks, g, c, dg, dc = _octet_walk(tid, nthreads, nt, nb)
            while g < ngroups:
                t = np.int32(8 * g + lt)
                o = np.int32(4 * c + lo)
                if (t < nt) & (o < nb):
                    octet(scores, routing_map, smem, bits, t, o, wb, eq, nb, mb, stride, o_thr, o_flag, fstride,
                          o_red, tile_tokens)
                g, c = _adv32(g, c, dg, dc, nchunks)
        else:
            # A quad per step: the flag word is the quad's map word.
            t, q, dt, dq = _walk32(tid, nthreads, eq)
            while t < nt:
                w = wb + np.int32(t * eq + q)
                base = np.int32(t * stride + 4 * q)
                p0 = smem[_u32(base)]
                p1 = smem[_u32(base + 1)]
                p2 = smem[_u32(base + 2)]
                p3 = smem[_u32(base + 3)]
                if not softmax:
                    inv = smem[_u32(o_red + tile_tokens + t)]
                    p0 = np.float32(p0 * inv)
                    p1 = np.float32(p1 * inv)
                    p2 = np.float32(p2 * inv)
                    p3 = np.float32(p3 * inv)
                    store_f32(scores, w, p0, p1, p2, p3)
                routing_map[_u64(w)] = _flags_of(p0, p1, p2, p3, q, smem[_u32(o_thr + t)],
                                                 np.int32(bits[_u32(o_thr + tile_tokens + t)]), bits,
                                                 o_flag + t * fstride)
                t, q = _adv32(t, q, dt, dq, eq)

    return kernel
