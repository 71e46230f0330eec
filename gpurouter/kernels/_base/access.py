"""Loads and stores of each element kind (``f32``, ``bf16`` as raw uint16
words, ``f16``), as device-function factories specialised on the kind
(compile-time conversion code): 2-D and 1-D element access, the bf16 rounding,
and the flat quad access (four consecutive experts per load or store) of the
quad kernels, with the flat ``Spec`` views those kernels take of their arrays.
"""

from __future__ import annotations

from . import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .device import ZERO, u64
from .launch import BF16, DEVICE_DTYPE, F16, F32, simulator_enabled
from .plan import Spec


@functools.cache
def loader_2d(kind: str):
    """Device function ``load(a, i, j) -> fp32`` for a 2-D array of ``kind``."""
    if kind == BF16:

        @cuda.jit(device=True)
        def load(a, i, j):
            # bf16 is the top half of an fp32: shift the word up, reinterpret.
            return np.uint32(np.uint32(a[i, j]) << np.uint32(16)).view(np.float32)

    else:

        @cuda.jit(device=True)
        def load(a, i, j):
            return np.float32(a[i, j])

    return load


@functools.cache
def loader_1d(kind: str):
    """Device function ``load(a, i) -> fp32`` for a 1-D array of ``kind``."""
    if kind == BF16:

        @cuda.jit(device=True)
        def load(a, i):
            return np.uint32(np.uint32(a[i]) << np.uint32(16)).view(np.float32)

    else:

        @cuda.jit(device=True)
        def load(a, i):
            return np.float32(a[i])

    return load


@cuda.jit(device=True)
def bf16_bits(v):
    """fp32 -> bf16 word, round to nearest even, like ml_dtypes' astype.

    NaN becomes the canonical quiet NaN with v's sign (0x7FC0 / 0xFFC0), as
    ml_dtypes (Eigen) does.
    """
    bits = np.float32(v).view(np.uint32)
    if v != v:
        sign = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(0x8000))
        return np.uint16(sign | np.uint32(0x7FC0))
    lsb = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(np.uint32(np.uint32(bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)))


@functools.cache
def storer_2d(kind: str):
    """Device function ``store(a, i, j, v)`` writing fp32 ``v`` into a 2-D array of ``kind``."""
    if kind == BF16:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = bf16_bits(v)

    elif kind == F16:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = np.float16(v)  # cvt.rn.f16.f32: round to nearest even

    else:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = v

    return store


@functools.cache
def storer_1d(kind: str):
    """Device function ``store(a, i, v)`` for a 1-D array of ``kind``."""
    if kind == BF16:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = bf16_bits(v)

    elif kind == F16:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = np.float16(v)

    else:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = v

    return store


BF16_SHIFT = np.uint32(16)
BF16_HIGH = np.uint32(0xFFFF0000)


@cuda.jit(device=True)
def bf16_quad(v0, v1, v2, v3):
    """Four fp32 values as the uint64 of their bf16 words (``v0`` lowest)."""
    lo = np.uint32(bf16_bits(v0)) | np.uint32(np.uint32(bf16_bits(v1)) << BF16_SHIFT)
    hi = np.uint32(bf16_bits(v2)) | np.uint32(np.uint32(bf16_bits(v3)) << BF16_SHIFT)
    return np.uint64(lo) | np.uint64(np.uint64(hi) << np.uint64(32))


@cuda.jit(device=True)
def bf16_halves(w):
    """The two bf16 halves of a uint32 as fp32 (the low half first): each is the top half of its fp32."""
    return np.uint32(w << BF16_SHIFT).view(np.float32), np.uint32(w & BF16_HIGH).view(np.float32)


#: fp16 -> fp32 (``f16_bits_to_f32``): the exponent field once moved into an fp32 word, the
#: rebias (127 - 15) << 23, the field of inf / NaN, and 2^-14 (the renormalising subtrahend)
_F16_EXP = np.uint32(0x0F800000)
_F16_REBIAS = np.uint32(112 << 23)
_F16_MAGIC = np.uint32(113 << 23)


