"""Element and quad I/O shared by the token-level MoE kernels (``moe_*.py``).

A row-major ``[N, H]`` array of a float kind is read and written in *units*
of four columns: unit ``u`` of row ``i`` is columns ``4u .. 4u + 3``.

- ``quads`` (``H % 4 == 0``): the array is seen flat (``flat_view``): bf16 as
  ``uint64`` words (one 8-byte access per unit), fp32 as elements with one
  16-byte access per unit on a GPU (``_base/vec.quad_f32``), fp16 as elements;
- otherwise the 2-D array, four element accesses, the columns ``>= H`` read
  as 0 and never written.

All values are fp32 in registers; stores round once (bf16: to nearest even,
NaN canonical, as ml_dtypes; fp16: ``cvt.rn``).  These helpers are the MoE
kernels' own (the router kernels' loaders live in ``topk.py``, which is being
restructured): a later merge into one device-helper module is a move, not a
change.

"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .._base import launch as L
from .._base.plan import Spec

_u64 = np.uint64  # unsigned global indices: numba wraps signed ones (i < 0: i + n)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_U16 = np.uint32(16)
_HIGH = np.uint32(0xFFFF0000)


def moe_jit(max_registers: int = 0):
    """``cuda.jit``, with a register cap where one is asked for on a GPU (the
    simulator's ``jit`` takes none): more resident blocks for a streaming kernel."""
    from .._base.launch import simulator_enabled

    if max_registers and not simulator_enabled():
        return cuda.jit(max_registers=int(max_registers))
    return cuda.jit


def flat_view(kind: str, shape) -> Spec:
    """The flat Spec a quads kernel takes for a ``[N, H]`` array of ``kind``
    (``H % 4 == 0``): bf16 as ``uint64`` words, other kinds as elements."""
    n = int(np.prod(shape, dtype=np.int64))
    if kind == L.BF16:
        return Spec((max(n // 4, 1),), np.uint64)
    return Spec((max(n, 1),), L.DEVICE_DTYPE[kind])


@cuda.jit(device=True)
def bf16_bits(v):
    """fp32 -> bf16 word, round to nearest even (NaN: canonical quiet NaN with v's sign)."""
    bits = np.float32(v).view(np.uint32)
    if v != v:
        sign = np.uint32(np.uint32(bits >> _U16) & np.uint32(0x8000))
        return np.uint16(sign | np.uint32(0x7FC0))
    lsb = np.uint32(np.uint32(bits >> _U16) & np.uint32(1))
    return np.uint16(np.uint32(np.uint32(bits + np.uint32(0x7FFF) + lsb) >> _U16))


@cuda.jit(device=True)
def _bf16_quad(v0, v1, v2, v3):
    lo = np.uint32(bf16_bits(v0)) | np.uint32(np.uint32(bf16_bits(v1)) << _U16)
    hi = np.uint32(bf16_bits(v2)) | np.uint32(np.uint32(bf16_bits(v3)) << _U16)
    return np.uint64(lo) | np.uint64(np.uint64(hi) << np.uint64(32))


@functools.cache
def scalar_io(kind: str):
    """``(load(a, i) -> fp32, store(a, i, v))`` on element ``i`` of a flat array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def load(a, i):
            return np.uint32(np.uint32(a[_u64(i)]) << _U16).view(np.float32)

        @cuda.jit(device=True)
        def store(a, i, v):
            a[_u64(i)] = bf16_bits(v)

    elif kind == L.F16:

        @cuda.jit(device=True)
        def load(a, i):
            return np.float32(a[_u64(i)])

        @cuda.jit(device=True)
        def store(a, i, v):
            a[_u64(i)] = np.float16(v)

    else:

        @cuda.jit(device=True)
        def load(a, i):
            return np.float32(a[_u64(i)])

        @cuda.jit(device=True)
        def store(a, i, v):
            a[_u64(i)] = v

    return load, store


@functools.cache
def unit_io(kind: str, quads: bool):
    """``(load4(a, i, u, units, h) -> 4 x fp32, store4(a, i, u, units, h, v0, v1, v2, v3))``
    on unit ``u`` of row ``i`` (module docstring).  ``a`` is the flat view
    when ``quads`` (``units = H / 4``), else the 2-D ``[N, H]`` array."""
    if quads:
        if kind == L.BF16:

            @cuda.jit(device=True)
            def load4(a, i, u, units, h):
                x = a[_u64(np.int64(i) * units + u)]
                lo = np.uint32(x)
                hi = np.uint32(x >> np.uint64(32))
                return (np.uint32(lo << _U16).view(np.float32), np.uint32(lo & _HIGH).view(np.float32),
                        np.uint32(hi << _U16).view(np.float32), np.uint32(hi & _HIGH).view(np.float32))

            @cuda.jit(device=True)
            def store4(a, i, u, units, h, v0, v1, v2, v3):
                a[_u64(np.int64(i) * units + u)] = _bf16_quad(v0, v1, v2, v3)

            return load4, store4
        if kind == L.F32:
            from .._base.vec import quad_f32

            load_q, store_q = quad_f32()  # one 16-byte access per unit on a GPU

            @cuda.jit(device=True)
            def load4(a, i, u, units, h):
                return load_q(a, np.int64(i) * units + u)

            @cuda.jit(device=True)
            def store4(a, i, u, units, h, v0, v1, v2, v3):
                store_q(a, np.int64(i) * units + u, v0, v1, v2, v3)

            return load4, store4
        ld, st = scalar_io(kind)

        @cuda.jit(device=True)
        def load4(a, i, u, units, h):
            f = 4 * (np.int64(i) * units + u)
            return ld(a, f), ld(a, f + 1), ld(a, f + 2), ld(a, f + 3)

        @cuda.jit(device=True)
        def store4(a, i, u, units, h, v0, v1, v2, v3):
            f = 4 * (np.int64(i) * units + u)
            st(a, f, v0)
            st(a, f + 1, v1)
            st(a, f + 2, v2)
            st(a, f + 3, v3)

        return load4, store4

    ld2, st2 = _element_io(kind)

    @cuda.jit(device=True)
    def load4(a, i, u, units, h):
        c = 4 * u
        return ld2(a, i, c, h), ld2(a, i, c + 1, h), ld2(a, i, c + 2, h), ld2(a, i, c + 3, h)

    @cuda.jit(device=True)
    def store4(a, i, u, units, h, v0, v1, v2, v3):
        c = 4 * u
        st2(a, i, c, h, v0)
        st2(a, i, c + 1, h, v1)
        st2(a, i, c + 2, h, v2)
        st2(a, i, c + 3, h, v3)

    return load4, store4


@functools.cache
def _element_io(kind: str):
    """``(load(a, i, c, h), store(a, i, c, h, v))`` on ``a[i, c]`` of a 2-D array;
    columns ``c >= h`` read as 0 and are not written."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def load(a, i, c, h):
            if c < h:
                return np.uint32(np.uint32(a[_u64(i), _u64(c)]) << _U16).view(np.float32)
            return _ZERO

        @cuda.jit(device=True)
        def store(a, i, c, h, v):
            if c < h:
                a[_u64(i), _u64(c)] = bf16_bits(v)

    elif kind == L.F16:

        @cuda.jit(device=True)
        def load(a, i, c, h):
            if c < h:
                return np.float32(a[_u64(i), _u64(c)])
            return _ZERO

        @cuda.jit(device=True)
        def store(a, i, c, h, v):
            if c < h:
                a[_u64(i), _u64(c)] = np.float16(v)

    else:

        @cuda.jit(device=True)
        def load(a, i, c, h):
            if c < h:
                return np.float32(a[_u64(i), _u64(c)])
            return _ZERO

        @cuda.jit(device=True)
        def store(a, i, c, h, v):
            if c < h:
                a[_u64(i), _u64(c)] = v

    return load, store


@cuda.jit(device=True)
def popc32(x):
    """The set bits of a uint32 (SWAR: the same integer ops on a GPU and the simulator)."""
    x = np.uint32(x - np.uint32(np.uint32(x >> np.uint32(1)) & np.uint32(0x55555555)))
    m2 = np.uint32(0x33333333)
    x = np.uint32(np.uint32(x & m2) + np.uint32(np.uint32(x >> np.uint32(2)) & m2))
    x = np.uint32(np.uint32(x + np.uint32(x >> np.uint32(4))) & np.uint32(0x0F0F0F0F))
    return np.int32(np.uint32(np.uint32(x * np.uint32(0x01010101)) >> np.uint32(24)))

