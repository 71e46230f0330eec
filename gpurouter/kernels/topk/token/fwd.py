"""The thread-per-token top-k forward kernel: K <= ``TokenTiling.max_topk``
and E a multiple of 4 (every model preset, Nemotron's K=22 included; the other
shapes take ``lane_topk_fwd.py``); launched by
``topk.topk_with_score_function_fwd_plan`` when ``tiling.token_path`` says so.

Why one thread per token (lab/journal/benchmarks.md): the W-lane kernels spend
their time in the selection, a few thousand warp instructions per token
(shared-memory lists, tree merges, a barrier per merge level).  Here a
token's whole selection is one thread's serial scan of its tile row, its
top-K list in registers and updated without branches (the 32 threads of a
warp scan 32 independent rows: any data-dependent branch would diverge).

Decomposition: a block owns TB tokens and ``threads >= TB`` threads; its
shared memory holds the fp32 tile of the tokens' scores (row stride
``P = E | 1``: odd, so the per-thread row scans hit 32 distinct banks), a
selection bit per expert (written by the bit way only), the group scores,
per-row statistics and thresholds, and the expert bias (``tiling.TokenLayout``).
Global arrays are seen flat (``_base/access.array_views``); fp32 rows are read and
written a quad (16 bytes) at a time (``_base/vec``).

1. All threads, coalesced, four experts (a quad) per step, four quads in
   flight (bf16 logits as one 8-byte load per quad): the score function,
   ``saved``, the tile; the bias (``topk/token/rows.token_stager``).
2. Thread t (t < TB), tile row t: (group scores, group ranks,) the K + 1
   largest scores; the K-th is the threshold.  Then one of two ways to say
   which experts are selected (``topk/token/select``: the threshold way or the
   bit way); the weights' statistics into shared memory.
3. All threads, coalesced, a quad per step: the quad's four selection flags
   are its ``routing_map`` word (one 4-byte store); the weights, ``probs``
   (bf16: one 8-byte store), ``saved`` for post-softmax.  A BITMAP_U8 map
   (``bitmap``, a compile-time constant): an octet (two quads) per step, a
   warp on 4 octets of 8 tokens, the map byte assembled in a register and
   stored by its thread alone (bf16 probs: one 16-byte store per octet).

K, the score function, bias and softmax order are compile-time constants.
No warp intrinsics: the kernel runs on the CUDA simulator too.
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
from numba import int64 as nb_i64
from numba import uint32 as nb_u32

from ..._base.access import bf16_quad, flat_io
from ..._base.device import B0, B1, B2, B3, EPS, N0, N1, N2, N3, NEG_INF, ONE, SOFTMAX, ZERO, exp_f32, u32, u64
from ..._base.launch import BF16, kernel_jit
from ..._base.vec import pair_u64, quad_f32
from .chunk_lanes import lane_selector
from .rows import (
    flat_next_i32,
    flat_walk_i32,
    lane_softmax_stats,
    octet_walk,
    quad_flags,
    quad_nibble,
    softmax_rows,
    token_stager,
)
from .select import token_group_lists, token_selector


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def token_topk_fwd_kernel(kind: str, topk: int, group_cap: int, score_fn: int, has_bias: bool, use_pre_softmax: bool,
                    bitmap: bool = False, indices: int = 0, forced: bool = False, asc: bool = False,
                    max_registers: int = 0, group_lanes: int = 0):
    """The top-k forward for logits of ``kind``; ``topk`` (K) and ``group_cap`` >=
    K / Kg (0: no groups; a power of two) size the register lists; the score
    function, the bias, ``use_pre_softmax`` (softmax only) and the map format
    (``bitmap``: BITMAP_U8, else the bool map) are compile-time constants.
    ``indices``: the selected experts in selection order into ``xarr``
    (``[T*K]`` int32), written by each token's thread as it selects, from a
    hit list in local memory (1) or packed in a register (2: E <= 256, K <=
    8; ``topk/token/scans.token_scans``);
    ``forced`` (the routing replay, no bias, no groups): ``xarr`` holds the
    experts, and ``asc`` says that the replayed call had a bias (its weights'
    sum runs in ascending expert order: ``token_selector``).  Without them
    ``xarr`` is never read.  ``max_registers`` (0: the compiler's choice;
    ignored on the simulator): a register cap, so that the indices' live
    values do not cost resident blocks.  ``group_lanes`` (not ``forced``;
    ``tiling.token_lanes``): the chunk lanes select, a lane per group (or
    chunk of experts) of a token, its thread merging their lists (1) or the
    lanes merging them in a tree (2) (``topk/token/chunk_lanes.py``)."""
    stage = token_stager(kind, score_fn, has_bias, int(group_lanes) >= 2)
    _, store4, zero4 = flat_io(kind)
    store_f32 = quad_f32()[1]
    lanes = int(group_lanes)  # 1: the grouped lanes; 2, 3: the chunk lanes (3: with their tree)
    chunk_lanes = lanes >= 2
    token_select = token_selector(topk, group_cap, has_bias, score_fn == SOFTMAX and not use_pre_softmax, False,
                                  int(indices), forced, asc, lanes == 1)
    group_lists = token_group_lists(topk, group_cap, has_bias)
    list_words = topk + 1  # a group's list (the grouped lanes)
    lists, rank, merge, keys_of, masks, finish, area = lane_selector(
        topk, group_cap, has_bias, score_fn == SOFTMAX and not use_pre_softmax, int(indices), lanes == 3)
    hit_t = nb_i64 if int(indices) == 2 else nb_i32
    list_len = topk + 1  # the token's register list (a plain constant: a local array's size)
    stats, normalise = softmax_rows(chunk_lanes and score_fn == SOFTMAX and use_pre_softmax)
    lane_stats = lane_softmax_stats()
    pre_softmax = score_fn == SOFTMAX and use_pre_softmax
    post_softmax = score_fn == SOFTMAX and not use_pre_softmax
    norm = score_fn != SOFTMAX and topk > 1

    @cuda.jit(device=True)
    def weight(v, m, inv):
        """The routing weight of a selected expert of tile value ``v``; ``inv``:
        1 / the token's sum (a product instead of a division: within one ulp)."""
        if post_softmax:
            return np.float32(exp_f32(v - m) * inv)
        if norm:
            return np.float32(v * inv)
        return v

    @cuda.jit(device=True)
    def put_word(probs, saved, smem, w, fw, v0, v1, v2, v3, t, o_red, tile_tokens, scale):
        """BYTEMAP: quad ``w``'s probs (and, post-softmax, saved) from its tile
        values and its map word ``fw``."""
        w0 = w1 = w2 = w3 = ZERO
        m0 = m1 = m2 = m3 = False
        if fw == 0:  # most quads: nothing selected, nothing to convert
            zero4(probs, w)
        else:
            inv = smem[u32(o_red + t)]
            m = smem[u32(o_red + tile_tokens + t)]
            m0 = fw & B0 != 0
            m1 = fw & B1 != 0
            m2 = fw & B2 != 0
            m3 = fw & B3 != 0
            w0 = weight(v0, m, inv) if m0 else ZERO
            w1 = weight(v1, m, inv) if m1 else ZERO
            w2 = weight(v2, m, inv) if m2 else ZERO
            w3 = weight(v3, m, inv) if m3 else ZERO
            store4(probs, w, np.float32(scale * w0), np.float32(scale * w1),
                   np.float32(scale * w2), np.float32(scale * w3))
        if post_softmax:
            store_f32(saved, w, w0 if m0 else NEG_INF, w1 if m1 else NEG_INF,
                      w2 if m2 else NEG_INF, w3 if m3 else NEG_INF)

    @cuda.jit(device=True)
    def octet_quad(smem, t, q, stride, o_bias, thr, cut, bits, fword):
        """BITMAP_U8: quad ``q`` of tile token ``t``: ``(nibble, v0..v3)``, its
        four flags (bit i: expert 4q + i) and tile values."""
        base = np.int32(t * stride + 4 * q)
        v0 = smem[u32(base)]
        v1 = smem[u32(base + 1)]
        v2 = smem[u32(base + 2)]
        v3 = smem[u32(base + 3)]
        r0, r1, r2, r3 = v0, v1, v2, v3
        if has_bias:
            ob = np.int32(o_bias + 4 * q)
            r0 = np.float32(v0 + smem[u32(ob)])
            r1 = np.float32(v1 + smem[u32(ob + 1)])
            r2 = np.float32(v2 + smem[u32(ob + 2)])
            r3 = np.float32(v3 + smem[u32(ob + 3)])
        return quad_nibble(r0, r1, r2, r3, q, thr, cut, bits, fword), v0, v1, v2, v3

    @cuda.jit(device=True)
    def quad_weights(saved, w, nib, v0, v1, v2, v3, m, inv):
        """BITMAP_U8: a quad's weights (0 where unselected), computed without a
        branch (a warp's lanes nearly always include a selected quad, so a
        branch would run both ways); post-softmax, its saved written."""
        w0 = weight(v0, m, inv) if nib & N0 != 0 else ZERO
        w1 = weight(v1, m, inv) if nib & N1 != 0 else ZERO
        w2 = weight(v2, m, inv) if nib & N2 != 0 else ZERO
        w3 = weight(v3, m, inv) if nib & N3 != 0 else ZERO
        if post_softmax:
            store_f32(saved, w, w0 if nib & N0 != 0 else NEG_INF, w1 if nib & N1 != 0 else NEG_INF,
                      w2 if nib & N2 != 0 else NEG_INF, w3 if nib & N3 != 0 else NEG_INF)
        return w0, w1, w2, w3

    @cuda.jit(device=True)
    def probs_quad(probs, w, nib, w0, w1, w2, w3, scale):
        if nib == 0:
            zero4(probs, w)
        else:
            store4(probs, w, np.float32(scale * w0), np.float32(scale * w1), np.float32(scale * w2),
                   np.float32(scale * w3))

    if kind == BF16:
        pair_store = pair_u64()

        @cuda.jit(device=True)
        def probs_octet(probs, w, mi, paired, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3, scale):
            """The octet's probs: (bf16, E % 8 == 0) its eight words in one
            16-byte store, index ``mi`` (the map byte's), converted without a
            branch (an octet with nothing selected scales by 0: +0.0, the
            zeros a quad with nothing selected stores), or a quad at a time."""
            if paired:
                sq = scale if (n0 | n1) != 0 else ZERO
                pair_store(probs, mi, bf16_quad(np.float32(sq * a0), np.float32(sq * a1),
                                                np.float32(sq * a2), np.float32(sq * a3)),
                           bf16_quad(np.float32(sq * b0), np.float32(sq * b1),
                                     np.float32(sq * b2), np.float32(sq * b3)))
            else:
                probs_quad(probs, w, n0, a0, a1, a2, a3, scale)
                if two:
                    probs_quad(probs, w + 1, n1, b0, b1, b2, b3, scale)

    else:

        @cuda.jit(device=True)
        def probs_octet(probs, w, mi, paired, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3, scale):
            probs_quad(probs, w, n0, a0, a1, a2, a3, scale)
            if two:
                probs_quad(probs, w + 1, n1, b0, b1, b2, b3, scale)

    @cuda.jit(device=True)
    def octet(probs, saved, routing_map, smem, bits, t, o, wb, eq, nb, mb, paired, stride, o_bias, o_thr, o_flag,
              fstride, o_red, tile_tokens, scale):
        """BITMAP_U8: octet ``o`` (quads 2o, 2o + 1) of tile token ``t``: its
        weights and its map byte, assembled here and stored by this thread
        alone."""
        thr = smem[u32(o_thr + t)]
        cut = np.int32(bits[u32(o_thr + tile_tokens + t)])
        inv = smem[u32(o_red + t)]
        m = smem[u32(o_red + tile_tokens + t)]
        fword = np.int32(o_flag + t * fstride)
        q = np.int32(2 * o)
        w = wb + np.int32(t * eq + q)
        n0, v0, v1, v2, v3 = octet_quad(smem, t, q, stride, o_bias, thr, cut, bits, fword)
        a0, a1, a2, a3 = quad_weights(saved, w, n0, v0, v1, v2, v3, m, inv)
        n1 = np.uint32(0)
        b0 = b1 = b2 = b3 = ZERO
        two = q + 1 < eq
        if two:
            n1, v0, v1, v2, v3 = octet_quad(smem, t, np.int32(q + 1), stride, o_bias, thr, cut, bits, fword)
            b0, b1, b2, b3 = quad_weights(saved, w + 1, n1, v0, v1, v2, v3, m, inv)
        mi = mb + np.int32(t * nb + o)
        routing_map[u64(mi)] = np.uint8(n0 | np.uint32(n1 << np.uint32(4)))
        probs_octet(probs, w, mi, paired, two, n0, a0, a1, a2, a3, n1, b0, b1, b2, b3, scale)

    @cuda.jit(device=True)
    def put_stats(smem, bits, tid, tile_tokens, o_red, o_thr, total, m, thr, cut):
        """The token's weights' statistics and selection rule, for phase 3."""
        if norm:
            total = np.float32(total + EPS)
        smem[u32(o_red + tid)] = np.float32(ONE / total)  # phase 3 multiplies
        smem[u32(o_red + tile_tokens + tid)] = m
        smem[u32(o_thr + tid)] = thr
        bits[u32(o_thr + tile_tokens + tid)] = np.uint32(cut)

    @kernel_jit(max_registers)
    def token_topk_fwd(
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
        o_flag,  # word offsets (tiling.token_layout)
        o_gs,
        o_red,
        o_thr,
        o_bias,
        xarr,  # [T*K] int32: indices out (``indices``), forced in (``forced``); else unused
        o_lists,  # word offset of the groups' lists (``group_lanes``; else unused)
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
        fstride = np.int32(((num_experts + 31) >> 5) | 1)  # tiling.token_flag_stride
        wb = t0 * eq  # the tile's first quad (int64)

        # 1. All threads: s (the bias into shared memory), saved.
        stage(logits, bias, saved, smem, o_bias, wb, nt, eq, stride, tid, nthreads)
        if pre_softmax:
            # softmax over all E first (max and sum by the row's thread, or
            # its lanes), then all threads normalise in place and write saved.
            if chunk_lanes:
                lane_stats(smem, tid, nthreads, nt, tile_tokens, stride, num_experts, o_lists,
                           area(num_experts, num_groups), o_red)
            else:
                stats(smem, row, valid, num_experts, o_red + tid, o_red + tile_tokens + tid)
            normalise(smem, o_red, tile_tokens, saved, saved, False, wb, nt, eq, stride, tid, nthreads)

        if chunk_lanes:  # 2, the chunk lanes (``topk/token/chunk_lanes.py``): barriers between the phases
            lists(smem, tid, nthreads, nt, tile_tokens, stride, o_bias, num_experts, num_groups, group_topk, o_gs,
                  o_lists)
            cuda.syncthreads()
            rank(smem, bits, tid, nthreads, nt, tile_tokens, stride, num_experts, num_groups, group_topk, o_gs,
                 o_lists)
            cuda.syncthreads()
            merge(smem, bits, tid, nthreads, nt, tile_tokens, num_experts, num_groups, group_topk, o_lists)
            cuda.syncthreads()
            keys = cuda.local.array(list_len, nb_f32)
            sel = cuda.local.array(topk, hit_t)  # ``indices``: the hits, ascending, and their scores
            sel[0] = 0
            rv = cuda.local.array(topk, nb_f32)
            need = np.int32(0)
            total = ZERO
            n = np.int32(0)
            if valid:
                need, total, n = keys_of(smem, bits, tid, row, num_experts, num_groups, o_bias, o_lists,
                                         o_flag + tid * fstride, keys, sel, rv, o_thr + tid)
            cuda.syncthreads()
            masks(smem, bits, tid, nthreads, nt, tile_tokens, stride, o_bias, num_experts, num_groups, o_lists,
                  o_thr)
            cuda.syncthreads()
            if valid:
                total, m, thr, cut = finish(smem, bits, tid, row, num_experts, num_groups, o_bias, o_lists, keys,
                                            need, total, n, sel, rv, xarr, (t0 + tid) * topk)
                put_stats(smem, bits, tid, tile_tokens, o_red, o_thr, total, m, thr, cut)
        else:
            if lanes == 1:  # 2a. the grouped lanes: G lanes a token, its groups' scores and lists
                group_lists(smem, tid, nthreads, nt, tile_tokens, stride, o_bias, num_experts, num_groups,
                            group_topk, o_gs, o_lists)
                cuda.syncthreads()
            # 2. Thread per token: selection, then the weights' statistics:
            # post-softmax the max and sum exp(s - max) of the selected scores,
            # normalised the sum of the selected scores + eps.  (Selection reads
            # s + bias; the weights, s itself.)
            if valid:
                total, m, thr, cut = token_select(smem, row, num_experts, num_groups, group_topk,
                                                  o_gs + tid * (num_groups | 1), o_bias, bits,
                                                  o_flag + tid * fstride, xarr, (t0 + tid) * topk,
                                                  o_lists + tid * num_groups * list_words)
                put_stats(smem, bits, tid, tile_tokens, o_red, o_thr, total, m, thr, cut)
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
            # (``octet_walk``): its 32 lanes' tile reads hit 32 banks.
            nb = np.int32((eq + 1) >> 1)
            mb = t0 * nb  # the tile's first map byte (int64)
            paired = (eq & 1) == 0
            lt, lo, ngroups, nchunks, g, c, dg, dc = octet_walk(tid, nthreads, nt, nb)
            while g < ngroups:
                t = np.int32(8 * g + lt)
                o = np.int32(4 * c + lo)
                if (t < nt) & (o < nb):
                    octet(probs, saved, routing_map, smem, bits, t, o, wb, eq, nb, mb, paired, stride, o_bias,
                          o_thr, o_flag, fstride, o_red, tile_tokens, scale)
                g, c = flat_next_i32(g, c, dg, dc, nchunks)
        else:
            # A quad per step: the quad's four flags are one word, which is
            # also its routing-map word.
            t, q, dt, dq = flat_walk_i32(tid, nthreads, eq)
            while t < nt:
                w = wb + np.int32(t * eq + q)
                base = np.int32(t * stride + 4 * q)
                v0 = smem[u32(base)]
                v1 = smem[u32(base + 1)]
                v2 = smem[u32(base + 2)]
                v3 = smem[u32(base + 3)]
                r0, r1, r2, r3 = v0, v1, v2, v3
                if has_bias:  # the selection's scores: s + bias
                    r0 = np.float32(v0 + smem[u32(o_bias + 4 * q)])
                    r1 = np.float32(v1 + smem[u32(o_bias + 4 * q + 1)])
                    r2 = np.float32(v2 + smem[u32(o_bias + 4 * q + 2)])
                    r3 = np.float32(v3 + smem[u32(o_bias + 4 * q + 3)])
                thr = smem[u32(o_thr + t)]
                fw = quad_flags(r0, r1, r2, r3, q, thr, np.int32(bits[u32(o_thr + tile_tokens + t)]), bits,
                                o_flag + t * fstride)
                routing_map[u64(w)] = fw
                put_word(probs, saved, smem, w, fw, v0, v1, v2, v3, t, o_red, tile_tokens, scale)
                t, q = flat_next_i32(t, q, dt, dq, eq)

    return token_topk_fwd
