"""The W-lane kernels' selection (``lane_topk_fwd.py``, ``lane_aux_scores_fwd.py``):
per-lane top-K lists in shared memory, their merge across the token's lanes,
and the (group-limited) top-K of a tile row built from them.

A list is sorted by (value desc, index asc): the contract's total order
(docs/contract.md section 2: among equal values the lower index wins; NaN
counts as -inf), whatever order the candidates arrive in.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import numpy as np
from numba import cuda

from ..._base.device import NEG_INF


def topk_capacity(topk: int) -> int:
    """Compile-time size of the per-thread top-K list: 8, 16, 32 or 64."""
    cap = 8
    while cap < topk:
        cap *= 2
    return cap


@cuda.jit(device=True)
def ranks_before(u, k, v, j):
    """True when entry ``(u, k)`` ranks before ``(v, j)``: larger value, then lower index."""
    return u > v or (u == v and k < j)


@cuda.jit(device=True)
def list_push(lv, li, d, base, n, cap, v, j):
    """Inserts candidate ``(v, j)`` into the shared list ``lv[base:base+n]`` (indices
    at ``li[base+d:]``), kept sorted by (value desc, index asc); returns the new length.

    The rank is the contract's total order (among equal values the lower
    index wins), whatever order the candidates arrive in.  NaN counts as
    -inf; -0.0 == +0.0 already under IEEE comparison.  Empty slots take any
    candidate, -inf included, so a list always holds ``min(cap, candidates)``
    distinct entries (the lowest-index ones fill what finite values cannot).
    """
    if v != v:
        v = NEG_INF
    if n < cap:
        pos = n
        n += 1
    else:
        pos = cap - 1
        if not ranks_before(v, j, lv[base + pos], li[base + d + pos]):
            return n
    while pos > 0:
        u = lv[base + pos - 1]
        if ranks_before(u, li[base + d + pos - 1], v, j):
            break
        lv[base + pos] = u
        li[base + d + pos] = li[base + d + pos - 1]
        pos -= 1
    lv[base + pos] = v
    li[base + d + pos] = j
    return n


@cuda.jit(device=True)
def list_merge(lv, li, d, a, na, b, nb, cap, tv, ti):
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
            take_a = ranks_before(va, li[a + d + i], vb, li[b + d + k])
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
def tree_merge_lists(lv, li, d, o_list, o_cnt, lstride, tid, lane, levels, cap, tv, ti):
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
            li[o_cnt + tid] = list_merge(lv, li, d, a, li[o_cnt + tid], a + span * lstride,
                                     li[o_cnt + tid + span], cap, tv, ti)
        span *= 2
    cuda.syncthreads()


@cuda.jit(device=True)
def log2_lanes(w):
    levels = 0
    while (1 << levels) < w:
        levels += 1
    return levels


@cuda.jit(device=True)
def lane_group_scores(smem, smem_i32, row, valid, lane, tid, lanes, num_groups, gsize, per_group, group_lanes, d,
                  base, gbase, o_list, o_cnt, lstride, tv, ti):
    """Group ``g``'s score, the sum (in descending order) of its top ``K / Kg``
    values, into ``smem[gbase + g]``: by ``group_lanes`` lanes (a lane-strided
    scan plus a tree merge) or, when G does not divide W, by one lane per
    group (scans start at a group-dependent offset: no bank conflicts).  All
    threads call it (the tree merge's barriers are block-wide)."""
    if group_lanes > 1:
        g = lane // group_lanes
        sub = lane - g * group_lanes
        n = 0
        if valid:
            # this lane's experts g*gsize + sub + i*group_lanes, i < cnt, from
            # i = g % cnt on (rotated: lanes of different groups hit
            # different banks when gsize is a multiple of 32; list_push ranks
            # in any arrival order)
            lo = g * gsize + sub
            cnt = (gsize - sub + group_lanes - 1) // group_lanes
            i = g % cnt if cnt > 0 else 0
            for _ in range(cnt):
                j = lo + i * group_lanes
                n = list_push(smem, smem_i32, d, base, n, per_group, smem[row + j], j)
                i += 1
                if i == cnt:
                    i = 0
        smem_i32[o_cnt + tid] = n
        tree_merge_lists(smem, smem_i32, d, o_list, o_cnt, lstride, tid, lane, log2_lanes(group_lanes),
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
                n = list_push(smem, smem_i32, d, base, n, per_group, smem[row + g * gsize + i],
                          g * gsize + i)
                i += 1
                if i == gsize:
                    i = 0
            gs = smem[base]
            for q in range(1, per_group):
                gs = np.float32(gs + smem[base + q])
            smem[gbase + g] = gs


@cuda.jit(device=True)
def lane_keep_groups(smem, smem_i32, valid, lane, lanes, num_groups, group_topk, gbase, kbase):
    """Each lane ranks its groups against all G (NaN as -inf, ties to the lower
    group) and flags those of rank < Kg as kept (``smem_i32[kbase + g]``)."""
    if valid:
        for g in range(lane, num_groups, lanes):
            v = smem[gbase + g]
            if v != v:
                v = NEG_INF
            rank = 0
            for h in range(num_groups):
                u = smem[gbase + h]
                if u != u:
                    u = NEG_INF
                if u > v or (u == v and h < g):
                    rank += 1
            smem_i32[kbase + g] = 1 if rank < group_topk else 0


@cuda.jit(device=True)
def lane_scan_experts(smem, smem_i32, row, valid, lane, lanes, num_experts, topk, grouped, gsize, kbase, d, base):
    """Lane ``l``'s experts ``l, l + W, ...`` of the kept groups into its list;
    returns the list's length."""
    n = 0
    if valid:
        g = 0
        bound = gsize
        kept = True
        if grouped:
            kept = smem_i32[kbase] != 0
        j = lane
        while j < num_experts:
            while j >= bound:
                g += 1
                bound += gsize
                kept = smem_i32[kbase + g] != 0
            if kept:  # dropped groups are never selected, not even as fillers
                n = list_push(smem, smem_i32, d, base, n, topk, smem[row + j], j)
            j += lanes
    return n


@cuda.jit(device=True)
def lane_select(smem, smem_i32, row, tok, valid, lane, tid, lanes, num_experts, topk, grouped,
            num_groups, group_topk, group_lanes, o_list, o_idx, o_cnt, o_grp, o_keep, lstride,
            tv, ti):
    """(Group-limited) top-K of the tile row ``row`` (selection scores), W lanes per token.

    All threads call it (every barrier is block-wide).  Afterwards the
    token's lane 0 list (``smem[o_list + (tid - lane)*lstride + q]``, indices
    at ``smem_i32[o_idx + ...]``) holds its K experts, in (value desc, index asc)
    order.

    Groups: the group scores (``lane_group_scores``), then each lane ranks its
    groups and keeps those of rank < Kg (``lane_keep_groups``).  Experts: lane
    ``l`` scans ``l, l + W, ...`` over kept groups into a local top-K
    (``lane_scan_experts``), and a tree merge across the W lanes leaves the
    token's top-K in lane 0.
    """
    d = o_idx - o_list
    base = o_list + tid * lstride
    gsize = num_experts
    gbase = o_grp + tok * num_groups
    kbase = o_keep + tok * num_groups
    if grouped:
        gsize = num_experts // num_groups
        per_group = topk // group_topk
        lane_group_scores(smem, smem_i32, row, valid, lane, tid, lanes, num_groups, gsize, per_group, group_lanes, d,
                      base, gbase, o_list, o_cnt, lstride, tv, ti)
        # Barrier: the ranking reads every group score of the token.
        cuda.syncthreads()
        lane_keep_groups(smem, smem_i32, valid, lane, lanes, num_groups, group_topk, gbase, kbase)
        # Barrier: the expert scan reads the kept flags of every group.
        cuda.syncthreads()
    n = lane_scan_experts(smem, smem_i32, row, valid, lane, lanes, num_experts, topk, grouped, gsize, kbase, d, base)
    smem_i32[o_cnt + tid] = n
    tree_merge_lists(smem, smem_i32, d, o_list, o_cnt, lstride, tid, lane, log2_lanes(lanes), topk, tv, ti)