@cuda.jit(device=True)
def f16_bits_to_f32(h):
    """The fp16 word ``h`` (a uint32 < 2^16) as fp32, exactly: zeros, subnormals,
    inf and NaN too (NaN payloads kept).  Integer operations and, for a
    subnormal only, one fp32 subtraction of two normal numbers, so the result
    is the same with or without flush-to-zero.  ``f16_pair_ops``' simulator
    path (a GPU converts with ``cvt.f32.f16``: fewer instructions)."""
    u = np.uint32(np.uint32(h & np.uint32(0x7FFF)) << np.uint32(13))  # exponent and mantissa, fp32-placed
    e = np.uint32(u & _F16_EXP)
    u = np.uint32(u + _F16_REBIAS)
    u = np.uint32(u + (_F16_REBIAS if e == _F16_EXP else np.uint32(0)))  # inf / NaN: fp32's all-ones exponent
    sub = np.uint32(u + np.uint32(1 << 23))  # zero / subnormal: 2^-14 (1 + m / 1024), less 2^-14
    sub = np.float32(sub.view(np.float32) - _F16_MAGIC.view(np.float32)).view(np.uint32)
    u = sub if e == np.uint32(0) else u
    return np.uint32(u | np.uint32(np.uint32(h & np.uint32(0x8000)) << np.uint32(16))).view(np.float32)


@cuda.jit(device=True)
def _f16_halves_bits(w):
    return f16_bits_to_f32(w & np.uint32(0xFFFF)), f16_bits_to_f32(w >> np.uint32(16))


@cuda.jit(device=True)
def _f16_pair_bits(lo, hi):
    return np.uint32(np.uint32(np.float16(lo).view(np.uint16))
                     | np.uint32(np.uint32(np.float16(hi).view(np.uint16)) << np.uint32(16)))


