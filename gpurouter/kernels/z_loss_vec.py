"""Router z-loss row kernels on 16-byte vectors: the forward's rows and the
backward when a row is a whole number of 16-byte vectors (bf16 with
``E % 8 == 0``, fp32 with ``E % 4 == 0``; ``_tiling.z_loss_vec_tiling``).
``z_loss.py`` picks these or its unit kernels, and holds the plans.

Layout: the logits seen flat as uint32 words (bf16: two experts a word, fp32:
one), a row as ``V`` vectors of four words.  W lanes own a row, lane ``l``
holding vectors ``l, l + W, ...`` (``hold`` of them, all of the row: one
step), so a warp's load is W * 16 contiguous bytes of each of its rows.  A
block's TB = threads / W row slots walk ``iters`` consecutive groups of TB
rows (a block owns ``TB * iters`` consecutive rows); the loads of the next
group are issued before the current one is used (``prefetch``): each warp
keeps loads in flight while it computes, and a few blocks per SM keep the
memory busy without a second wave (the unit kernels load, then compute,
in lock step: measured at 2.8x the byte floor).

Forward: a lane takes its max ``m_l`` (fmaxf drops NaN; the sum keeps it),
then ``s_l = sum 2^(fma(x, log2 e, -m_l log2 e))``: one exp per element, no
online rescale.  The W pairs go through shared memory (two slots by group
parity: one barrier per group); lane 0 takes ``M = max m_l``,
``S = sum_l s_l 2^(sh2(m_l) - sh2(M))`` in lane order, writes ``lse`` and adds
``lse^2`` to its own running sum in row order; at the end thread 0 sums the
block's TB running sums in slot order into ``partial[b]``.  Every order is
fixed: bit-identical run to run.

Backward: ``grad = (g * 2 coeff / N) lse_t 2^(fma(x, log2 e, -lse_t log2 e))``,
as the unit kernel, one 16-byte store per vector; no barrier.

On the simulator the vector accesses are four word accesses (same code).
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import uint32 as nb_u32

from ._access import bf16_bits
from ._device import NEG_INF, ZERO, fmax_f32, u64
from ._launch import BF16, simulator_enabled
from ._logsumexp import LOG2E, exp2_term, lse_of, rescale_sum, shift2
from ._plan import Spec

_NC_LOAD = "{ .reg .u64 g; cvta.to.global.u64 g, $4; ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [g]; }"
_CS_STORE = "{ .reg .u64 g; cvta.to.global.u64 g, $0; st.global.cs.v4.u32 [g], {$1, $2, $3, $4}; }"


def word_view(logits: Spec) -> Spec:
    """A ``[T, E]`` array (logits or their gradient) seen flat as uint32 words."""
    return Spec((logits.shape[0] * logits.shape[1] * logits.dtype.itemsize // 4,), np.uint32)


@cuda.jit(device=True)
def _load_words(a, v):
    f = u64(4 * v)
    return a[f], a[f + 1], a[f + 2], a[f + 3]


@cuda.jit(device=True)
def _store_words(a, v, w0, w1, w2, w3):
    f = u64(4 * v)
    a[f] = w0
    a[f + 1] = w1
    a[f + 2] = w2
    a[f + 3] = w3


@functools.cache
def vector_io(hints: bool):
    """``(aligned(a) -> bool, load(a, v) -> 4 x uint32, store(a, v, w0..w3))`` on
    vector ``v`` (words ``4v .. 4v+3``) of a flat uint32 array: one 16-byte
    access (callers test ``aligned`` once; else ``_load_words`` / ``_store_words``).
    ``hints``: loads through the non-coherent path without L1 allocation and
    streaming (evict-first) stores, as inline PTX.  The simulator: word accesses."""
    from ._vec import quad_f32_unchecked

    if simulator_enabled():
        return quad_f32_unchecked()[0], _load_words, _store_words
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i32, i64 = ir.IntType(32), ir.IntType(64)
    u32x4 = ir.VectorType(i32, 4)

    def pointer(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        w = builder.mul(context.cast(builder, args[1], sig.args[1], types.uint64), ir.Constant(i64, 4))
        return builder.bitcast(builder.gep(data, [w]), u32x4.as_pointer())

    @intrinsic
    def load_v(typingctx, array, v):
        sig = types.UniTuple(types.uint32, 4)(array, v)

        def codegen(context, builder, sig, args):
            ptr = pointer(context, builder, sig, args)
            if hints:
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i64])
                asm = ir.InlineAsm(fnty, _NC_LOAD, "=r,=r,=r,=r,l")
                res = builder.call(asm, [builder.ptrtoint(ptr, i64)])
                parts = [builder.extract_value(res, i) for i in range(4)]
            else:
                vec = builder.load(ptr, align=16)
                parts = [builder.extract_element(vec, ir.Constant(i32, i)) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    @intrinsic
    def store_v(typingctx, array, v, w0, w1, w2, w3):
        sig = types.void(array, v, w0, w1, w2, w3)

        def codegen(context, builder, sig, args):
            ptr = pointer(context, builder, sig, args)
            vals = [context.cast(builder, args[2 + i], sig.args[2 + i], types.uint32) for i in range(4)]
            if hints:
                fnty = ir.FunctionType(ir.VoidType(), [i64] + [i32] * 4)
                asm = ir.InlineAsm(fnty, _CS_STORE, "l,r,r,r,r", side_effect=True)
                builder.call(asm, [builder.ptrtoint(ptr, i64)] + vals)
            else:
                vec = ir.Constant(u32x4, ir.Undefined)
                for i in range(4):
                    vec = builder.insert_element(vec, vals[i], ir.Constant(i32, i))
                builder.store(vec, ptr, align=16)

        return sig, codegen

    return quad_f32_unchecked()[0], load_v, store_v


@functools.cache
def _row_pieces(kind: str, hold: int, hints: bool):
    """Device functions of both kernels for ``kind`` and ``hold`` vectors a lane:
    ``fetch(held, a, fast, row, lane, lanes, vecs)`` (every load issued
    before any use; vectors past the row's end read its last vector),
    ``row_max(held, lane, lanes, vecs)``, ``row_sum(held, lane, lanes, vecs, sh2)``
    and ``grad_word(word, a, v2)`` (a word of the gradient)."""
    aligned, load_v, store_v = vector_io(hints)
    pair = kind == BF16
    hi_mask = np.uint32(0xFFFF0000)
    shift = np.uint32(16)

    @cuda.jit(device=True)
    def fetch(held, a, fast, row, lane, lanes, vecs):
        base = np.int64(row) * vecs
        for h in range(hold):
            v = base + min(np.int32(lane + h * lanes), np.int32(vecs - 1))
            if fast:
                w0, w1, w2, w3 = load_v(a, v)
            else:
                w0, w1, w2, w3 = _load_words(a, v)
            held[4 * h] = w0
            held[4 * h + 1] = w1
            held[4 * h + 2] = w2
            held[4 * h + 3] = w3

    if pair:  # bf16: the low word's expert is the top half of an fp32

        @cuda.jit(device=True)
        def word_max(m, w):
            m = fmax_f32(m, np.uint32(w << shift).view(np.float32))
            return fmax_f32(m, np.uint32(w & hi_mask).view(np.float32))

        @cuda.jit(device=True)
        def word_sum(w, sh2):
            return np.float32(exp2_term(np.uint32(w << shift).view(np.float32), sh2)
                              + exp2_term(np.uint32(w & hi_mask).view(np.float32), sh2))

        @cuda.jit(device=True)
        def grad_word(w, a, v2):
            lo = bf16_bits(np.float32(a * exp2_term(np.uint32(w << shift).view(np.float32), v2)))
            hi = bf16_bits(np.float32(a * exp2_term(np.uint32(w & hi_mask).view(np.float32), v2)))
            return np.uint32(np.uint32(lo) | np.uint32(np.uint32(hi) << shift))

    else:

        @cuda.jit(device=True)
        def word_max(m, w):
            return fmax_f32(m, np.uint32(w).view(np.float32))

        @cuda.jit(device=True)
        def word_sum(w, sh2):
            return exp2_term(np.uint32(w).view(np.float32), sh2)

        @cuda.jit(device=True)
        def grad_word(w, a, v2):
            return np.float32(a * exp2_term(np.uint32(w).view(np.float32), v2)).view(np.uint32)

    @cuda.jit(device=True)
    def row_max(held, lane, lanes, vecs):
        m = NEG_INF
        for h in range(hold):
            if lane + h * lanes < vecs:
                for j in range(4):
                    m = word_max(m, held[4 * h + j])
        return m

    @cuda.jit(device=True)
    def row_sum(held, lane, lanes, vecs, sh2):
        s = ZERO
        for h in range(hold):
            if lane + h * lanes < vecs:  # pairwise within a vector: short add chains
                s01 = np.float32(word_sum(held[4 * h], sh2) + word_sum(held[4 * h + 1], sh2))
                s23 = np.float32(word_sum(held[4 * h + 2], sh2) + word_sum(held[4 * h + 3], sh2))
                s = np.float32(s + np.float32(s01 + s23))
        return s

    return aligned, store_v, fetch, row_max, row_sum, grad_word


@functools.cache
def z_loss_vec_rows_kernel(kind: str, hold: int, prefetch: bool, hints: bool):
    """The forward's row kernel on vectors (see the module docstring)."""
    aligned, _, fetch, row_max, row_sum, _ = _row_pieces(kind, hold, hints)
    words = 4 * hold  # a compile-time constant (local array sizes must be)

    @cuda.jit
    def z_loss_vec_rows(
        logits,  # [T * E * size / 4] uint32 words, flat
        lse,  # [T] fp32, out
        partial,  # [>= grid] fp32, out: the block's sum of lse^2 (rows in order)
        num_tokens,
        vecs,  # V: 16-byte vectors a row
        lanes,  # W; blockDim.x = TB * W
        iters,  # row groups a block walks
    ):
        red = cuda.shared.array(0, nb_f32)  # [2 slots][max, sum][threads], then [TB] running sums
        cur = cuda.local.array(words, nb_u32)
        nxt = cuda.local.array(words, nb_u32)
        tid = np.int32(cuda.threadIdx.x)
        nthreads = np.int32(cuda.blockDim.x)
        w = np.int32(lanes)
        tok = np.int32(tid // w)
        lane = np.int32(tid - tok * w)
        tb = np.int32(nthreads // w)
        last = np.int64(num_tokens - 1)
        row = np.int64(cuda.blockIdx.x) * tb * iters + tok
        fast = aligned(logits)
        acc = ZERO
        fetch(cur, logits, fast, min(row, last), lane, w, vecs)
        for k in range(iters):
            more = k + 1 < iters
            if prefetch and more:  # the next group's loads in flight during this one
                fetch(nxt, logits, fast, min(row + tb, last), lane, w, vecs)
            m = row_max(cur, lane, w, vecs)
            s = row_sum(cur, lane, w, vecs, shift2(m))
            o = np.int32((k & 1) * 2 * nthreads)
            red[o + tid] = m
            red[o + nthreads + tid] = s
            # Barrier: lane 0 reads its row's W pairs.  Two slots: group k + 2
            # writes slot k & 1 only after passing group k + 1's barrier,
            # which lane 0 reaches after its reads of group k.
            cuda.syncthreads()
            if lane == 0:
                mm = NEG_INF
                for i in range(w):
                    mm = fmax_f32(mm, red[o + tid + i])
                ss = ZERO
                for i in range(w):
                    ss = np.float32(ss + rescale_sum(red[o + nthreads + tid + i], red[o + tid + i], mm))
                v = lse_of(mm, ss)
                if row < num_tokens:
                    lse[u64(row)] = v
                    acc = np.float32(acc + np.float32(v * v))
            if prefetch:
                for i in range(words):
                    cur[i] = nxt[i]
            elif more:
                fetch(cur, logits, fast, min(row + tb, last), lane, w, vecs)
            row += tb
        if lane == 0:
            red[4 * nthreads + tok] = acc
        # Barrier: thread 0 reads every slot's running sum.
        cuda.syncthreads()
        if tid == 0:
            total = ZERO
            for i in range(tb):
                total = np.float32(total + red[4 * nthreads + i])
            partial[cuda.blockIdx.x] = total

    return z_loss_vec_rows


@functools.cache
def z_loss_vec_bwd_kernel(kind: str, hold: int, prefetch: bool, hints: bool):
    """The backward on vectors: ``grad = (g * scale) lse_t exp(x - lse_t)``."""
    aligned, store_v, fetch, _, _, grad_word = _row_pieces(kind, hold, hints)
    words = 4 * hold

    @cuda.jit
    def z_loss_vec_bwd(
        logits,  # [T * E * size / 4] uint32 words, flat
        lse,  # [T] fp32: the forward's saved lse
        grad_loss,  # [1] fp32
        grad_logits,  # as logits, out
        num_tokens,
        vecs,
        lanes,
        iters,
        scale,  # fp32: 2 coeff / N
    ):
        cur = cuda.local.array(words, nb_u32)
        nxt = cuda.local.array(words, nb_u32)
        tid = np.int32(cuda.threadIdx.x)
        w = np.int32(lanes)
        tok = np.int32(tid // w)
        lane = np.int32(tid - tok * w)
        tb = np.int32(cuda.blockDim.x // w)
        last = np.int64(num_tokens - 1)
        row = np.int64(cuda.blockIdx.x) * tb * iters + tok
        fast = aligned(logits) and aligned(grad_logits)
        g = np.float32(grad_loss[0] * scale)
        fetch(cur, logits, fast, min(row, last), lane, w, vecs)
        v = lse[u64(min(row, last))]
        nv = v
        for k in range(iters):
            more = k + 1 < iters
            if prefetch and more:
                fetch(nxt, logits, fast, min(row + tb, last), lane, w, vecs)
                nv = lse[u64(min(row + tb, last))]
            if row < num_tokens:
                a = np.float32(g * v)  # 0 on a dead row (v = 0)
                v2 = np.float32(v * LOG2E)
                base = row * vecs
                for h in range(hold):
                    u = np.int32(lane + h * w)
                    if u < vecs:
                        o0 = grad_word(cur[4 * h], a, v2)
                        o1 = grad_word(cur[4 * h + 1], a, v2)
                        o2 = grad_word(cur[4 * h + 2], a, v2)
                        o3 = grad_word(cur[4 * h + 3], a, v2)
                        if fast:
                            store_v(grad_logits, base + u, o0, o1, o2, o3)
                        else:
                            _store_words(grad_logits, base + u, o0, o1, o2, o3)
            if prefetch:
                for i in range(words):
                    cur[i] = nxt[i]
                v = nv
            elif more:
                fetch(cur, logits, fast, min(row + tb, last), lane, w, vecs)
                v = lse[u64(min(row + tb, last))]
            row += tb

    return z_loss_vec_bwd
