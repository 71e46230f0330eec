"""16-byte global loads and stores of fp32 quads (four consecutive elements).

Why: a warp whose 32 threads each own a quad and touch its four fp32
elements one at a time issues four instructions, each hitting every sector
of a 512-byte span with a quarter of its bytes.  Nsight Compute put the
thread-per-token forwards at L2 throughput while DRAM sat at 16% of peak
(lab/journal/benchmarks.md): the ``saved`` and score rows, written element by
element, were four times the L2 store requests their bytes need.  One
16-byte access per quad is one request per sector.

numba has no vector types in arrays, so the accesses are LLVM intrinsics
(``<4 x float>`` loads and stores, 16-byte aligned).  They need the array's
base address to be a multiple of 16 (cudaMalloc and XLA give 256; a view
such as ``a[1:]`` need not): every access checks the address and falls back
to four scalar accesses otherwise, a warp-uniform branch.
``quad_f32_unchecked`` splits the check from the load, for kernels that
test an array once and then issue a run of loads with no branch between
them; ``quad_store_once_f32`` stores with L2's evict-first policy (inline
PTX: LLVM has no intrinsic for cache hints).

On the CUDA simulator, which cannot run LLVM intrinsics, ``quad_f32()``
returns the plain four-element versions; the kernels are the same code.
"""

from __future__ import annotations

from . import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

_u64 = np.uint64  # unsigned indices: numba wraps signed ones (see _device.u64)


@functools.cache
def _intrinsics():
    """``(address, load_v4, store_v4, store_v4_evict_first)`` as numba intrinsics (GPU only)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    f32x4 = ir.VectorType(ir.FloatType(), 4)

    def quad_pointer(context, builder, array_type, array, index_type, index):
        data = context.make_array(array_type)(context, builder, value=array).data
        w = context.cast(builder, index, index_type, types.uint64)
        f = builder.mul(w, ir.Constant(ir.IntType(64), 4))
        return builder.bitcast(builder.gep(data, [f]), f32x4.as_pointer())

    @intrinsic
    def address(typingctx, array):
        """The array's base address, as uint64."""

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            return builder.ptrtoint(data, ir.IntType(64))

        return types.uint64(array), codegen

    @intrinsic
    def load_v4(typingctx, array, w):
        """Elements ``4w .. 4w+3`` of a flat fp32 array, one 16-byte load."""
        sig = types.UniTuple(types.float32, 4)(array, w)

        def codegen(context, builder, sig, args):
            ptr = quad_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = builder.load(ptr, align=16)
            parts = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    @intrinsic
    def store_v4(typingctx, array, w, v0, v1, v2, v3):
        """Elements ``4w .. 4w+3`` of a flat fp32 array := fp32 ``v0 .. v3``, one 16-byte store."""
        sig = types.void(array, w, v0, v1, v2, v3)

        def codegen(context, builder, sig, args):
            ptr = quad_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = ir.Constant(f32x4, ir.Undefined)
            for i in range(4):
                v = context.cast(builder, args[2 + i], sig.args[2 + i], types.float32)
                vec = builder.insert_element(vec, v, ir.Constant(ir.IntType(32), i))
            builder.store(vec, ptr, align=16)

        return sig, codegen

    @intrinsic
    def store_v4_evict_first(typingctx, array, w, v0, v1, v2, v3):
        """``store_v4`` with L2's evict-first policy (PTX ``createpolicy`` and
        ``st.global.L2::cache_hint``, inline: LLVM has no intrinsic for it)."""
        sig = types.void(array, w, v0, v1, v2, v3)

        def codegen(context, builder, sig, args):
            ptr = quad_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vals = [context.cast(builder, args[2 + i], sig.args[2 + i], types.float32) for i in range(4)]
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), f32, f32, f32, f32])
            asm = ir.InlineAsm(fnty, _EVICT_FIRST_STORE, "l,f,f,f,f", side_effect=True)
            builder.call(asm, [builder.ptrtoint(ptr, ir.IntType(64))] + vals)

        return sig, codegen

    return address, load_v4, store_v4, store_v4_evict_first


