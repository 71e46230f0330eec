"""The W-lane top-k forward kernel: K > ``TokenTiling.max_topk`` or E not a
multiple of 4 (the other shapes take ``token_topk_fwd.py``); launched by
``topk.topk_with_score_function_fwd_plan``.

Decomposition (see docs/kernels.md): a token is owned by W lanes (threads),
a block by ``TB`` consecutive tokens, its shared memory a padded fp32 copy of
their scores ``[TB, P]`` plus a top-K list per lane (``tiling.RowLayout``).

1. All threads, coalesced: load logits (four per thread in flight), convert
   to fp32, apply the score function, write ``saved_scores``; clear the flags.
2. W lanes per token: group scores and ranks, a lane-strided scan into each
   lane's sorted top-K list, a tree merge across the lanes (log2 W barriers)
   (``topk/lane/lists.lane_select``); the weights, lane q taking the token's
   entries q, q + W, ...
3. All threads, coalesced: write ``probs`` and ``routing_map`` rows.

No warp intrinsics: shared memory and ``cuda.syncthreads()`` only, so the
same kernel runs on the GPU and on the CUDA simulator.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from ..._base.parallel import recipe

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import int32 as nb_i32
from numba import uint8 as nb_u8

from ..._base.access import loader_2d, storer_2d
from ..._base.device import EPS, NEG_INF, SOFTMAX, ZERO, activation, exp_f32
from .lists import lane_select
from .rows import flat_next, flat_walk, lane_stager, normalise_rows, pack_flags, row_stats


@cuda.jit(device=True)
def forced_list(smem_i32, xarr, t0, tok, valid, lane, tid, topk, num_experts, lead, d, o_cnt):
    """The routing replay: lane 0 lists the token's forced experts ``xarr[t0 +
    tok]`` in order (outside [0, E): skipped; a repeat: once); returns the
    list's length (every lane of a live token).  Ends with a barrier."""
    cnt = topk
    if valid and lane == 0:
        n = 0
        for a in range(topk):
            j = xarr[t0 + tok, a]
            ok = j >= 0 and j < num_experts
            if ok:
                for b in range(n):
                    if smem_i32[lead + d + b] == j:
                        ok = False
            if ok:
                smem_i32[lead + d + n] = j
                n += 1
        smem_i32[o_cnt + tid] = n
    cuda.syncthreads()
    if valid:
        cnt = smem_i32[o_cnt + tid - lane]
    return cnt


