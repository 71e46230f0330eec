"""The thread-per-token aux-score forward kernel (``compute_aux_scores=True``):
K <= ``TokenTiling.max_topk`` and E a multiple of 4 (the other shapes take
``lane_aux_scores_fwd.py``); launched by
``aux_scores.score_for_aux_loss_fwd_plan``.  The same tile, selection and
phases as ``token_topk_fwd.py`` with no groups, no bias, no scaling: the
scores over all E (softmax, or sigmoid / sqrtsoftplus normalised by the
row's sum) and the plain top-K of them as the routing map.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from ..._base.parallel import recipe

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import uint32 as nb_u32

from ..._base.device import EPS, ONE, SOFTMAX, u32, u64
from ..._base.vec import quad_f32
from .rows import flat_next_i32, flat_walk_i32, octet_walk, quad_flags, quad_nibble, softmax_rows, token_stager
from .select import token_selector


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def token_aux_scores_fwd_kernel(kind: str, topk: int, score_fn: int, bitmap: bool = False, indices: bool = False):
    """The aux-score forward for logits of ``kind``; K (``topk``), the score
    function and the map format (``bitmap``: BITMAP_U8) are compile-time
    constants; ``indices``: the top-K in selection order into ``xarr``
    (``[T*K]`` int32; never read otherwise)."""
    softmax = score_fn == SOFTMAX
    stage = token_stager(kind, score_fn, False)
    # softmax: select on the normalised tile; sigmoid / sqrtsoftplus: one
    # scan of the raw row gives its sum and the (scaled) list
    token_select = token_selector(topk, 0, False, False, not softmax, indices)
    stats, normalise = softmax_rows()
    store_f32 = quad_f32()[1]

    @cuda.jit(device=True)
    def scores_quad(scores, smem, w, base, inv):
        """The quad's scores (sigmoid / sqrtsoftplus: the tile times ``inv``,
        written to ``scores``)."""
        p0 = smem[u32(base)]
        p1 = smem[u32(base + 1)]
        p2 = smem[u32(base + 2)]
        p3 = smem[u32(base + 3)]
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
        thr = smem[u32(o_thr + t)]
        cut = np.int32(bits[u32(o_thr + tile_tokens + t)])
        inv = ONE if softmax else smem[u32(o_red + tile_tokens + t)]
        fword = o_flag + t * fstride
        q = np.int32(2 * o)
        p0, p1, p2, p3 = scores_quad(scores, smem, wb + np.int32(t * eq + q), np.int32(t * stride + 4 * q), inv)
        byte = quad_nibble(p0, p1, p2, p3, q, thr, cut, bits, fword)
        q = np.int32(q + 1)
        if q < eq:
            p0, p1, p2, p3 = scores_quad(scores, smem, wb + np.int32(t * eq + q), np.int32(t * stride + 4 * q), inv)
            byte |= np.uint32(quad_nibble(p0, p1, p2, p3, q, thr, cut, bits, fword) << np.uint32(4))
        routing_map[u64(mb + np.int32(t * nb + o))] = np.uint8(byte)

    @cuda.jit
    def token_aux_scores_fwd(
        logits,  # [T, E] kind, flat (bf16: [T*E/4] uint64)
        scores,  # [T*E] fp32, out
        routing_map,  # out: [T*E/4] uint32 over the [T, E] bool map; bitmap: [T*ceil(E/8)] uint8
        saved,  # [T*E] fp32, out: softmax p / sigmoid a / raw x (sqrtsoftplus)
        num_tokens,
        num_experts,
        tile_tokens,  # TB
        stride,  # P
        o_flag,  # word offsets (tiling.token_layout, no groups)
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
        fstride = np.int32(((num_experts + 31) >> 5) | 1)  # tiling.token_flag_stride
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
            total, _, thr, cut = token_select(smem, row, num_experts, 1, 0, 0, 0, bits, o_flag + tid * fstride,
                                              xarr, (t0 + tid) * topk, 0)
            if not softmax:
                smem[u32(o_red + tile_tokens + tid)] = np.float32(ONE / np.float32(total + EPS))
            smem[u32(o_thr + tid)] = thr
            bits[u32(o_thr + tile_tokens + tid)] = np.uint32(cut)
        # Barrier: phase 3 reads every token's statistics, threshold and bits.
        cuda.syncthreads()
        # 3. All threads: (sigmoid / sqrtsoftplus: the scores, times the
        # reciprocal the selection used;) the map.
        if bitmap:
            # An octet (two quads) per step, its map byte assembled in a
            # register and stored by this thread alone; a warp takes 4 octets
            # of 8 tokens (see token_topk_fwd_kernel).
            nb = np.int32((eq + 1) >> 1)
            mb = t0 * nb
            lt, lo, ngroups, nchunks, g, c, dg, dc = octet_walk(tid, nthreads, nt, nb)
            while g < ngroups:
                t = np.int32(8 * g + lt)
                o = np.int32(4 * c + lo)
                if (t < nt) & (o < nb):
                    octet(scores, routing_map, smem, bits, t, o, wb, eq, nb, mb, stride, o_thr, o_flag, fstride,
                          o_red, tile_tokens)
                g, c = flat_next_i32(g, c, dg, dc, nchunks)
        else:
            # A quad per step: the flag word is the quad's map word.
            t, q, dt, dq = flat_walk_i32(tid, nthreads, eq)
            while t < nt:
                w = wb + np.int32(t * eq + q)
                base = np.int32(t * stride + 4 * q)
                p0 = smem[u32(base)]
                p1 = smem[u32(base + 1)]
                p2 = smem[u32(base + 2)]
                p3 = smem[u32(base + 3)]
                if not softmax:
                    inv = smem[u32(o_red + tile_tokens + t)]
                    p0 = np.float32(p0 * inv)
                    p1 = np.float32(p1 * inv)
                    p2 = np.float32(p2 * inv)
                    p3 = np.float32(p3 * inv)
                    store_f32(scores, w, p0, p1, p2, p3)
                routing_map[u64(w)] = quad_flags(p0, p1, p2, p3, q, smem[u32(o_thr + t)],
                                                 np.int32(bits[u32(o_thr + tile_tokens + t)]), bits,
                                                 o_flag + t * fstride)
                t, q = flat_next_i32(t, q, dt, dq, eq)

    return token_aux_scores_fwd
