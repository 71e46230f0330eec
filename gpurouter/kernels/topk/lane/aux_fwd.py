"""The W-lane aux-score forward kernel (``compute_aux_scores=True``): K >
``TokenTiling.max_topk`` or E not a multiple of 4 (the other shapes take
``token_aux_scores_fwd.py``); launched by
``aux_scores.score_for_aux_loss_fwd_plan``.  The tiling and the row phases of
``lane_topk_fwd.py`` (``topk/lane/rows``, ``topk/lane/lists``): a block owns TB
tokens of W lanes each, a padded fp32 tile of them in shared memory; W lanes
per token for the row statistics and the selection, all threads for the
coalesced loads and stores.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from ..._base.parallel import recipe

# isort: split

import functools

from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import int32 as nb_i32
from numba import uint8 as nb_u8

from ..._base.device import SOFTMAX
from .lists import lane_select
from .rows import flat_next, flat_walk, lane_stager, normalise_rows, pack_flags, row_stats


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def lane_aux_scores_fwd_kernel(kind: str, list_cap: int, bitmap: bool = False, indices: bool = False):
    """The W-lane aux-score forward; ``bitmap`` (compile-time): the routing map
    is BITMAP_U8 (``topk/lane/rows.pack_flags``), else the bool map; ``indices``
    (compile-time): lane-0's list (the selection order) into ``xarr``
    (``[T, K]`` int32; never read otherwise)."""
    stage = lane_stager(kind)

    @cuda.jit
    def lane_aux_scores_fwd(
        logits,  # [T, E] kind
        scores,  # [T, E] fp32, out
        routing_map,  # [T, E] bool (bitmap: [T, ceil(E/8)] uint8), out
        saved,  # [T, E] fp32, out: softmax p / sigmoid a / raw x (sqrtsoftplus)
        topk,
        score_fn,
        tile_tokens,  # TB, tokens per block
        lanes,  # W, threads per token
        stride,  # P, tile row stride (words)
        lstride,  # LS, per-lane list stride (words)
        o_list,  # word offsets of the layout (tiling.select_layout, no groups)
        o_idx,
        o_cnt,
        o_flag,  # byte offset of the flags
        xarr,  # [T, K] int32, out (``indices``; else unused)
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
        nt = min(tile_tokens, num_tokens - t0)
        tok = tid // lanes
        lane = tid - tok * lanes
        valid = tok < nt
        row = tok * stride
        softmax = score_fn == SOFTMAX

        # Phase 1 (all threads, coalesced): x -> activation (or x for softmax).
        stage(logits, saved[0], saved, smem, flags, o_flag, t0, nt, stride, score_fn, False, tid,
              nthreads)
        # Phase 2 (W lanes per token): softmax max and sum, or sum_all v.
        row_stats(smem, o_list, row, valid, num_experts, tid, lane, lanes, nthreads, softmax)
        # Phase 3 (all threads, coalesced): the scores, in place and to memory.
        normalise_rows(smem, o_list, scores, saved, softmax, t0, nt, num_experts, stride, lanes,
                   tid, nthreads, softmax)
        # Phase 4 (W lanes per token): plain top-K of the scores, then lane
        # q flags list entries q, q + W, ...
        lane_select(smem, smem_i32, row, tok, valid, lane, tid, lanes, num_experts, topk, False, 1, -1,
                1, o_list, o_idx, o_cnt, 0, 0, lstride, tv, ti)
        if valid:
            lead = o_idx + (tid - lane) * lstride
            for q in range(lane, topk, lanes):
                flags[o_flag + row + smem_i32[lead + q]] = 1
                if indices:
                    xarr[t0 + tok, q] = smem_i32[lead + q]
        # Barrier: phase 5 reads the flags.
        cuda.syncthreads()

        # Phase 5 (all threads, coalesced): the routing map.
        if bitmap:
            pack_flags(flags, o_flag, routing_map, t0, nt, num_experts, stride, tid, nthreads)
        else:
            t, j, dt, dj = flat_walk(tid, nthreads, num_experts)
            while t < nt:
                routing_map[t0 + t, j] = flags[o_flag + t * stride + j] != 0
                t, j = flat_next(t, j, dt, dj, num_experts)

    return lane_aux_scores_fwd
