"""Device helpers of the z-loss vector kernels (``z_loss_vec.py``): 16-byte
loads and stores of four uint32 words, and three single instructions that
numba's libdevice path spells as several (the kernels are instruction-bound
otherwise: about 18 instructions an element before, 9 of them integer or
denormal handling around ``ex2``):

- ``exp2_ftz(a)``: ``ex2.approx.ftz.f32``, one MUFU.EX2 (libdevice's exp2f adds
  a compare and two multiplies to keep results below 2^-126; a sum of terms
  whose largest is 1, or a gradient later rounded to bf16 or fp16, loses nothing
  that matters: such terms flush to 0);
- ``max2(a, b)``: the max of two pairs of bf16 or fp16 (``max.bf16x2`` /
  ``max.f16x2``, fmaxf's NaN rule: a NaN loses to a number), a row's max in
  half the instructions, no unpacking;
- ``pack2(lo, hi)``: two fp32 to a word of two bf16 or fp16, round to nearest
  even (``cvt.rn.bf16x2.f32`` / ``cvt.rn.f16x2.f32``; a NaN stays a NaN, its
  payload the hardware's);
- ``log2_approx(a)``: ``lg2.approx.ftz.f32``, one MUFU.LG2 (libdevice's log2f
  is about 30 instructions, once a row group; a row's sum of terms is >= 1
  or NaN here, where the approximation is within 2^-22 of log2).

On the simulator each is Python (``exp2_f32``; ``max2`` is not used there;
``bf16_bits``, ``access.f16_pair_ops``), the vector accesses four word accesses.

``keep_loader(has_mask)``: ``load_keep(keep, r)``, row r's mask byte as a bool
(``has_mask``; the kernels load it with the row's data, not after the row's
reductions), else True without a load (the unmasked builds).

``lane_reducers(W)``: the max and the sum of a value over the W lanes of a
row (W consecutive threads, W a power of two <= 32), every lane getting the
result: on the GPU a butterfly of ``shfl_xor_sync`` (log2 W steps, no
shared memory, no barrier); on the simulator (no warp intrinsics there)
shared memory between two barriers.  The sum's order is fixed and the same
both ways: the pairwise tree in lane order, ``((s0 + s1) + (s2 + s3)) + ...``
(a butterfly step adds the same two numbers on both lanes, and fp32 addition
is commutative: every lane holds the same bits).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools
import math

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types

from .._base.access import bf16_bits, f16_pair_ops
from .._base.device import fmax_f32, u64
from .._base.launch import BF16, F16, simulator_enabled
from .logsumexp import exp2_f32


@functools.cache
def keep_loader(has_mask: bool):
    """``load_keep(keep, r)``: ``keep[r] != 0`` (bool ``[T]``) with ``has_mask``,
    else True and ``keep`` never read (the unmasked kernels pass another array)."""
    if has_mask:

        @cuda.jit(device=True)
        def load_keep(keep, r):
            return keep[r] != 0

    else:

        @cuda.jit(device=True)
        def load_keep(keep, r):
            return True

    return load_keep


_NC_LOAD = "{ .reg .u64 g; cvta.to.global.u64 g, $4; ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [g]; }"
_CS_STORE = "{ .reg .u64 g; cvta.to.global.u64 g, $0; st.global.cs.v4.u32 [g], {$1, $2, $3, $4}; }"


@cuda.jit(device=True)
def load_words(a, v):
    """Words ``4v .. 4v+3`` of a flat uint32 array, one at a time."""
    f = u64(4 * v)
    return a[f], a[f + 1], a[f + 2], a[f + 3]


@cuda.jit(device=True)
def store_words(a, v, w0, w1, w2, w3):
    f = u64(4 * v)
    a[f] = w0
    a[f + 1] = w1
    a[f + 2] = w2
    a[f + 3] = w3


@functools.cache
def vector_io(hints: bool):
    """``(aligned(a) -> bool, load(a, v) -> 4 x uint32, store(a, v, w0..w3))`` on
    vector ``v`` (words ``4v .. 4v+3``) of a flat uint32 array: one 16-byte
    access (callers test ``aligned`` once; else ``load_words`` / ``store_words``).
    ``hints``: loads through the non-coherent path without L1 allocation and
    streaming (evict-first) stores, as inline PTX.  The simulator: word accesses."""
    from .._base.vec import quad_f32_unchecked

    if simulator_enabled():
        return quad_f32_unchecked()[0], load_words, store_words
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
                res = builder.call(ir.InlineAsm(fnty, _NC_LOAD, "=r,=r,=r,=r,l"), [builder.ptrtoint(ptr, i64)])
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


@cuda.jit(device=True)
def _pack_bf16x2_words(lo, hi):
    return np.uint32(np.uint32(bf16_bits(lo)) | np.uint32(np.uint32(bf16_bits(hi)) << np.uint32(16)))


@functools.cache
def single_ops(kind: str = BF16):
    """``(exp2_ftz(a) -> f32, max2(a, b) -> u32, pack2(lo, hi) -> u32)`` (see the
    module docstring), ``max2`` and ``pack2`` on words of two ``kind`` (bf16 or
    fp16: ``max.bf16x2`` / ``max.f16x2``, ``cvt.rn.bf16x2.f32`` /
    ``cvt.rn.f16x2.f32``); on the simulator ``(exp2_f32, None, the pair's bits)``."""
    if simulator_enabled():
        return exp2_f32, None, (f16_pair_ops()[1] if kind == F16 else _pack_bf16x2_words)
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)
    half2 = "f16x2" if kind == F16 else "bf16x2"

    def call(builder, text, constraints, ret, vals):
        fnty = ir.FunctionType(ret, [v.type for v in vals])
        return builder.call(ir.InlineAsm(fnty, text, constraints), vals)

    @intrinsic
    def exp2_ftz(typingctx, a):
        def codegen(context, builder, sig, args):
            x = context.cast(builder, args[0], sig.args[0], types.float32)
            return call(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", f32, [x])

        return types.float32(a), codegen

    @intrinsic
    def max2(typingctx, a, b):
        def codegen(context, builder, sig, args):
            x, y = (context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args, strict=True))
            return call(builder, f"max.{half2} $0, $1, $2;", "=r,r,r", i32, [x, y])

        return types.uint32(a, b), codegen

    @intrinsic
    def pack2(typingctx, lo, hi):
        def codegen(context, builder, sig, args):
            x, y = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args, strict=True))
            # cvt.rn.{b}f16x2.f32 d, a, b puts a in d's upper half
            return call(builder, f"cvt.rn.{half2}.f32 $0, $1, $2;", "=r,f,f", i32, [y, x])

        return types.uint32(lo, hi), codegen

    return exp2_ftz, max2, pack2