@functools.cache
def _pair_intrinsic():
    """``store_v2(array, p, lo, hi)``: elements ``2p, 2p+1`` of a flat uint64
    array := ``lo, hi``, one 16-byte store (GPU only)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i64x2 = ir.VectorType(ir.IntType(64), 2)

    @intrinsic
    def store_v2(typingctx, array, p, lo, hi):
        sig = types.void(array, p, lo, hi)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            i = context.cast(builder, args[1], sig.args[1], types.uint64)
            f = builder.mul(i, ir.Constant(ir.IntType(64), 2))
            ptr = builder.bitcast(builder.gep(data, [f]), i64x2.as_pointer())
            vec = ir.Constant(i64x2, ir.Undefined)
            for k in range(2):
                v = context.cast(builder, args[2 + k], sig.args[2 + k], types.uint64)
                vec = builder.insert_element(vec, v, ir.Constant(ir.IntType(32), k))
            builder.store(vec, ptr, align=16)

        return sig, codegen

    return store_v2


@cuda.jit(device=True)
def _store_pair_elements(a, p, lo, hi):
    a[_u64(2 * p)] = lo
    a[_u64(2 * p + 1)] = hi


@functools.cache
def pair_u64():
    """Device function ``store(a, p, lo, hi)``: elements ``2p, 2p+1`` of a flat
    uint64 array (e.g. eight bf16 words) in one 16-byte store on a GPU when
    the array's base is 16-byte aligned; two 8-byte stores otherwise and on
    the simulator."""
    from .launch import simulator_enabled

    if simulator_enabled():
        return _store_pair_elements

    address = _intrinsics()[0]
    store_v2 = _pair_intrinsic()

    @cuda.jit(device=True)
    def store(a, p, lo, hi):
        if address(a) & np.uint64(15) == 0:
            store_v2(a, p, lo, hi)
        else:
            _store_pair_elements(a, p, lo, hi)

    return store


# A 16-byte store that L2 evicts first (sm_80+): for outputs far larger than
# L2 that the kernel never reads again (the aux-loss backward's 67 MB).
_EVICT_FIRST_STORE = (
    "{ .reg .b64 pol; .reg .u64 g; cvta.to.global.u64 g, $0; "
    "createpolicy.fractional.L2::evict_first.b64 pol, 1.0; "
    "st.global.L2::cache_hint.v4.f32 [g], {$1, $2, $3, $4}, pol; }"
)


@cuda.jit(device=True)
def _load_elements(a, w):
    f = 4 * w
    return a[_u64(f)], a[_u64(f + 1)], a[_u64(f + 2)], a[_u64(f + 3)]


@cuda.jit(device=True)
def _store_elements(a, w, v0, v1, v2, v3):
    f = 4 * w
    a[_u64(f)] = v0
    a[_u64(f + 1)] = v1
    a[_u64(f + 2)] = v2
    a[_u64(f + 3)] = v3


def _checked_store(address, store_v4):
    """Device function: ``store_v4`` on a 16-byte aligned array, four scalar
    stores otherwise (a warp-uniform branch)."""

    @cuda.jit(device=True)
    def store(a, w, v0, v1, v2, v3):
        if address(a) & np.uint64(15) == 0:
            store_v4(a, w, v0, v1, v2, v3)
        else:
            _store_elements(a, w, v0, v1, v2, v3)

    return store


@functools.cache
def quad_f32():
    """Device functions ``load(a, w) -> 4 x fp32`` and ``store(a, w, v0, v1, v2,
    v3)`` on quad ``w`` (elements ``4w .. 4w+3``) of a flat fp32 array:
    16-byte accesses on a GPU when the array's base is 16-byte aligned,
    four scalar accesses otherwise and on the simulator."""
    from .launch import simulator_enabled

    if simulator_enabled():
        return _load_elements, _store_elements

    address, load_v4, store_v4, _ = _intrinsics()

    @cuda.jit(device=True)
    def load(a, w):
        if address(a) & np.uint64(15) == 0:
            return load_v4(a, w)
        return _load_elements(a, w)

    return load, _checked_store(address, store_v4)


@cuda.jit(device=True)
def _always(a):
    return True


@functools.cache
def quad_f32_unchecked():
    """``(aligned(a) -> bool, load(a, w) -> 4 x fp32)``: ``quad_f32``'s
    alignment test, for a kernel that makes it once per array, and its
    16-byte load without the test (callers make sure ``aligned(a)``), so that
    a run of loads has no branch between them and goes out at once.  On the
    simulator: always aligned, and four element loads."""
    from .launch import simulator_enabled

    if simulator_enabled():
        return _always, _load_elements

    address, load_v4, _, _ = _intrinsics()

    @cuda.jit(device=True)
    def aligned(a):
        return address(a) & np.uint64(15) == 0

    return aligned, load_v4


@functools.cache
def quad_store_once_f32():
    """Device function ``store(a, w, v0, v1, v2, v3)`` like ``quad_f32``'s, with
    L2's evict-first policy on a GPU (16-byte aligned arrays): for outputs
    written once and not read again by the kernel.  On the simulator, and
    for unaligned arrays, four scalar stores."""
    from .launch import simulator_enabled

    if simulator_enabled():
        return _store_elements

    address, _, _, store_v4_evict_first = _intrinsics()
    return _checked_store(address, store_v4_evict_first)


@functools.cache
def _u16_quad_intrinsic():
    """``load_u64(array, f)``: the 8 bytes at 16-bit element ``f`` of an array's
    data (elements ``f .. f+3``, element ``f`` lowest), one 8-byte load (GPU only;
    callers make sure the address is a multiple of 8)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load_u64(typingctx, array, f):
        sig = types.uint64(array, f)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            i = context.cast(builder, args[1], sig.args[1], types.uint64)
            ptr = builder.bitcast(builder.gep(data, [i]), ir.IntType(64).as_pointer())
            return builder.load(ptr, align=8)

        return sig, codegen

    return load_u64


