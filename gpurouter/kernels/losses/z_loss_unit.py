"""The router z-loss's *unit* kernels (the rows kernel of the forward and the
backward; ``z_loss.py`` has their design in its docstring, the launchers and
the plans): rows that are no whole number of 16-byte vectors, or too long
for ``z_loss_vec.py`` (``tiling.z_loss_vec_tiling``)."""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools
import math

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types

from .._base.access import flat_io, storer_2d
from .._base.device import NEG_INF, ZERO, fmax_f32, u64
from .logsumexp import (
    backward_row,
    exp2_term,
    held_unit_loader,
    lse_of_saved,
    merge_max_sum,
    rescale_sum,
    saved_pair,
    shift_of,
    softmax_term,
    unit_fetchers,
)
from .mask_bits import all_ones_if, keep_if
from .z_io import keep_loader

# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------


@functools.cache
def z_loss_rows_kernel(kind: str, quads: bool, hold: int, has_mask: bool = False, count_valid: bool = False):
    """Kernel 1 of the forward: ``lse`` of every row and a partial sum of
    ``lse^2`` per block (see the module docstring).  ``has_mask``
    (compile-time): a bool ``mask [T]`` and a ``Counter`` ``count`` after
    ``partial``; a masked row's pair is saved but its square is not added;
    ``count_valid``: each block adds its valid rows to ``count[0]`` (integer
    atomics), which ``z_loss_final_counted_kernel`` takes (TB more words of
    dynamic shared memory)."""
    aligned, fetch_fast, fetch = unit_fetchers(kind, quads)
    load_fast = held_unit_loader(fetch_fast, hold)
    load_slow = held_unit_loader(fetch, hold)
    load_keep = keep_loader(has_mask)
    held_words = 4 * hold  # a compile-time constant (local array sizes must be)

    @cuda.jit(device=True)
    def run(logits, lse, partial, keep, count, num_tokens, num_experts, units, lanes, red, held):
        tid = np.int32(cuda.threadIdx.x)
        nthreads = np.int32(cuda.blockDim.x)
        w = np.int32(lanes)
        tok = np.int32(tid // w)
        lane = np.int32(tid - tok * w)
        tb = np.int32(nthreads // w)
        token = np.int64(cuda.blockIdx.x) * tb + tok
        live = token < num_tokens
        nu = np.int32(units)
        n = np.int32(num_experts)
        fast = aligned(logits)
        kept = load_keep(keep, min(token, num_tokens - 1))  # the row's mask byte, in flight with its units

        m = NEG_INF
        s = ZERO
        u0 = lane
        while live and u0 < nu:
            if fast:
                load_fast(held, logits, token, u0, w, nu, n)
            else:
                load_slow(held, logits, token, u0, w, nu, n)
            cm = NEG_INF
            for h in range(hold):
                if u0 + h * w < nu:
                    cm = fmax_f32(cm, fmax_f32(fmax_f32(held[4 * h], held[4 * h + 1]),
                                         fmax_f32(held[4 * h + 2], held[4 * h + 3])))
            if cm > m:  # a new max: rescale the sum
                s = rescale_sum(s, m, cm)
                m = cm
            sh2 = shift_of(m)  # an all -inf step so far: 2^(-inf - 0) = 0
            for h in range(hold):
                if u0 + h * w < nu:
                    e01 = np.float32(exp2_term(held[4 * h], sh2) + exp2_term(held[4 * h + 1], sh2))
                    e23 = np.float32(exp2_term(held[4 * h + 2], sh2) + exp2_term(held[4 * h + 3], sh2))
                    s = np.float32(s + np.float32(e01 + e23))
            u0 = np.int32(u0 + hold * w)

        # The lanes of a row, combined in a fixed pairing (log2 W levels).
        red[tid] = m
        red[nthreads + tid] = s
        span = np.int32(1)
        while span < w:  # W a power of two: lane % (2 span) == lane & (2 span - 1)
            # Barrier: this level reads the previous level's (or the lanes') pairs.
            cuda.syncthreads()
            if lane & (2 * span - 1) == 0:
                mm, ss = merge_max_sum(red[tid], red[nthreads + tid], red[tid + span],
                                red[nthreads + tid + span])
                red[tid] = mm
                red[nthreads + tid] = ss
            span = np.int32(2 * span)
        # Barrier: lane 0 reads the last level's pair.
        cuda.syncthreads()
        if lane == 0:
            rm = red[tid]
            rs = red[nthreads + tid]
            sm, sl = saved_pair(rm, rs, np.float32(math.log2(rs)) if rm != NEG_INF else ZERO)
            v = lse_of_saved(sm, sl)
            sq = ZERO
            if live:
                lse[u64(token)] = sm  # the saved (m, log2 s): stats [2T]
                lse[u64(num_tokens + token)] = sl
                if not has_mask or kept:
                    sq = np.float32(v * v)
            red[2 * nthreads + tok] = sq
            if count_valid:
                red[2 * nthreads + tb + tok] = np.float32(1) if live and kept else ZERO
        # The TB squares in a fixed-shape tree (pairs r, r + ceil(n/2)).
        o = 2 * nthreads
        k = tb
        while k > 1:
            # Barrier: this level reads the squares (or the previous level's sums).
            cuda.syncthreads()
            half = np.int32((k + 1) // 2)
            if tid < k - half:
                red[o + tid] = np.float32(red[o + tid] + red[o + tid + half])
            k = half
        if tid == 0:  # the last level's sum is thread 0's own (no barrier needed)
            partial[cuda.blockIdx.x] = red[o]
            if count_valid:  # the slots' counts (written before the tree's barriers; TB = 1: thread 0's own)
                c = ZERO
                for i in range(tb):
                    c += red[o + tb + i]
                cuda.atomic.add(count, 0, np.uint32(c))

    if has_mask:

        @cuda.jit
        def z_loss_rows_masked(logits, lse, partial, keep, count, num_tokens, num_experts, units, lanes):
            red = cuda.shared.array(0, nb_f32)
            held = cuda.local.array(held_words, nb_f32)
            run(logits, lse, partial, keep, count, num_tokens, num_experts, units, lanes, red, held)

        return z_loss_rows_masked

    @cuda.jit
    def z_loss_rows(
        logits,  # quads: [T*E] (bf16: [T*E/4] uint64) flat; else [T, E]; kind
        lse,  # [2T] fp32, out: each row's max m_t, then log2 s_t (logsumexp.saved_pair)
        partial,  # [>= grid] fp32, out: the block's sum of lse^2 (rows in order)
        num_tokens,
        num_experts,
        units,
        lanes,  # W; blockDim.x = TB * W
    ):
        red = cuda.shared.array(0, nb_f32)  # [2 * threads] lane (max, sum), then [TB] lse^2
        held = cuda.local.array(held_words, nb_f32)
        run(logits, lse, partial, lse, lse, num_tokens, num_experts, units, lanes, red, held)  # no mask read

    return z_loss_rows


# ----------------------------------------------------------------------------
# Backward: grad[t, e] = (g * 2 coeff / N) * lse_t * exp(x - lse_t)
# ----------------------------------------------------------------------------


@functools.cache
def z_loss_bwd_kernel(kind: str, quads: bool, hold: int, has_mask: bool = False):
    """The unit backward.  ``has_mask`` (compile-time): ``mask`` (bool ``[T]``)
    and ``n`` (fp32 ``[1]``) after ``grad_logits``, ``coeff`` in place of
    ``scale`` (``2 coeff / n`` on the device); masked rows get 0 (+0.0, a
    bitwise select on the values: their loads wait on no mask byte)."""
    aligned, fetch_fast, fetch = unit_fetchers(kind, quads)
    load_fast = held_unit_loader(fetch_fast, hold)
    load_slow = held_unit_loader(fetch, hold)
    load_keep = keep_loader(has_mask)
    held_words = 4 * hold  # a compile-time constant (local array sizes must be)
    if quads:
        store4 = flat_io(kind)[1]

        @cuda.jit(device=True)
        def put(a, t, u, units, n, v0, v1, v2, v3):
            store4(a, np.int64(t) * units + u, v0, v1, v2, v3)

    else:
        store = storer_2d(kind)

        @cuda.jit(device=True)
        def put1(a, t, j, n, v):
            if j < n:
                store(a, u64(t), u64(j), v)

        @cuda.jit(device=True)
        def put(a, t, u, units, n, v0, v1, v2, v3):
            j = 4 * u
            put1(a, t, j, n, v0)
            put1(a, t, j + 1, n, v1)
            put1(a, t, j + 2, n, v2)
            put1(a, t, j + 3, n, v3)

    @cuda.jit(device=True)
    def run(logits, lse, grad_loss, grad_logits, keep, num_tokens, num_experts, units, lanes, scale, held):
        tid = np.int32(cuda.threadIdx.x)
        w = np.int32(lanes)
        tok = np.int32(tid // w)
        lane = np.int32(tid - tok * w)
        token = np.int64(cuda.blockIdx.x) * np.int32(cuda.blockDim.x // w) + tok
        if token >= num_tokens:
            return
        nu = np.int32(units)
        n = np.int32(num_experts)
        fast = aligned(logits)
        v, sh, l2 = backward_row(lse[u64(token)], lse[u64(num_tokens + token)])
        a = np.float32(np.float32(grad_loss[0] * scale) * v)  # 0 on a dead row (v = 0)
        # has_mask: the row's mask byte loaded with its saved pair; a masked row's units are
        # loaded and computed as any row's (no branch for the loads to wait on) and stored as
        # +0.0 by a bitwise select, whatever they hold (NaN, inf)
        mk = all_ones_if(np.uint32(load_keep(keep, token)))
        u0 = lane
        while u0 < nu:
            if fast:
                load_fast(held, logits, token, u0, w, nu, n)
            else:
                load_slow(held, logits, token, u0, w, nu, n)
            for h in range(hold):
                u = np.int32(u0 + h * w)
                if u < nu:
                    o0 = np.float32(a * softmax_term(held[4 * h], sh, l2))
                    o1 = np.float32(a * softmax_term(held[4 * h + 1], sh, l2))
                    o2 = np.float32(a * softmax_term(held[4 * h + 2], sh, l2))
                    o3 = np.float32(a * softmax_term(held[4 * h + 3], sh, l2))
                    if has_mask:
                        o0 = keep_if(o0, mk)
                        o1 = keep_if(o1, mk)
                        o2 = keep_if(o2, mk)
                        o3 = keep_if(o3, mk)
                    put(grad_logits, token, u, nu, n, o0, o1, o2, o3)
            u0 = np.int32(u0 + hold * w)

    if has_mask:

        @cuda.jit
        def z_loss_bwd_masked(logits, lse, grad_loss, grad_logits, keep, n, num_tokens, num_experts, units, lanes,
                              coeff):
            held = cuda.local.array(held_words, nb_f32)
            scale = np.float32(np.float32(coeff / n[0]) * np.float32(2))  # the host plan's order
            run(logits, lse, grad_loss, grad_logits, keep, num_tokens, num_experts, units, lanes, scale, held)

        return z_loss_bwd_masked

    @cuda.jit
    def z_loss_bwd(
        logits,  # as in the forward
        lse,  # [2T] fp32: the forward's saved (m, log2 s)
        grad_loss,  # [1] fp32
        grad_logits,  # as logits (bf16 quads: [T*E/4] uint64), out
        num_tokens,
        num_experts,
        units,
        lanes,  # W; blockDim.x = TB * W
        scale,  # fp32: 2 coeff / N
    ):
        held = cuda.local.array(held_words, nb_f32)
        run(logits, lse, grad_loss, grad_logits, lse, num_tokens, num_experts, units, lanes, scale, held)  # no mask

    return z_loss_bwd