@functools.cache
def log2_approx():
    """``lg2.approx.ftz.f32`` as a device function (see the module docstring);
    on the simulator ``math.log2`` in fp32."""
    if simulator_enabled():

        @cuda.jit(device=True)
        def log2_sim(a):
            return np.float32(math.log2(a)) if a == a else a

        return log2_sim
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    f32 = ir.FloatType()

    @intrinsic
    def lg2_ftz(typingctx, a):
        def codegen(context, builder, sig, args):
            x = context.cast(builder, args[0], sig.args[0], types.float32)
            fnty = ir.FunctionType(f32, [f32])
            return builder.call(ir.InlineAsm(fnty, "lg2.approx.ftz.f32 $0, $1;", "=f,f"), [x])

        return types.float32(a), codegen

    return lg2_ftz


@cuda.jit(device=True)
def warp_mask(tid, nthreads):
    """The ``shfl`` member mask of thread ``tid``'s warp: its threads that exist
    (a block of fewer than 32 threads, or not a multiple of 32, ends in a
    partial warp)."""
    n = nthreads - (tid & np.int32(-32))
    if n >= 32:
        return np.uint32(0xFFFFFFFF)
    return np.uint32(np.uint32(np.uint32(1) << np.uint32(n)) - np.uint32(1))


@functools.cache
def lane_reducers(lanes: int, full: bool = False):
    """``(all_max(v, red, tid, first, mask), all_sum(v, red, tid, first, mask))``
    over the W = ``lanes`` threads ``first .. first + W - 1`` (see the module
    docstring); ``red`` is a shared fp32 array of at least blockDim.x words
    (used on the simulator only), ``mask`` is ``warp_mask`` (GPU only; with
    ``full``, blockDim.x a multiple of 32, the constant full mask instead: no
    convergence checks around the shuffles).  Every thread of the block calls
    them (the simulator's barriers)."""
    levels = lanes.bit_length() - 1  # W = 2^levels, a compile-time constant

    if simulator_enabled():

        @cuda.jit(device=True)
        def publish(v, red, tid):
            # Barriers: the previous exchange's reads are done before this write,
            # and this write before any lane reads.
            cuda.syncthreads()
            red[tid] = v
            cuda.syncthreads()

        @cuda.jit(device=True)
        def all_max(v, red, tid, first, mask):
            publish(v, red, tid)
            m = red[first]
            for i in range(1, lanes):
                m = fmax_f32(m, red[first + i])
            return m

        @cuda.jit(device=True)
        def all_sum(v, red, tid, first, mask):
            publish(v, red, tid)
            vals = cuda.local.array(lanes, nb_f32)
            for i in range(lanes):
                vals[i] = red[first + i]
            span = 1
            for _ in range(levels):  # the butterfly's pairs, lane 0's view
                for i in range(0, lanes, 2 * span):
                    vals[i] = np.float32(vals[i] + vals[i + span])
                span *= 2
            return vals[0]

        return all_max, all_sum

    every = np.uint32(0xFFFFFFFF)

    @cuda.jit(device=True)
    def all_max(v, red, tid, first, mask):
        for i in range(levels):
            v = fmax_f32(v, cuda.shfl_xor_sync(every if full else mask, v, np.int32(1 << i)))
        return v

    @cuda.jit(device=True)
    def all_sum(v, red, tid, first, mask):
        for i in range(levels):
            v = np.float32(v + cuda.shfl_xor_sync(every if full else mask, v, np.int32(1 << i)))
        return v

    return all_max, all_sum
