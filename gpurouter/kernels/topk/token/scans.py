"""The row scans of the thread-per-token selection (``topk/token/select.py``):
one thread walks its tile row ``smem[row:row+E]`` in ascending expert order,
int32 counters, no data-dependent branch (a warp's 32 threads scan 32
independent rows).
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types

from ..._base.device import NEG_INF, ONE, ZERO, nan_as_neg_inf, u32, u64
from .rows import register_pusher


@functools.cache
def token_scans(topk: int, has_bias: bool, scaled: bool, indices: int):
    """The scans of ``topk/token/select.token_selector(topk, ..., has_bias, ...,
    scaled, indices)``, its compile-time constants baked in: ``(score_at,
    scan, scan_sum, selected_sum, collect, place, tie_cut, drop, mark)``.

    - ``score_at(smem, row, o_bias, j, scale)``: expert ``j``'s selection
      score (plus the bias at ``smem[o_bias + j]``; times ``scale`` when
      ``scaled``);
    - ``scan(smem, row, o_bias, lo, hi, keys, scale)``: experts ``[lo, hi)``
      into the register list ``keys`` (the K + 1 largest);
    - ``scan_sum(smem, row, E, keys)``: (``scaled``) the raw row into
      ``keys`` and its sum;
    - ``selected_sum``, ``collect``, ``mark``: the selected experts (by the
      threshold and tie cutoff, or, ``mark``, the bit way) summed, listed
      (``indices``) or set as bits;
    - ``place(keys, sel, rv, n, xarr, xb)``: the listed hits to their places
      in selection order;
    - ``tie_cut``: the need-th expert scoring exactly the threshold;
    - ``drop(smem, row, lo, hi)``: a dropped group's experts to -inf.

    ``indices`` 1: the hits go to local arrays of K (``sel``, ``rv``: indexed
    by the runtime count, so in local memory); 2 (E <= 256, K <= 8): the
    hits' indices are bytes shifted into one int64 register (``sel[0]``, the
    latest lowest), without a branch, and ``place_packed`` re-reads their
    scores from the tile.
    """
    packed = indices == 2
    list_len = topk + 1  # the list: K + 1 scores, to see whether a tie crosses the threshold
    push_k = register_pusher(list_len)

    @cuda.jit(device=True)
    def hit_push(sel, rv, n, j, r, hit):
        # a selected expert, in ascending order, onto the hit list
        if packed:
            take = hit & (n < topk)
            acc = sel[0]
            sel[0] = np.int64(np.int64(acc << np.int64(8)) | np.int64(j)) if take else acc
            return np.int32(n + np.int32(take))
        if hit & (n < topk):
            sel[n] = j
            rv[n] = r
            n = np.int32(n + 1)
        return n

    @cuda.jit(device=True)
    def score_at(smem, row, o_bias, j, scale):
        v = smem[u32(row + j)]
        if has_bias:
            v = np.float32(v + smem[u32(o_bias + j)])
        if scaled:
            v = np.float32(v * scale)
        return v

    @cuda.jit(device=True)
    def scan(smem, row, o_bias, lo, hi, keys, scale):
        # (Two lists on alternate experts, merged at the end, measured slower:
        # lab/journal/benchmarks.md.)
        j = np.int32(lo)
        while j < hi:
            push_k(keys, nan_as_neg_inf(score_at(smem, row, o_bias, j, scale)))
            j = np.int32(j + 1)

    @cuda.jit(device=True)
    def scan_sum(smem, row, num_experts, keys):
        # ``scaled``: the list of the raw row, and its sum (two accumulators,
        # even and odd experts: E is even).
        total = ZERO
        total2 = ZERO
        j = np.int32(0)
        while j < num_experts:
            v = smem[u32(row + j)]
            v2 = smem[u32(row + j + 1)]
            push_k(keys, nan_as_neg_inf(v))
            push_k(keys, nan_as_neg_inf(v2))
            total = np.float32(total + v)
            total2 = np.float32(total2 + v2)
            j = np.int32(j + 2)
        return np.float32(total + total2)

    @cuda.jit(device=True)
    def selected_sum(smem, row, o_bias, lo, hi, thr, cut, total, sel, rv, n):
        # With a bias: the selected experts' own scores (not s + b), ascending.
        j = np.int32(lo)
        while j < hi:
            v = smem[u32(row + j)]
            r = np.float32(v + smem[u32(o_bias + j)])
            hit = (r > thr) | ((r == thr) & (j <= cut))
            total = np.float32(total + (v if hit else ZERO))
            if indices:
                n = hit_push(sel, rv, n, j, r, hit)
            j = np.int32(j + 1)
        return total, n

    @cuda.jit(device=True)
    def collect(smem, row, o_bias, lo, hi, thr, cut, sel, rv, n, scale):
        # ``indices`` without a bias: the selected experts, ascending.
        j = np.int32(lo)
        while j < hi:
            r = score_at(smem, row, o_bias, j, scale)
            n = hit_push(sel, rv, n, j, r, (r > thr) | ((r == thr) & (j <= cut)))
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
                xarr[u64(xb + pos)] = sel[a]

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
            smem[u32(row + j)] = NEG_INF
            j = np.int32(j + 1)

    @cuda.jit(device=True)
    def mark(smem, row, o_bias, lo, hi, thr, need, bits, fword, total, scale, sel, rv, n):
        # The bit way (rare: rows with fewer than K scores above -inf), kept
        # simple: one expert a step, no branch on the data.
        j = np.int32(lo)
        while j < hi:
            v = smem[u32(row + j)]
            r = nan_as_neg_inf(score_at(smem, row, o_bias, j, scale))
            tie = r == thr
            hit = (r > thr) | (tie & (need > 0))
            need = np.int32(need - np.int32(hit & tie))
            total = np.float32(total + (v if hit else ZERO))
            a = u32(fword + (j >> 5))
            bits[a] = bits[a] | np.uint32(np.uint32(hit) << np.uint32(j & 31))
            if indices:
                n = hit_push(sel, rv, n, j, r, hit)
            j = np.int32(j + 1)
        return need, total, n

    @cuda.jit(device=True)
    def place_packed(keys, acc, smem, row, o_bias, xarr, xb):
        # ``place`` of a packed list (K hits: exactly K are selected; hit a,
        # ascending, is byte K-1-a), the scores re-read (NaN as -inf)
        rs = cuda.local.array(topk, nb_f32)
        for a in range(topk):
            j = np.int32(np.int64(acc >> np.int64(8 * (topk - 1 - a))) & np.int64(255))
            r = nan_as_neg_inf(score_at(smem, row, o_bias, j, ONE))
            rs[a] = r
            pos = np.int32(0)
            for q in range(topk):
                pos = np.int32(pos + np.int32(keys[q] > r))
            for b in range(a):
                pos = np.int32(pos + np.int32(rs[b] == r))
            xarr[u64(xb + pos)] = j

    return score_at, scan, scan_sum, selected_sum, collect, place, tie_cut, drop, mark, place_packed

