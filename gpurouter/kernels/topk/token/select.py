"""The thread-per-token selection (``token_topk_fwd.py``, ``token_aux_scores_fwd.py``):
one thread's (group-limited) top-K of its tile row, said as a threshold and
tie cutoff, or as bits.

Ranks (docs/contract.md section 2): the register list holds fp32 scores only, no
indices, NaN as -inf, empty slots -inf; keeping the K + 1 largest costs one
fminf and one fmaxf per slot.  The K-th largest is the token's threshold,
and which experts own the K places is said one of two ways:

- Threshold way (every token with K kept scores above -inf): expert ``j``
  is selected when its score ``r > thr``, or ``r == thr`` and ``j <= cut``.
  ``cut`` is E unless a tie crosses the threshold (the (K+1)-th largest equals
  the K-th: frequent with bf16 logits); then a scan in ascending order
  finds the last tied expert that still gets a place (the lower index wins).
  Phase 3 applies the rule to each expert; dropped groups' experts are -inf.
- Bit way (the threshold is -inf: fewer than K kept scores above it, so
  -inf and NaN are tied fillers): a second scan in ascending expert order
  sets a bit for each expert whose score beats the threshold, or equals it
  while places remain; the token's threshold is stored as NaN and phase 3
  reads the bits.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import int32 as nb_i32
from numba import int64 as nb_i64

from ..._base.device import EPS, NAN, NEG_INF, ONE, ZERO, exp_f32, nan_as_neg_inf, u32, u64
from .rows import register_pusher
from .scans import token_scans


@functools.cache
def group_summer(group_cap: int):
    """Device function ``group_sum(gk, per_group)``: a group's score, the sum in
    descending order of the first ``per_group`` entries of its register list
    ``gk`` (``group_cap`` slots)."""

    @cuda.jit(device=True)
    def group_sum(gk, per_group):
        gs = gk[0]
        for q in range(1, group_cap):
            if q < per_group:
                gs = np.float32(gs + gk[q])
        return gs

    return group_sum


@functools.cache
def token_selector(topk: int, group_cap: int, has_bias: bool, post: bool, scaled: bool = False,
              indices: int = 0, forced: bool = False, asc: bool = False, group_lanes: bool = False):
    """Device function ``select(smem, row, E, G, Kg, o_gs, o_bias, bits, fword, xarr, xb, o_lists) -> (total,
    m, thr, cut)``:
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

    1. Grouped (``group_cap > 0``): group ``g``'s score is the sum, in descending
       order, of its top ``K / Kg`` values (NaN as -inf), kept at
       ``smem[o_gs + g]``; a group is kept when fewer than Kg groups rank
       before it (larger score, NaN as -inf, then lower group).  With
       ``group_lanes`` the block's lanes wrote the scores and each group's
       K + 1 largest (at ``o_lists``) before: ``token_group_lists``; step 2
       then pushes the kept groups' lists, the same K + 1 values a scan of
       their experts would keep.
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
    ``indices`` 1 lists the hits in local arrays, 2 (E <= 256, K <= 8) packs
    their indices in one register (``topk/token/scans.token_scans``;
    ``place_packed``).
    """
    indices = int(indices)  # the hit lists (1: local arrays, 2: packed) and ``place``
    hit_t = nb_i64 if indices == 2 else nb_i32
    list_len = topk + 1  # the list: K + 1 scores, to see whether a tie crosses the threshold
    push_k = register_pusher(list_len)
    glist = max(1, group_cap)  # the group list's size (a constant: numba sizes local arrays at compile time)
    push_g = register_pusher(glist)
    norm = topk > 1  # (only read by sigmoid / sqrtsoftplus rows: softmax-pre needs no total)

    score_at, scan, scan_sum, selected_sum, collect, place, tie_cut, drop, mark, place_packed = token_scans(
        topk, has_bias, scaled, indices)
    push_asc = register_pusher(topk)
    group_sum = group_summer(group_cap)

    @cuda.jit(device=True)
    def post_stats(keys, total):
        # post-softmax: the max and sum exp(v - max) of the K listed scores
        # (NaN when the values' sum ``total`` is)
        m = keys[0]
        e = ZERO
        for q in range(topk):
            e += exp_f32(keys[q] - m)
        if total == total:
            total = e
        return m, total

    @cuda.jit(device=True)
    def replay(smem, row, num_experts, bits, fword, xarr, xb):
        # The routing replay: the forced experts as bits; their scores (NaN as
        # -inf) into the register list, as the normal call's K selected; their
        # indices, negated, into a second list (descending: ascending index).
        keys = cuda.local.array(list_len, nb_f32)
        up = cuda.local.array(topk, nb_f32)
        for q in range(list_len):
            keys[q] = NEG_INF
        for q in range(topk):
            up[q] = NEG_INF
        w = np.int32(0)
        while w < (num_experts + 31) >> 5:
            bits[u32(fword + w)] = np.uint32(0)
            w = np.int32(w + 1)
        for a in range(topk):
            j = np.int32(xarr[u64(xb + a)])
            if (j >= 0) & (j < num_experts):
                wa = u32(fword + (j >> 5))
                bit = np.uint32(np.uint32(1) << np.uint32(j & 31))
                if bits[wa] & bit == 0:  # a repeat selects its expert once
                    bits[wa] = bits[wa] | bit
                    push_k(keys, nan_as_neg_inf(smem[u32(row + j)]))
                    push_asc(up, np.float32(-np.float32(j)))
        # The normal call's sums: of the selected tile values in ascending
        # index order (with a bias, ``asc``, or on the bit way: a K-th score
        # of -inf), else of the list (descending).
        rawsum = ZERO
        for q in range(topk):
            if up[q] > NEG_INF:
                rawsum = np.float32(rawsum + smem[u32(row + np.int32(-up[q]))])
        total = rawsum
        m = ZERO
        if post:
            m, total = post_stats(keys, total)
        elif not asc:
            if keys[topk - 1] > NEG_INF:
                total = ZERO
                for q in range(topk):
                    total = np.float32(total + keys[q])
        return total, m, NAN, np.int32(num_experts)

    @cuda.jit(device=True)
    def keep_groups(smem, row, o_bias, o_gs, ngroups, gsize, group_topk):
        # Step 1: the group scores into smem[o_gs + g] (unless the lanes wrote
        # them), then each group's rank; returns the kept groups as bits (bit
        # g: group g).
        per_group = topk // group_topk
        gk = cuda.local.array(glist, nb_f32)
        g = np.int32(0)
        while g < ngroups and not group_lanes:
            for q in range(group_cap):
                gk[q] = NEG_INF
            j = np.int32(g * gsize)
            end = np.int32(j + gsize)
            while j < end:
                push_g(gk, nan_as_neg_inf(score_at(smem, row, o_bias, j, ONE)))
                j = np.int32(j + 1)
            smem[u32(o_gs + g)] = group_sum(gk, per_group)
            g = np.int32(g + 1)
        kept = 0
        g = np.int32(0)
        while g < ngroups:
            v = smem[u32(o_gs + g)]
            if v != v:
                v = NEG_INF
            rank = 0
            h = np.int32(0)
            while h < ngroups:
                u = smem[u32(o_gs + h)]
                if u != u:
                    u = NEG_INF
                if u > v or (u == v and h < g):
                    rank += 1
                h = np.int32(h + 1)
            if rank < group_topk:
                kept |= 1 << g
            g = np.int32(g + 1)
        return kept

    @cuda.jit(device=True)
    def list_keys(smem, row, o_bias, num_experts, keys, kept, ngroups, gsize, o_lists):
        # Step 2: the K + 1 largest scores of the kept experts into ``keys``;
        # returns ``(scale, rowsum)`` (``scaled``: 1 / (sum + eps) and the sum).
        scale = ONE
        rowsum = ZERO
        if scaled:
            rowsum = scan_sum(smem, row, num_experts, keys)
            scale = np.float32(ONE / np.float32(rowsum + EPS))
            if rowsum - rowsum == ZERO:  # finite: every score finite and >= 0, the order kept
                for q in range(list_len):
                    keys[q] = np.float32(keys[q] * scale)
            else:
                # an inf or NaN sum makes the scores 0 or NaN (inf / inf):
                # the scaled list is out of order, so list the scores themselves
                for q in range(list_len):
                    keys[q] = NEG_INF
                scan(smem, row, o_bias, 0, num_experts, keys, scale)
        else:
            g = np.int32(0)
            while g < ngroups:
                if (kept >> g) & 1:
                    if group_lanes:
                        for q in range(list_len):
                            push_k(keys, smem[u32(o_lists + g * list_len + q)])
                    else:
                        scan(smem, row, o_bias, np.int32(g * gsize), np.int32((g + 1) * gsize), keys, ONE)
                g = np.int32(g + 1)
        return scale, rowsum

    @cuda.jit(device=True)
    def threshold_way(smem, row, o_bias, keys, kept, ngroups, gsize, thr, need, cut, total, scale, sel, rv, n):
        # Step 3, by threshold: r > thr, or r == thr up to expert ``cut`` (thr
        # is not -inf, so NaN, which counts as -inf, never ties with it;
        # -0.0 == +0.0).  Returns ``(cut, total, n)``.
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
        return cut, total, n

    @cuda.jit(device=True)
    def bit_way(smem, row, o_bias, num_experts, kept, ngroups, gsize, thr, need, bits, fword, total, scale, sel,
                rv, n):
        # Step 3, by bits: fewer than K kept scores above -inf, so -inf and
        # NaN are tied fillers, the bits say which.  Returns ``(total, n)``.
        w = np.int32(0)
        while w < (num_experts + 31) >> 5:
            bits[u32(fword + w)] = np.uint32(0)
            w = np.int32(w + 1)
        g = np.int32(0)
        while g < ngroups:
            if (kept >> g) & 1:
                need, total, n = mark(smem, row, o_bias, np.int32(g * gsize), np.int32((g + 1) * gsize),
                                      thr, need, bits, fword, total, scale, sel, rv, n)
            g = np.int32(g + 1)
        return total, n

    @cuda.jit(device=True)
    def token_select(smem, row, num_experts, num_groups, group_topk, o_gs, o_bias, bits, fword, xarr, xb, o_lists):
        if forced:
            return replay(smem, row, num_experts, bits, fword, xarr, xb)
        sel = cuda.local.array(topk, hit_t)  # ``indices``: the hits, ascending, and their scores
        sel[0] = 0
        rv = cuda.local.array(topk, nb_f32)
        n = np.int32(0)
        keys = cuda.local.array(list_len, nb_f32)
        for q in range(list_len):
            keys[q] = NEG_INF
        kept = 0
        gsize = np.int32(num_experts)
        ngroups = 1
        if group_cap > 0:
            ngroups = np.int32(num_groups)
            gsize = np.int32(num_experts // num_groups)
            kept = keep_groups(smem, row, o_bias, o_gs, ngroups, gsize, group_topk)
        else:
            kept = 1
        scale, rowsum = list_keys(smem, row, o_bias, num_experts, keys, kept, ngroups, gsize, o_lists)
        thr = keys[topk - 1]
        need = np.int32(topk)
        for q in range(topk):
            if keys[q] > thr:
                need = np.int32(need - 1)
        total = ZERO
        cut = np.int32(num_experts)  # every expert scoring thr is in
        if thr > NEG_INF:
            cut, total, n = threshold_way(smem, row, o_bias, keys, kept, ngroups, gsize, thr, need, cut, total,
                                          scale, sel, rv, n)
        else:
            total, n = bit_way(smem, row, o_bias, num_experts, kept, ngroups, gsize, thr, need, bits, fword, total,
                               scale, sel, rv, n)
            thr = NAN  # phase 3: read the bits
        if indices == 2:
            place_packed(keys, sel[0], smem, row, o_bias, xarr, xb)
        elif indices:
            place(keys, sel, rv, n, xarr, xb)
        m = ZERO
        if post:
            m, total = post_stats(keys, total)
        if scaled:
            total = rowsum
        return total, m, thr, cut

    return token_select


@functools.cache
def token_group_lists(topk: int, group_cap: int, has_bias: bool):
    """Device function ``lists(smem, tid, nthreads, nt, tile_tokens, stride, o_bias, E, G, Kg,
    o_gs, o_lists)``, run by every thread of a grouped block before the selection
    (``token_selector(..., group_lanes=True)``): W = ``nthreads // tile_tokens``
    >= G threads a token (``tid // W``), lane ``g < G`` scanning group ``g`` once
    for its score (as ``keep_groups``) into ``smem[o_gs + t * (G | 1) + g]`` and
    its K + 1 largest into ``smem[o_lists + (t * G + g) * (K + 1):]``, from
    expert ``g mod gsize`` on, wrapping (a token's lanes: distinct banks)."""
    list_len = topk + 1
    push_k = register_pusher(list_len)
    glist = max(1, group_cap)
    push_g = register_pusher(glist)
    score_at = token_scans(topk, has_bias, False, 0)[0]
    group_sum = group_summer(group_cap)

    @cuda.jit(device=True)
    def lists(smem, tid, nthreads, nt, tile_tokens, stride, o_bias, num_experts, num_groups, group_topk, o_gs,
              o_lists):
        lanes = np.int32(nthreads // tile_tokens)
        t = np.int32(tid // lanes)
        g = np.int32(tid - t * lanes)
        cuda.syncthreads()  # the staged tile and bias
        if (t < nt) & (g < num_groups):
            gsize = np.int32(num_experts // num_groups)
            row = np.int32(t * stride)
            gk = cuda.local.array(glist, nb_f32)
            keys = cuda.local.array(list_len, nb_f32)
            for q in range(glist):
                gk[q] = NEG_INF
            for q in range(list_len):
                keys[q] = NEG_INF
            lo = np.int32(g * gsize)
            start = np.int32(g - (g // gsize) * gsize)  # g mod the group size
            i = np.int32(0)
            while i < gsize:
                off = np.int32(i + start)
                if off >= gsize:
                    off = np.int32(off - gsize)
                v = nan_as_neg_inf(score_at(smem, row, o_bias, np.int32(lo + off), ONE))
                push_g(gk, v)
                push_k(keys, v)
                i = np.int32(i + 1)
            smem[u32(o_gs + t * (num_groups | 1) + g)] = group_sum(gk, topk // group_topk)
            base = np.int32(o_lists + (t * num_groups + g) * list_len)
            for q in range(list_len):
                smem[u32(base + q)] = keys[q]

    return lists
