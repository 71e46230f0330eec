"""Router z-loss row kernels on 16-byte vectors: the forward's rows and the
backward when a row is a whole number of 16-byte vectors (bf16 and fp16 with
``E % 8 == 0``, fp32 with ``E % 4 == 0``; ``tiling.z_loss_vec_tiling``).
``z_loss.py`` picks these or its unit kernels, and holds the plans.

Layout: the logits seen flat as uint32 words (bf16, fp16: two experts a word,
fp32: one; fp16's halves converted by ``access.f16_pair_ops``), a row as ``V``
vectors of four words.  W lanes (a compile-time constant) own a row, lane ``l``
holding vectors ``l, l + W, ...`` (``hold`` of them, all of the row: one step),
so a warp's load is W * 16 contiguous bytes of each of its rows.  A block's
TB = threads / W row slots walk ``iters`` consecutive groups of TB rows; with
``prefetch`` the next group's loads are issued before the current one is used
(the forward walks two groups a trip, its two buffers in turn).  The forward
is compiled for rows of exactly ``W * hold`` vectors and for blocks of whole
warps where the tiling gives them.  An element costs about five instructions
(``z_io.py``; the unit kernels about 18: docs/kernels.md).

Forward: a lane takes the max of its vectors (fmaxf drops NaN; the sum keeps
it), the W lanes' maxima give the row's ``M`` (``z_io.lane_reducers``), then
each lane ``s_l = sum 2^((x - M) log2 e)`` (no rescale), and the W sums in a
fixed pairwise tree in lane order give ``S``; lane 0 saves ``(M, lg2.approx(S))``
and adds ``lse^2`` to its running sum in row order.  At the end thread 0 sums
the block's TB running sums in slot order into ``partial[b]`` and takes a
ticket (``last_block.py``): the block that gets the last one sums every
partial in a fixed order and writes the loss, one launch in all.  Every
order is fixed: bit-identical run to run (the simulator's exchange goes
through shared memory in the same order).

Backward: ``grad = (g * 2 coeff / N) lse_t 2^((x - M_t) log2 e - lg2(S_t))``
from the saved pair, one 16-byte store per vector; no barrier.  ``has_mask``
backward loads a row's mask byte with its saved pair (prefetched with it).

On the simulator the vector accesses are four word accesses (same code).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import uint32 as nb_u32

from .._base.access import bf16_halves, f16_pair_ops
from .._base.device import NEG_INF, ZERO, fmax_f32, u64
from .._base.launch import BF16, F16
from .._base.plan import Spec
from .last_block import finish_pieces
from .logsumexp import LOG2E, backward_row, lse_of_saved, saved_pair, shift_of
from .z_io import keep_loader, lane_reducers, load_words, log2_approx, single_ops, store_words, vector_io, warp_mask


def word_view(logits: Spec) -> Spec:
    """A ``[T, E]`` array (logits or their gradient) seen flat as uint32 words."""
    return Spec((logits.shape[0] * logits.shape[1] * logits.dtype.itemsize // 4,), np.uint32)


@functools.cache
def _row_pieces(kind: str, hold: int, lanes: int, hints: bool, exact: bool = False):
    """Device functions of both kernels for ``kind``, ``hold`` vectors a lane and
    W = ``lanes``: ``fetch(held, a, fast, row, lane, vecs)`` (every load issued
    before any use; vectors past the row's end read its last vector, which
    leaves the max alone), ``row_max(held)``, ``row_sum(held, lane, vecs, sh2)``
    (those past the end masked) and ``grad_word(word, a, v2)``.  ``exact``: the
    row is exactly ``W * hold`` vectors (``vecs`` is that constant: no clamp,
    no mask, the row's offset a shift)."""
    aligned, load_v, store_v = vector_io(hints)
    exp2, max2, pack2 = single_ops(kind)
    pair = kind in (BF16, F16)
    words = 4 * hold
    row_vecs = lanes * hold
    split = f16_pair_ops()[0] if kind == F16 else bf16_halves  # a word's two halves as fp32

    @cuda.jit(device=True)
    def fetch(held, a, fast, row, lane, vecs):
        if exact:
            base = np.int64(row) * row_vecs + lane
        else:
            base = np.int64(row) * vecs
        for h in range(hold):
            if exact:
                v = base + h * lanes
            else:
                v = base + min(np.int32(lane + h * lanes), np.int32(vecs - 1))
            if fast:
                w0, w1, w2, w3 = load_v(a, v)
            else:
                w0, w1, w2, w3 = load_words(a, v)
            held[4 * h] = w0
            held[4 * h + 1] = w1
            held[4 * h + 2] = w2
            held[4 * h + 3] = w3

    @cuda.jit(device=True)
    def term(x, sh):  # exp(x - m) = 2^((x - m) log2 e) (the forward: sh = m, l2 = 0)
        return exp2(np.float32(np.float32(x - sh) * LOG2E))

    @cuda.jit(device=True)
    def bterm(x, sh, l2):  # exp(x - lse) = 2^((x - m) log2 e - log2 s) (logsumexp.softmax_term)
        return exp2(cuda.fma(np.float32(x - sh), LOG2E, -l2))

    if pair and max2 is not None:

        @cuda.jit(device=True)
        def row_max(held):  # a vector's four words in a tree, then the vectors: short chains
            m2 = max2(max2(held[0], held[1]), max2(held[2], held[3]))
            for h in range(1, hold):
                m2 = max2(m2, max2(max2(held[4 * h], held[4 * h + 1]), max2(held[4 * h + 2], held[4 * h + 3])))
            m_lo, m_hi = split(m2)
            return fmax_f32(m_lo, m_hi)

    elif pair:

        @cuda.jit(device=True)
        def row_max(held):
            m = NEG_INF
            for i in range(words):
                v_lo, v_hi = split(held[i])
                m = fmax_f32(fmax_f32(m, v_lo), v_hi)
            return m

    else:

        @cuda.jit(device=True)
        def row_max(held):
            m = NEG_INF
            for i in range(words):
                m = fmax_f32(m, np.uint32(held[i]).view(np.float32))
            return m

    if pair:

        @cuda.jit(device=True)
        def word_sum(w, sh2):
            v_lo, v_hi = split(w)
            return np.float32(term(v_lo, sh2) + term(v_hi, sh2))

        @cuda.jit(device=True)
        def grad_word(w, a, sh, l2):
            v_lo, v_hi = split(w)
            return pack2(np.float32(a * bterm(v_lo, sh, l2)), np.float32(a * bterm(v_hi, sh, l2)))

    else:

        @cuda.jit(device=True)
        def word_sum(w, sh2):
            return term(np.uint32(w).view(np.float32), sh2)

        @cuda.jit(device=True)
        def grad_word(w, a, sh, l2):
            return np.float32(a * bterm(np.uint32(w).view(np.float32), sh, l2)).view(np.uint32)

    @cuda.jit(device=True)
    def row_sum(held, lane, vecs, sh2):
        s = ZERO
        for h in range(hold):
            if exact or lane + h * lanes < vecs:  # pairwise within a vector: short add chains
                s01 = np.float32(word_sum(held[4 * h], sh2) + word_sum(held[4 * h + 1], sh2))
                s23 = np.float32(word_sum(held[4 * h + 2], sh2) + word_sum(held[4 * h + 3], sh2))
                s = np.float32(s + np.float32(s01 + s23))
        return s

    return aligned, store_v, fetch, row_max, row_sum, grad_word


@functools.cache
def z_loss_vec_rows_kernel(kind: str, hold: int, lanes: int, prefetch: bool, hints: bool,
                           exact: bool = False, full: bool = False, finish_mode: str = "acq_rel",
                           has_mask: bool = False, count_valid: bool = False):
    """The forward's row kernel on vectors (see the module docstring).  ``exact``:
    every row is ``W * hold`` vectors (``_row_pieces``); ``full``: blockDim.x is
    a multiple of 32 (the shuffles' member mask a constant).  ``has_mask``: ``mask``
    (bool ``[T]``) and ``n`` (fp32 ``[1]``: N) after ``count``, no ``total``; a masked
    row's pair is saved, its ``lse^2`` not added.  ``count_valid``: N = max(valid
    rows, 1) counted on word 1 of the ``Counter`` and written to ``n`` (an output);
    TB more words of shared memory (docs/kernels.md, "Token masks")."""
    aligned, _, fetch, row_max, row_sum, _ = _row_pieces(kind, hold, lanes, hints, exact)
    all_max, all_sum = lane_reducers(lanes, full)
    lg2 = log2_approx()
    ticket, finish = finish_pieces(finish_mode, full)
    words = 4 * hold  # compile-time constants (local array sizes, unrolled loops)
    w = np.int32(lanes)

    @cuda.jit(device=True)
    def group(held, lane, vecs, red, tid, first, mask, lse, row, num_tokens, acc, keep, cnt):
        """One row group on the held vectors: the row's max over its W lanes, then
        each lane's sum against it (no rescale), the W sums in the fixed pairwise
        order; lane 0 writes the saved ``(m, log2 s)`` (one lg2.approx; s >= 1 or
        NaN when m > -inf) and returns ``acc + lse^2`` (``acc`` for a row that
        ``keep`` leaves out: ``has_mask``)."""
        m = all_max(row_max(held), red, tid, first, mask)
        s = all_sum(row_sum(held, lane, vecs, shift_of(m)), red, tid, first, mask)
        if lane == 0 and row < num_tokens:
            sm, sl = saved_pair(m, s, lg2(s) if m != NEG_INF else ZERO)
            v = lse_of_saved(sm, sl)
            lse[u64(row)] = sm
            lse[u64(num_tokens + row)] = sl
            if not has_mask or keep[row]:
                acc = np.float32(acc + np.float32(v * v))
                cnt += np.float32(1)
        return acc, cnt

    @cuda.jit(device=True)
    def run(logits, lse, partial, loss, count, keep, n, num_tokens, vecs, iters, coeff, total, red, cur, nxt):
        tid = np.int32(cuda.threadIdx.x)
        nthreads = np.int32(cuda.blockDim.x)
        tok = np.int32(tid // w)
        lane = np.int32(tid - tok * w)
        first = np.int32(tid - lane)
        mask = warp_mask(tid, nthreads)
        tb = np.int32(nthreads // w)
        last = np.int64(num_tokens - 1)
        row = np.int64(cuda.blockIdx.x) * tb * iters + tok
        fast = aligned(logits)
        acc = ZERO
        cnt = ZERO  # the slot's valid rows (count_valid), exact integers in fp32
        fetch(cur, logits, fast, min(row, last), lane, vecs)
        k = np.int32(0)
        while k < iters:
            if prefetch:  # two groups a trip, the buffers in turn: each group's loads in flight
                if k + 1 < iters:  # during the group before it, and no copies between buffers
                    fetch(nxt, logits, fast, min(row + tb, last), lane, vecs)
                acc, cnt = group(cur, lane, vecs, red, tid, first, mask, lse, row, num_tokens, acc, keep, cnt)
                row += tb
                if k + 1 < iters:
                    if k + 2 < iters:
                        fetch(cur, logits, fast, min(row + tb, last), lane, vecs)
                    acc, cnt = group(nxt, lane, vecs, red, tid, first, mask, lse, row, num_tokens, acc, keep, cnt)
                    row += tb
                k += 2
            else:
                acc, cnt = group(cur, lane, vecs, red, tid, first, mask, lse, row, num_tokens, acc, keep, cnt)
                row += tb
                k += 1
                if k < iters:
                    fetch(cur, logits, fast, min(row, last), lane, vecs)
        if lane == 0:
            red[nthreads + tok] = acc
            if count_valid:
                red[nthreads + tb + 1 + tok] = cnt
        # Barrier: thread 0 reads every slot's running sum.
        cuda.syncthreads()
        if tid == 0:
            block_sum = ZERO
            for i in range(tb):
                block_sum = np.float32(block_sum + red[nthreads + i])
            partial[cuda.blockIdx.x] = block_sum
            if count_valid:
                block_count = ZERO
                for i in range(tb):
                    block_count += red[nthreads + tb + 1 + i]
                cuda.atomic.add(count, 1, np.uint32(block_count))  # before the ticket (its release)
            red[nthreads + tb] = ticket(count)
        # Barrier: every thread reads the flag (block-uniform below).
        cuda.syncthreads()
        if red[nthreads + tb] != ZERO:
            if count_valid and tid == 0:  # every block's count is in (the ticket's acquire); leave the word 0
                total = np.float32(max(cuda.atomic.exch(count, 1, np.uint32(0)), np.uint32(1)))
                n[0] = total  # N for the backward
            finish(partial, loss, red, tid, nthreads, coeff, total)  # (only thread 0 reads total)

    if has_mask:

        @cuda.jit
        def z_loss_vec_rows_masked(logits, lse, partial, loss, count, keep, n, num_tokens, vecs, iters, coeff):
            # as below, plus keep: [T] bool, the valid rows; n: [1] fp32, N (count_valid: out)
            red = cuda.shared.array(0, nb_f32)
            cur = cuda.local.array(words, nb_u32)
            nxt = cuda.local.array(words, nb_u32)
            run(logits, lse, partial, loss, count, keep, n, num_tokens, vecs, iters, coeff,
                np.float32(1) if count_valid else n[0], red, cur, nxt)  # count_valid: N counted

        return z_loss_vec_rows_masked

    @cuda.jit
    def z_loss_vec_rows(
        logits,  # [T * E * size / 4] uint32 words, flat
        lse,  # [2T] fp32, out: each row's max, then log2 of its sum (logsumexp.saved_pair)
        partial,  # [>= grid] fp32, out: the block's sum of lse^2 (rows in order)
        loss,  # [1] fp32, out: coeff * (S / N)
        count,  # [1] uint32: 0 at launch, left 0 (a _plan.Counter)
        num_tokens,
        vecs,  # V: 16-byte vectors a row
        iters,  # row groups a block walks; blockDim.x = TB * W
        coeff,  # fp32
        total,  # fp32: N
    ):
        red = cuda.shared.array(0, nb_f32)  # [threads] lane exchange (simulator), [TB] running sums, a flag
        cur = cuda.local.array(words, nb_u32)
        nxt = cuda.local.array(words, nb_u32)
        run(logits, lse, partial, loss, count, lse, lse, num_tokens, vecs, iters, coeff, total, red, cur,
            nxt)  # no mask, no count

    return z_loss_vec_rows


@functools.cache
def z_loss_vec_bwd_kernel(kind: str, hold: int, lanes: int, prefetch: bool, hints: bool, has_mask: bool = False):
    """The backward on vectors: ``grad = (g * scale) lse_t exp(x - lse_t)``.  ``has_mask``:
    ``mask`` (bool ``[T]``) and ``n`` (fp32 ``[1]``) after ``grad_logits``, ``coeff`` for
    ``scale`` (``2 coeff / n`` on the device); masked rows get 0."""
    aligned, store_v, fetch, _, _, grad_word = _row_pieces(kind, hold, lanes, hints)
    load_keep = keep_loader(has_mask)
    words = 4 * hold
    w = np.int32(lanes)

    @cuda.jit(device=True)
    def run(logits, lse, grad_loss, grad_logits, keep, num_tokens, vecs, iters, scale, cur, nxt):
        tid = np.int32(cuda.threadIdx.x)
        tok = np.int32(tid // w)
        lane = np.int32(tid - tok * w)
        tb = np.int32(cuda.blockDim.x // w)
        last = np.int64(num_tokens - 1)
        row = np.int64(cuda.blockIdx.x) * tb * iters + tok
        fast = aligned(logits) and aligned(grad_logits)
        g = np.float32(grad_loss[0] * scale)
        fetch(cur, logits, fast, min(row, last), lane, vecs)
        vm = lse[u64(min(row, last))]
        vl = lse[u64(num_tokens + min(row, last))]
        kc = load_keep(keep, min(row, last))  # the row's mask byte, loaded with its saved pair
        nm = vm
        nl = vl
        kn = kc
        for k in range(iters):
            more = k + 1 < iters
            if prefetch and more:
                fetch(nxt, logits, fast, min(row + tb, last), lane, vecs)
                nm = lse[u64(min(row + tb, last))]
                nl = lse[u64(num_tokens + min(row + tb, last))]
                kn = load_keep(keep, min(row + tb, last))
            if row < num_tokens:
                v, sh, l2 = backward_row(vm, vl)
                a = np.float32(g * v)  # 0 on a dead row (v = 0)
                dead = has_mask and not kc  # a masked row: 0 whatever it holds
                base = row * vecs
                for h in range(hold):
                    u = np.int32(lane + h * w)
                    if u < vecs:
                        o0 = grad_word(cur[4 * h], a, sh, l2)
                        o1 = grad_word(cur[4 * h + 1], a, sh, l2)
                        o2 = grad_word(cur[4 * h + 2], a, sh, l2)
                        o3 = grad_word(cur[4 * h + 3], a, sh, l2)
                        if dead:
                            o0 = o1 = o2 = o3 = np.uint32(0)
                        if fast:
                            store_v(grad_logits, base + u, o0, o1, o2, o3)
                        else:
                            store_words(grad_logits, base + u, o0, o1, o2, o3)
            if prefetch:
                for i in range(words):
                    cur[i] = nxt[i]
                vm = nm
                vl = nl
                kc = kn
            elif more:
                fetch(cur, logits, fast, min(row + tb, last), lane, vecs)
                vm = lse[u64(min(row + tb, last))]
                vl = lse[u64(num_tokens + min(row + tb, last))]
                kc = load_keep(keep, min(row + tb, last))
            row += tb

    if has_mask:

        @cuda.jit
        def z_loss_vec_bwd_masked(logits, lse, grad_loss, grad_logits, keep, n, num_tokens, vecs, iters, coeff):
            cur = cuda.local.array(words, nb_u32)
            nxt = cuda.local.array(words, nb_u32)
            scale = np.float32(np.float32(coeff / n[0]) * np.float32(2))  # the host plan's order
            run(logits, lse, grad_loss, grad_logits, keep, num_tokens, vecs, iters, scale, cur, nxt)

        return z_loss_vec_bwd_masked

    @cuda.jit
    def z_loss_vec_bwd(
        logits,  # [T * E * size / 4] uint32 words, flat
        lse,  # [2T] fp32: the forward's saved (m, log2 s)
        grad_loss,  # [1] fp32
        grad_logits,  # as logits, out
        num_tokens,
        vecs,
        iters,
        scale,  # fp32: 2 coeff / N
    ):
        cur = cuda.local.array(words, nb_u32)
        nxt = cuda.local.array(words, nb_u32)
        run(logits, lse, grad_loss, grad_logits, lse, num_tokens, vecs, iters, scale, cur, nxt)  # no mask read

    return z_loss_vec_bwd
