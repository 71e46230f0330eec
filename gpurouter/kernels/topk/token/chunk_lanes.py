"""The chunk lanes of the thread-per-token top-k forward (``token_topk_fwd.py``,
``lanes``; small T: ``tiling.token_lanes``): a token's experts split into
chunks (its groups; ungrouped, runs of ``tiling.LANE_CHUNK`` experts), a lane
(thread) per chunk, so that the token's own thread never scans its row; it
merges the chunks' lists and reads the chunks' selection masks.

A (token, chunk) slot at ``o_lists + (t * C + c) * S`` words,
``S``, ``tiling.lane_chunks(E, G, K)``::

    [0, K + 1)        fp32 the chunk's K + 1 largest scores (NaN as -inf), descending
    K + 1             uint32 kept flag (grouped: the group's rank < Kg; else 1)
    K + 2             uint32 (slot r) the kept chunk of kept-rank r (``merge``'s table)
    K + 3 + 2w, + 1   uint32 masks of the chunk's word w: scores > thr, == thr
                      (bit b: the chunk's expert 32 w + b)

Phases, every thread of the block calling each, barriers between:

1. ``lists``: lane c scans chunk c once: (grouped) the group score, the sum
   in descending order of its top K / Kg, into ``o_gs``; its K + 1 largest.
2. ``rank``: lane c: the kept flag; a dropped group's tile values -> -inf
   (never selected: the threshold way compares with thr > -inf, the bit
   way walks kept groups only).  ``merge`` (``tree``): the kept lists
   merged pairwise by the lanes, log2(kept) levels.
3. ``keys`` (the token's thread): the merged list, or the kept chunks' lists
   pushed into one register list: the K + 1 largest kept scores, the values a scan of the
   kept experts keeps (so thr, need and the list sums are the row scan's);
   thr -inf: the bit way right here (``topk/token/scans``'s ``mark``, ascending).
4. ``masks``: lane c of a kept chunk of a threshold-way token: its > thr and
   == thr masks.
5. ``finish`` (the token's thread): ``cut``, the need-th expert scoring thr
   (a tie crossing the threshold), from the == masks in ascending order;
   the selected experts in ascending order from the masks: their sum
   (with a bias; the order ``selected_sum`` adds them in: the same bits)
   and their indices; the weights' statistics as ``token_selector``'s.

No warp intrinsics (``cuda.popc`` is a plain instruction; the simulator has it).
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types

from ..._base.device import NAN, NEG_INF, ONE, ZERO, exp_f32, nan_as_neg_inf, u32
from .rows import register_pusher
from .scans import token_scans
from .tiling import LANE_CHUNK


@functools.cache
def lane_selector(topk: int, group_cap: int, has_bias: bool, post: bool, indices: int = 0, tree: bool = False):
    """The phases ``(lists, rank, merge, keys, masks, finish)`` (and ``area``:
    a token's slot words) of the chunk lanes for ``token_selector(topk,
    group_cap, has_bias, post, False, indices)``'s selection, which they give
    bit for bit (module docstring).  ``group_cap``
    > 0: grouped (chunks are the G groups), else chunks of ``LANE_CHUNK``.
    ``tree``: the kept chunks' lists merged by the lanes, in log2(kept)
    levels (``merge``), and ``keys`` reads the result; else ``keys`` pushes
    every kept list (``merge`` then does nothing)."""
    ranked = group_cap > 0
    list_len = topk + 1
    push_k = register_pusher(list_len)
    glist = max(1, group_cap)
    push_g = register_pusher(glist)
    norm = topk > 1
    score_at, _, _, _, _, place, _, _, mark, place_packed = token_scans(topk, has_bias, False, indices)
    packed = indices == 2

    @cuda.jit(device=True)
    def chunking(num_experts, num_groups):
        # (C, chunk size, slot words S): tiling.lane_chunks
        if ranked:
            cs = np.int32(num_experts // num_groups)
            nc = np.int32(num_groups)
        else:
            cs = np.int32(LANE_CHUNK)
            nc = np.int32((num_experts + LANE_CHUNK - 1) // LANE_CHUNK)
        return nc, cs, np.int32(list_len + 2 + 2 * ((cs + 31) >> 5))

    @cuda.jit(device=True)
    def wrap(i, n):
        # i in [0, 2n) -> i mod n
        return np.int32(i - n) if i >= n else np.int32(i)

    @cuda.jit(device=True)
    def lane_of(tid, nthreads, tile_tokens):
        lanes = np.int32(nthreads // tile_tokens)
        t = np.int32(tid // lanes)
        return t, np.int32(tid - t * lanes)

    @cuda.jit(device=True)
    def lists(smem, tid, nthreads, nt, tile_tokens, stride, o_bias, num_experts, num_groups, group_topk, o_gs,
              o_lists):
        # Phase 1.  Lane c scans from its chunk's expert c mod n on, wrapping
        # (a token's lanes hit distinct banks when the chunk size is a multiple of 32).
        t, c = lane_of(tid, nthreads, tile_tokens)
        nc, cs, slot = chunking(num_experts, num_groups)
        cuda.syncthreads()  # the staged tile and bias
        if (t < nt) & (c < nc):
            row = np.int32(t * stride)
            lo = np.int32(c * cs)
            n = np.int32(min(cs, num_experts - lo))
            gk = cuda.local.array(glist, nb_f32)
            keys = cuda.local.array(list_len, nb_f32)
            for q in range(glist):
                gk[q] = NEG_INF
            for q in range(list_len):
                keys[q] = NEG_INF
            off = np.int32(c - (c // n) * n)
            i = np.int32(0)
            while i + 4 <= n:  # four experts a step, their loads first (a latency a step, not four)
                o1 = wrap(off + 1, n)
                o2 = wrap(o1 + 1, n)
                o3 = wrap(o2 + 1, n)
                v0 = nan_as_neg_inf(score_at(smem, row, o_bias, np.int32(lo + off), ONE))
                v1 = nan_as_neg_inf(score_at(smem, row, o_bias, np.int32(lo + o1), ONE))
                v2 = nan_as_neg_inf(score_at(smem, row, o_bias, np.int32(lo + o2), ONE))
                v3 = nan_as_neg_inf(score_at(smem, row, o_bias, np.int32(lo + o3), ONE))
                if ranked:
                    push_g(gk, v0)
                    push_g(gk, v1)
                    push_g(gk, v2)
                    push_g(gk, v3)
                push_k(keys, v0)
                push_k(keys, v1)
                push_k(keys, v2)
                push_k(keys, v3)
                off = wrap(o3 + 1, n)
                i = np.int32(i + 4)
            while i < n:
                v = nan_as_neg_inf(score_at(smem, row, o_bias, np.int32(lo + off), ONE))
                if ranked:
                    push_g(gk, v)
                push_k(keys, v)
                off = wrap(off + 1, n)
                i = np.int32(i + 1)
            if ranked:
                per_group = topk // group_topk
                gs = gk[0]
                for q in range(1, glist):
                    if q < per_group:
                        gs = np.float32(gs + gk[q])
                smem[u32(o_gs + t * (num_groups | 1) + c)] = gs
            base = np.int32(o_lists + (t * nc + c) * slot)
            for q in range(list_len):
                smem[u32(base + q)] = keys[q]

    @cuda.jit(device=True)
    def rank(smem, bits, tid, nthreads, nt, tile_tokens, stride, num_experts, num_groups, group_topk, o_gs, o_lists):
        # Phase 2: kept flags (ranks as ``keep_groups``: NaN as -inf, ties to
        # the lower group); a dropped group's experts to -inf in the tile.
        t, c = lane_of(tid, nthreads, tile_tokens)
        nc, cs, slot = chunking(num_experts, num_groups)
        if (t < nt) & (c < nc):
            keep = True
            r = np.int32(0)
            if ranked:
                gs = np.int32(o_gs + t * (num_groups | 1))
                v = nan_as_neg_inf(smem[u32(gs + c)])
                r = np.int32(0)
                h = np.int32(0)
                while h < nc:
                    u = nan_as_neg_inf(smem[u32(gs + h)])
                    r = np.int32(r + np.int32((u > v) | ((u == v) & (h < c))))
                    h = np.int32(h + 1)
                keep = r < group_topk
            o_tok = np.int32(o_lists + t * nc * slot)
            bits[u32(o_tok + c * slot + list_len)] = np.uint32(keep)
            if keep:  # the kept chunk of kept-rank r (ungrouped: r = c) is chunk c: ``merge``'s table
                bits[u32(o_tok + (r if ranked else c) * slot + list_len + 1)] = np.uint32(c)
            else:
                j = np.int32(t * stride + c * cs)
                end = np.int32(j + cs)
                while j < end:
                    smem[u32(j)] = NEG_INF
                    j = np.int32(j + 1)

    @cuda.jit(device=True)
    def merge(smem, bits, tid, nthreads, nt, tile_tokens, num_experts, num_groups, group_topk, o_lists):
        # Phase 2b (``tree``): the kept chunks' lists merged pairwise by kept rank,
        # level h: rank r (a multiple of 2^(h+1)) pushes rank r + 2^h's list into
        # its own; a barrier before each level (the top K + 1 of a union is the
        # same multiset in any pairing).
        t, c = lane_of(tid, nthreads, tile_tokens)
        nc, cs, slot = chunking(num_experts, num_groups)
        nk = np.int32(group_topk) if ranked else nc
        o_tok = np.int32(o_lists + t * nc * slot)
        keys = cuda.local.array(list_len, nb_f32)
        span = np.int32(1)
        while tree and span < nk:
            cuda.syncthreads()
            if (t < nt) & (c + span < nk) & ((c & (2 * span - 1)) == 0):
                a = np.int32(o_tok + np.int32(bits[u32(o_tok + c * slot + list_len + 1)]) * slot)
                b = np.int32(o_tok + np.int32(bits[u32(o_tok + (c + span) * slot + list_len + 1)]) * slot)
                for q in range(list_len):
                    keys[q] = smem[u32(a + q)]
                for q in range(list_len):
                    push_k(keys, smem[u32(b + q)])
                for q in range(list_len):
                    smem[u32(a + q)] = keys[q]
            span = np.int32(2 * span)

    @cuda.jit(device=True)
    def keys_of(smem, bits, tid, row, num_experts, num_groups, o_bias, o_lists, fword, keys, sel, rv, o_thr):
        # Phase 3 (the token's thread; tile row ``tid``): returns ``(need,
        # total, n)``; the token's threshold (NaN: the bit way, its bits set)
        # to smem[o_thr].
        nc, cs, slot = chunking(num_experts, num_groups)
        o_tok = np.int32(o_lists + tid * nc * slot)
        if tree:  # the merged list: the kept chunk of rank 0's
            base = np.int32(o_tok + np.int32(bits[u32(o_tok + list_len + 1)]) * slot)
            for q in range(list_len):
                keys[q] = smem[u32(base + q)]
        else:
            for q in range(list_len):
                keys[q] = NEG_INF
            c = np.int32(0)
            while c < nc:
                base = np.int32(o_tok + c * slot)
                if bits[u32(base + list_len)] != 0:
                    for q in range(list_len):
                        push_k(keys, smem[u32(base + q)])
                c = np.int32(c + 1)
        thr = keys[topk - 1]
        need = np.int32(topk)
        for q in range(topk):
            if keys[q] > thr:
                need = np.int32(need - 1)
        total = ZERO
        n = np.int32(0)
        if thr > NEG_INF:
            smem[u32(o_thr)] = thr
        else:  # the bit way (as ``token_selector``'s ``bit_way``)
            w = np.int32(0)
            while w < (num_experts + 31) >> 5:
                bits[u32(fword + w)] = np.uint32(0)
                w = np.int32(w + 1)
            c = np.int32(0)
            while c < nc:
                if bits[u32(o_tok + c * slot + list_len)] != 0:
                    lo = np.int32(c * cs)
                    need, total, n = mark(smem, row, o_bias, lo, np.int32(min(lo + cs, num_experts)), thr, need,
                                          bits, fword, total, ONE, sel, rv, n)
                c = np.int32(c + 1)
            smem[u32(o_thr)] = NAN
        return need, total, n

    @cuda.jit(device=True)
    def masks(smem, bits, tid, nthreads, nt, tile_tokens, stride, o_bias, num_experts, num_groups, o_lists, o_thr):
        # Phase 4: a kept chunk's > thr and == thr masks, a word's experts from
        # c mod its size on, wrapping (distinct banks, as ``lists``).
        t, c = lane_of(tid, nthreads, tile_tokens)
        nc, cs, slot = chunking(num_experts, num_groups)
        if (t < nt) & (c < nc):
            thr = smem[u32(o_thr + t)]
            base = np.int32(o_lists + (t * nc + c) * slot)
            if (thr == thr) & (bits[u32(base + list_len)] != 0):
                row = np.int32(t * stride)
                lo = np.int32(c * cs)
                n = np.int32(min(cs, num_experts - lo))
                w = np.int32(0)
                while 32 * w < n:
                    nb = np.int32(min(32, n - 32 * w))
                    gt = np.uint32(0)
                    eq = np.uint32(0)
                    b = np.int32(c - (c // nb) * nb)
                    j0 = np.int32(lo + 32 * w)
                    i = np.int32(0)
                    while i + 4 <= nb:  # four a step, loads first (as ``lists``)
                        b1 = wrap(b + 1, nb)
                        b2 = wrap(b1 + 1, nb)
                        b3 = wrap(b2 + 1, nb)
                        r0 = score_at(smem, row, o_bias, np.int32(j0 + b), ONE)
                        r1 = score_at(smem, row, o_bias, np.int32(j0 + b1), ONE)
                        r2 = score_at(smem, row, o_bias, np.int32(j0 + b2), ONE)
                        r3 = score_at(smem, row, o_bias, np.int32(j0 + b3), ONE)
                        gt |= np.uint32(np.uint32(np.uint32(r0 > thr) << np.uint32(b))
                                        | np.uint32(np.uint32(r1 > thr) << np.uint32(b1))
                                        | np.uint32(np.uint32(r2 > thr) << np.uint32(b2))
                                        | np.uint32(np.uint32(r3 > thr) << np.uint32(b3)))
                        eq |= np.uint32(np.uint32(np.uint32(r0 == thr) << np.uint32(b))
                                        | np.uint32(np.uint32(r1 == thr) << np.uint32(b1))
                                        | np.uint32(np.uint32(r2 == thr) << np.uint32(b2))
                                        | np.uint32(np.uint32(r3 == thr) << np.uint32(b3)))
                        b = wrap(b3 + 1, nb)
                        i = np.int32(i + 4)
                    while i < nb:
                        r = score_at(smem, row, o_bias, np.int32(j0 + b), ONE)
                        gt |= np.uint32(np.uint32(r > thr) << np.uint32(b))
                        eq |= np.uint32(np.uint32(r == thr) << np.uint32(b))
                        b = wrap(b + 1, nb)
                        i = np.int32(i + 1)
                    bits[u32(base + list_len + 2 + 2 * w)] = gt
                    bits[u32(base + list_len + 3 + 2 * w)] = eq
                    w = np.int32(w + 1)

    @cuda.jit(device=True)
    def low_bit(m):
        # the index of the lowest set bit of m != 0 (popc of the bits up to it, less one)
        return np.int32(cuda.popc(np.uint32(m ^ np.uint32(m - np.uint32(1)))) - 1)

    @cuda.jit(device=True)
    def upto(cut, j0):
        # the bits of experts j0 + b <= cut
        lim = np.int32(cut - j0)
        if lim >= 31:
            return np.uint32(0xFFFFFFFF)
        if lim < 0:
            return np.uint32(0)
        return np.uint32(np.uint32(np.uint32(2) << np.uint32(lim)) - np.uint32(1))

    @cuda.jit(device=True)
    def hit(sel, rv, n, j, r):
        # a selected expert, in ascending order, onto the hit list (``topk/token/scans``'s ``hit_push``)
        if n < topk:  # (exactly K hits: a guard on the local arrays only)
            if packed:
                sel[0] = np.int64(np.int64(sel[0] << np.int64(8)) | np.int64(j))
            else:
                sel[n] = j
                rv[n] = r
        return np.int32(n + 1)

    @cuda.jit(device=True)
    def finish(smem, bits, tid, row, num_experts, num_groups, o_bias, o_lists, keys, need, total, n, sel, rv, xarr,
               xb):
        # Phase 5 (the token's thread): ``(total, m, thr, cut)`` as ``token_selector``.
        nc, cs, slot = chunking(num_experts, num_groups)
        o_tok = np.int32(o_lists + tid * nc * slot)
        thr = keys[topk - 1]
        cut = np.int32(num_experts)
        if thr > NEG_INF:  # the threshold way (else keys_of took the bit way)
            if keys[topk] == thr:  # a tie crosses the threshold: the first ``need`` tied experts are in
                c = np.int32(0)
                while (c < nc) & (need > 0):
                    base = np.int32(o_tok + c * slot)
                    if bits[u32(base + list_len)] != 0:
                        cn = np.int32(min(cs, num_experts - c * cs))
                        w = np.int32(0)
                        while (32 * w < cn) & (need > 0):
                            eq = bits[u32(base + list_len + 3 + 2 * w)]
                            while (eq != 0) & (need > 0):
                                cut = np.int32(c * cs + 32 * w + low_bit(eq))
                                need = np.int32(need - 1)
                                eq = np.uint32(eq & np.uint32(eq - np.uint32(1)))
                            w = np.int32(w + 1)
                    c = np.int32(c + 1)
            if (has_bias and norm) or indices:
                c = np.int32(0)
                while c < nc:
                    base = np.int32(o_tok + c * slot)
                    if bits[u32(base + list_len)] != 0:
                        cn = np.int32(min(cs, num_experts - c * cs))
                        w = np.int32(0)
                        while 32 * w < cn:
                            j0 = np.int32(c * cs + 32 * w)
                            hm = np.uint32(bits[u32(base + list_len + 2 + 2 * w)]
                                           | (bits[u32(base + list_len + 3 + 2 * w)] & upto(cut, j0)))
                            while hm != 0:
                                j = np.int32(j0 + low_bit(hm))
                                if has_bias and norm:
                                    total = np.float32(total + smem[u32(row + j)])
                                if indices:
                                    n = hit(sel, rv, n, j, score_at(smem, row, o_bias, j, ONE))
                                hm = np.uint32(hm & np.uint32(hm - np.uint32(1)))
                            w = np.int32(w + 1)
                    c = np.int32(c + 1)
            if not has_bias:
                for q in range(topk):
                    total = np.float32(total + keys[q])
        else:
            thr = NAN
        if packed:
            place_packed(keys, sel[0], smem, row, o_bias, xarr, xb)
        elif indices:
            place(keys, sel, rv, n, xarr, xb)
        m = ZERO
        if post:  # as ``token_selector``'s ``post_stats``
            m = keys[0]
            e = ZERO
            for q in range(topk):
                e += exp_f32(keys[q] - m)
            if total == total:
                total = e
        return total, m, thr, cut

    @cuda.jit(device=True)
    def area(num_experts, num_groups):
        nc, cs, slot = chunking(num_experts, num_groups)  # a token's slots: C * S words
        return np.int32(nc * slot)

    return lists, rank, merge, keys_of, masks, finish, area