@cuda.jit(device=True)
def topk_normaliser(smem, lead, cnt, topk, score_fn, post_softmax):
    """The token's normaliser from its K listed scores, the same fixed order in
    every lane: post-softmax ``(max, sum exp(v - max))``; sigmoid /
    sqrtsoftplus with K > 1 ``sum v + 1e-20``; else unused."""
    m = NEG_INF
    total = ZERO
    if post_softmax:
        for q in range(cnt):
            if smem[lead + q] > m:
                m = smem[lead + q]
        for q in range(cnt):
            total += exp_f32(smem[lead + q] - m)
    elif score_fn != SOFTMAX and topk > 1:
        for q in range(cnt):
            total += smem[lead + q]
        total = np.float32(total + EPS)
    return m, total


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def lane_topk_fwd_kernel(kind: str, list_cap: int, bitmap: bool = False, indices: bool = False,
                     forced: bool = False):
    """The forward kernel for logits of ``kind``; ``list_cap`` >= K sizes the merge
    scratch; ``bitmap`` (compile-time): the routing map is BITMAP_U8
    (``pack_flags``), else the bool map.  ``indices`` (compile-time): lane-0's
    list, which is the selection order, goes to ``xarr`` (``[T, K]`` int32);
    ``forced`` (the routing replay; no bias, no groups): no selection, the
    list is ``xarr``'s row in its order (outside [0, E): skipped; a repeat:
    once), so the weights' sums run in the order a normal call that
    returned these indices used.  Otherwise ``xarr`` is never read."""
    load = loader_2d(kind)
    store = storer_2d(kind)
    stage = lane_stager(kind)

    @cuda.jit
    def lane_topk_fwd(
        logits,  # [T, E] kind
        bias,  # [E] fp32 (any [E] fp32 array when has_bias is False; never read then)
        probs,  # [T, E] kind, out
        routing_map,  # [T, E] bool (bitmap: [T, ceil(E/8)] uint8), out
        saved,  # [T, E] fp32, out
        topk,  # K
        score_fn,  # score-function code
        pre_softmax,  # use_pre_softmax (softmax only)
        has_bias,
        num_groups,  # G (grouping on iff group_topk > 0)
        group_topk,  # Kg
        scale,  # fp32 scaling_factor
        tile_tokens,  # TB, tokens per block
        lanes,  # W, threads per token (power of two)
        stride,  # P, tile row stride (words)
        lstride,  # LS, per-lane list stride (words)
        group_lanes,  # lanes per group in the group-score pass
        o_list,  # word offsets of the layout (tiling.select_layout)
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
        smem_i32 = cuda.shared.array(0, nb_i32)
        flags = cuda.shared.array(0, nb_u8)
        tv = cuda.local.array(list_cap, nb_f32)
        ti = cuda.local.array(list_cap, nb_i32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)  # tokens of this (maybe partial) tile
        tok = tid // lanes  # this thread's token in the tile, lane within the token
        lane = tid - tok * lanes
        valid = tok < nt
        row = tok * stride
        post_softmax = score_fn == SOFTMAX and not pre_softmax

        # Phase 1 (all threads, coalesced): r = s (+ bias) into the tile.
        stage(logits, bias, saved, smem, flags, o_flag, t0, nt, stride, score_fn, has_bias, tid,
              nthreads)
        if score_fn == SOFTMAX and pre_softmax:
            # softmax over all E first: lane partials of max and sum, then
            # all threads normalise in place and write saved.
            row_stats(smem, o_list, row, valid, num_experts, tid, lane, lanes, nthreads, True)
            normalise_rows(smem, o_list, saved, saved, False, t0, nt, num_experts, stride, lanes,
                       tid, nthreads, True)

        # Phase 2 (W lanes per token): selection into the token's lane-0 list.
        lead = o_list + (tid - lane) * lstride
        d = o_idx - o_list
        cnt = topk
        if forced:
            # the replay: lane 0 lists the token's forced experts, in order
            cnt = forced_list(smem_i32, xarr, t0, tok, valid, lane, tid, topk, num_experts, lead, d, o_cnt)
        else:
            lane_select(smem, smem_i32, row, tok, valid, lane, tid, lanes, num_experts, topk,
                    group_topk > 0, num_groups, group_topk, group_lanes, o_list, o_idx, o_cnt,
                    o_grp, o_keep, lstride, tv, ti)

        # Weights, gathered from the UNBIASED scores s (no (s + b) - b): lane
        # q takes list entries q, q + W, ...; first replace each list value by
        # s (the tile holds r = s + b with a bias: recompute s from the logit),
        if valid:
            for q in range(lane, cnt, lanes):
                j = smem_i32[lead + d + q]
                if indices:
                    xarr[t0 + tok, q] = j
                if has_bias:
                    s = activation(load(logits, t0 + tok, j), score_fn)
                else:
                    s = smem[row + j]
                smem[lead + q] = s
        # Barrier: every lane reads the token's K scores.
        cuda.syncthreads()
        # then every lane computes the token's normaliser from the K values
        # (the same fixed order in every lane) and writes its weights into
        # the tile row (read no more) with the flags.
        if valid:
            m, total = topk_normaliser(smem, lead, cnt, topk, score_fn, post_softmax)
            for q in range(lane, cnt, lanes):
                w = smem[lead + q]
                if post_softmax:
                    w = np.float32(exp_f32(w - m) / total)
                elif score_fn != SOFTMAX and topk > 1:
                    w = np.float32(w / total)
                j = smem_i32[lead + d + q]
                smem[row + j] = w
                flags[o_flag + row + j] = 1
        # Barrier: phase 3 reads flags and weights of every token.
        cuda.syncthreads()

        # Phase 3 (all threads, coalesced): probs, routing_map, and saved for
        # post-softmax (-inf at unselected, the selected-set softmax at selected).
        t, j, dt, dj = flat_walk(tid, nthreads, num_experts)
        while t < nt:
            off = t * stride + j
            sel = flags[o_flag + off] != 0
            w = smem[off]
            if not bitmap:
                routing_map[t0 + t, j] = sel
            if sel:
                store(probs, t0 + t, j, np.float32(scale * w))
            else:
                store(probs, t0 + t, j, ZERO)
            if post_softmax:
                saved[t0 + t, j] = w if sel else NEG_INF
            t, j = flat_next(t, j, dt, dj, num_experts)
        if bitmap:
            pack_flags(flags, o_flag, routing_map, t0, nt, num_experts, stride, tid, nthreads)

    return lane_topk_fwd