@cuda.jit(device=True)
def _u16_quad_elements(a, i, j):
    return (np.uint64(a[i, j]) | (np.uint64(a[i, j + _u64(1)]) << np.uint64(16))
            | (np.uint64(a[i, j + _u64(2)]) << np.uint64(32)) | (np.uint64(a[i, j + _u64(3)]) << np.uint64(48)))


@cuda.jit(device=True)
def _always_quads(a):
    return True


@functools.cache
def u16_quad_2d():
    """``(aligned(a) -> bool, load(a, i, j) -> uint64)`` on a 2-D array of 16-bit
    words (bf16 as uint16): ``load`` gives elements ``a[i, j .. j+3]`` as one
    uint64 (``a[i, j]`` in the low 16 bits), one 8-byte load on a GPU (``j`` a
    multiple of 4); ``aligned(a)``: the base and the row pitch are multiples of
    8 bytes and each row's words are adjacent, so that every such load is
    aligned (callers test once and keep an element path for the rest). On the
    simulator: always aligned, four element loads."""
    from .launch import simulator_enabled

    if simulator_enabled():
        return _always_quads, _u16_quad_elements

    address = _intrinsics()[0]
    load_u64 = _u16_quad_intrinsic()

    @cuda.jit(device=True)
    def aligned(a):
        return address(a) & np.uint64(7) == 0 and a.strides[1] == 2 and a.strides[0] % 8 == 0

    @cuda.jit(device=True)
    def load(a, i, j):
        return load_u64(a, _u64(i) * _u64(a.strides[0] // 2) + _u64(j))

    return aligned, load