@functools.cache
def f16_pair_ops():
    """``(halves(w) -> 2 x fp32, pack(lo, hi) -> uint32)`` on a uint32 word of two
    fp16 (the low half first): ``halves`` exact, ``pack`` rounding to nearest
    even.  On a GPU inline PTX, ``cvt.f32.f16`` on each half and one
    ``cvt.rn.f16x2.f32`` (numba cannot reinterpret a uint16 as fp16 itself; a
    NaN comes out as the hardware's canonical NaN); on the simulator
    ``f16_bits_to_f32`` and NumPy's conversion."""
    if simulator_enabled():
        return _f16_halves_bits, _f16_pair_bits
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)

    @intrinsic
    def halves(typingctx, word):
        sig = types.UniTuple(types.float32, 2)(word)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.LiteralStructType([f32, f32]), [i32])
            text = "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }"
            w = context.cast(builder, args[0], sig.args[0], types.uint32)
            res = builder.call(ir.InlineAsm(fnty, text, "=f,=f,r"), [w])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(2)])

        return sig, codegen

    @intrinsic
    def pack(typingctx, lo, hi):
        def codegen(context, builder, sig, args):
            x, y = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args, strict=True))
            fnty = ir.FunctionType(i32, [f32, f32])  # cvt.rn.f16x2.f32 d, a, b puts a in d's upper half
            return builder.call(ir.InlineAsm(fnty, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f"), [y, x])

        return types.uint32(lo, hi), codegen

    return halves, pack


@functools.cache
def f16_quad_loader():
    """``load4(a, w) -> 4 x fp32``: quad ``w`` of a flat fp16 array seen as uint64 words
    (``quad_words``), one 8-byte load, the lowest half first, each word's halves
    converted by ``f16_pair_ops``' ``halves``."""
    halves = f16_pair_ops()[0]

    @cuda.jit(device=True)
    def load4(a, w):
        x = a[u64(w)]
        f0, f1 = halves(np.uint32(x))
        f2, f3 = halves(np.uint32(x >> np.uint64(32)))
        return f0, f1, f2, f3

    return load4


@functools.cache
def flat_io(kind: str):
    """Device functions on a row-major ``[T, E]`` array of ``kind`` seen flat
    (E a multiple of 4; ``array_views``), quad ``w`` = experts ``4(w % (E/4))
    .. +3`` of row ``w // (E/4)``, element ``f`` = ``4w + i``:

    ``load4(a, w) -> 4 x fp32``,
    ``store4(a, w, v0, v1, v2, v3)`` (fp32 values) and ``zero4(a, w)``.
    bf16: ``a`` is the array's uint64 words, a quad per load or store; fp32:
    one 16-byte access per quad (``_base/vec.quad_f32``); fp16: the elements.
    """
    if kind == BF16:

        @cuda.jit(device=True)
        def load4(a, w):
            x = a[u64(w)]
            lo = np.uint32(x)
            hi = np.uint32(x >> np.uint64(32))
            return (np.uint32(lo << BF16_SHIFT).view(np.float32), np.uint32(lo & BF16_HIGH).view(np.float32),
                    np.uint32(hi << BF16_SHIFT).view(np.float32), np.uint32(hi & BF16_HIGH).view(np.float32))

        @cuda.jit(device=True)
        def store4(a, w, v0, v1, v2, v3):
            a[u64(w)] = bf16_quad(v0, v1, v2, v3)

        @cuda.jit(device=True)
        def zero4(a, w):
            a[u64(w)] = np.uint64(0)

    elif kind == F32:
        from .vec import quad_f32

        load4, store4 = quad_f32()  # one 16-byte access per quad

        @cuda.jit(device=True)
        def zero4(a, w):
            store4(a, w, ZERO, ZERO, ZERO, ZERO)

    else:

        @cuda.jit(device=True)
        def load4(a, w):
            f = 4 * w
            return (np.float32(a[u64(f)]), np.float32(a[u64(f + 1)]),
                    np.float32(a[u64(f + 2)]), np.float32(a[u64(f + 3)]))

        @cuda.jit(device=True)
        def store4(a, w, v0, v1, v2, v3):
            f = 4 * w
            a[u64(f)] = np.float16(v0)  # cvt.rn: round to nearest even
            a[u64(f + 1)] = np.float16(v1)
            a[u64(f + 2)] = np.float16(v2)
            a[u64(f + 3)] = np.float16(v3)

        @cuda.jit(device=True)
        def zero4(a, w):
            store4(a, w, ZERO, ZERO, ZERO, ZERO)

    return load4, store4, zero4


def array_views(kind: str, shape):
    """``(view of a [T, E] array of kind, view of a [T, E] bool map, view of a
    [T, E] fp32 array)``: the flat Specs the quad kernels take (E a multiple
    of 4): bf16 as uint64 quads, other kinds as elements, the map as uint32
    quads (the four bools of a quad: one word)."""
    t, e = shape
    n = t * e
    words = Spec((n // 4,), np.uint64) if kind == BF16 else Spec((n,), DEVICE_DTYPE[kind])
    return words, Spec((n // 4,), np.uint32), Spec((n,), np.float32)


def quad_words(kind: str, shape) -> Spec:
    """The flat Spec of a ``[T, E]`` array of kind (E a multiple of 4) that a quad
    loader reads: fp32 as elements (``_base/vec.quad_f32``), bf16 and fp16 as uint64
    quads (``flat_io``'s bf16 ``load4``, ``f16_quad_loader``)."""
    t, e = shape
    return Spec((t * e,), np.float32) if kind == F32 else Spec((t * e // 4,), np.uint64)


def map_view(spec: Spec, quads: Spec) -> Spec:
    """The flat view a quad kernel takes of a routing map of ``spec``: the bool
    map as uint32 quad words (``quads``, from ``array_views``), a BITMAP_U8
    map as its bytes."""
    if spec.dtype == np.uint8:
        return Spec((spec.shape[0] * spec.shape[1],), np.uint8)
    return quads
