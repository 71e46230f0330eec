"""Row units of the token-level MoE streaming kernels, and the lanes'
fixed-order sums of their row dots (``lane_tree_sums``: warp shuffles on
the GPU, the same tree in shared memory on the simulator).

Row units (``row_mode``, ``row_io``, ``cols_io``): the kernels move 16 bytes
per access where the layout allows it.  A bf16 row with ``H % 8 == 0`` is cut
into units of *eight* columns (mode ``OCT``: the array seen as fp32 words, one
16-byte load of four words, each word two bf16); otherwise units of four
columns as in ``moe_io`` (``QUAD``: flat, ``GRID``: 2-D).  A load returns the
unit's four raw 32-bit words (fp32 values already, except in ``OCT`` mode),
kept as loaded until used (half the registers of unpacked bf16), and
``unpack`` turns them into the unit's ``row_width`` fp32 values.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .._base import launch as L
from .._base.launch import simulator_enabled
from .._base.plan import Spec
from .io import _HIGH, _U16, _ZERO, bf16_bits, flat_view, unit_io

#: row-unit modes (module docstring): 8 bf16 columns per 16-byte access, 4 columns flat, 4 columns 2-D
OCT, QUAD, GRID = "oct", "quad", "grid"


def row_mode(kind: str, hidden: int) -> str:
    """The row-unit mode of a ``[., H]`` array of ``kind`` (module docstring)."""
    if hidden > 0 and hidden % 8 == 0 and kind == L.BF16:
        return OCT
    return QUAD if hidden > 0 and hidden % 4 == 0 else GRID


def row_width(mode: str) -> int:
    """Columns per row unit: 8 (``OCT``) or 4."""
    return 8 if mode == OCT else 4


def row_units(mode: str, hidden: int) -> int:
    """Row units per row (the last one may be partial in ``GRID`` mode)."""
    w = row_width(mode)
    return -(-int(hidden) // w)


def row_view(kind: str, shape, mode: str) -> Spec | None:
    """The Spec a row-unit kernel takes for a ``[N, H]`` array of ``kind`` in
    ``mode`` (None: the 2-D array itself)."""
    if mode == OCT and kind == L.BF16:  # fp32 words, two bf16 each
        n = int(np.prod(shape, dtype=np.int64))
        return Spec((max(n // 2, 1),), np.float32)
    return None if mode == GRID else flat_view(kind, shape)


@cuda.jit(device=True)
def _unpack_bf16x2(wd, dst, off):
    bits = np.float32(wd).view(np.uint32)
    dst[off] = np.uint32(bits << _U16).view(np.float32)
    dst[off + 1] = np.uint32(bits & _HIGH).view(np.float32)


@cuda.jit(device=True)
def _pack_bf16x2(src, off):
    return np.uint32(np.uint32(bf16_bits(src[off])) | np.uint32(np.uint32(bf16_bits(src[off + 1])) << _U16)).view(
        np.float32)


@functools.cache
def row_io(kind: str, mode: str):
    """``(load(a, i, u, units, h) -> 4 words, unpack(w0, w1, w2, w3, dst, off),
    store(a, i, u, units, h, src, off))`` on row unit ``u`` of row ``i``
    (module docstring): ``unpack`` writes the unit's ``row_width(mode)`` fp32
    values to ``dst[off:]``, ``store`` rounds ``src[off:]`` into the unit."""
    if mode == OCT:
        from .._base.vec import quad_f32

        load_q, store_q = quad_f32()  # one 16-byte access per unit on a GPU (aligned arrays)

        @cuda.jit(device=True)
        def load_oct_words(a, i, u, units, h):
            return load_q(a, np.int64(i) * units + u)

        @cuda.jit(device=True)
        def unpack_oct_words(w0, w1, w2, w3, dst, off):
            _unpack_bf16x2(w0, dst, off)
            _unpack_bf16x2(w1, dst, off + 2)
            _unpack_bf16x2(w2, dst, off + 4)
            _unpack_bf16x2(w3, dst, off + 6)

        @cuda.jit(device=True)
        def store_oct_unit(a, i, u, units, h, src, off):
            store_q(a, np.int64(i) * units + u, _pack_bf16x2(src, off), _pack_bf16x2(src, off + 2),
                    _pack_bf16x2(src, off + 4), _pack_bf16x2(src, off + 6))

        return load_oct_words, unpack_oct_words, store_oct_unit
    load4, store4 = unit_io(kind, mode == QUAD)

    @cuda.jit(device=True)
    def unpack_quad_words(w0, w1, w2, w3, dst, off):
        dst[off] = w0
        dst[off + 1] = w1
        dst[off + 2] = w2
        dst[off + 3] = w3

    @cuda.jit(device=True)
    def store_quad_unit(a, i, u, units, h, src, off):
        store4(a, i, u, units, h, src[off], src[off + 1], src[off + 2], src[off + 3])

    return load4, unpack_quad_words, store_quad_unit


@functools.cache
def cols_io(kind: str, mode: str):
    """``(load(a, i, u, units, h, dst, off), store(a, i, u, units, h, src, off))``:
    the ``row_width(mode)`` columns of row unit ``u`` (``units`` per row) of a
    ``[., H]`` array of any ``kind`` (seen as ``row_view(kind, ., mode)``), as fp32
    values in ``dst[off:]`` / from ``src[off:]``: for arrays that go with a
    streamed one (biases, fp32 accumulators)."""
    if mode == OCT and kind == L.BF16:
        load_w, unpack, store_w = row_io(kind, mode)

        @cuda.jit(device=True)
        def load_oct_cols(a, i, u, units, h, dst, off):
            w0, w1, w2, w3 = load_w(a, i, u, units, h)
            unpack(w0, w1, w2, w3, dst, off)

        return load_oct_cols, store_w
    load4, store4 = unit_io(kind, mode != GRID)
    if mode == OCT:  # two quads per unit

        @cuda.jit(device=True)
        def load_two_quads(a, i, u, units, h, dst, off):
            for k in range(2):
                v0, v1, v2, v3 = load4(a, i, 2 * u + k, 2 * units, h)
                dst[off + 4 * k] = v0
                dst[off + 4 * k + 1] = v1
                dst[off + 4 * k + 2] = v2
                dst[off + 4 * k + 3] = v3

        @cuda.jit(device=True)
        def store_two_quads(a, i, u, units, h, src, off):
            for k in range(2):
                o = off + 4 * k
                store4(a, i, 2 * u + k, 2 * units, h, src[o], src[o + 1], src[o + 2], src[o + 3])

        return load_two_quads, store_two_quads

    @cuda.jit(device=True)
    def load_quad_cols(a, i, u, units, h, dst, off):
        v0, v1, v2, v3 = load4(a, i, u, units, h)
        dst[off] = v0
        dst[off + 1] = v1
        dst[off + 2] = v2
        dst[off + 3] = v3

    @cuda.jit(device=True)
    def store_quad_cols(a, i, u, units, h, src, off):
        store4(a, i, u, units, h, src[off], src[off + 1], src[off + 2], src[off + 3])

    return load_quad_cols, store_quad_cols


@functools.cache
def lane_tree_sums(hold: int, lanes: int):
    """``(publish(red, part, lane, parity), total(red, k, parity) -> fp32, words)``:
    the fixed-order sum over a block's ``lanes`` lanes (a power of two up to 32,
    or a multiple of 32) of each lane's ``hold`` partials ``part``, with ONE
    barrier per call.  The order: within each warp (``min(lanes, 32)`` lanes)
    a butterfly tree, lanes paired by their highest bit first (16, 8, 4, 2, 1),
    then the warps' sums added in warp order.  On the GPU the tree is
    ``shfl_xor`` steps and lane ``k mod min(lanes, 32)`` of each warp writes
    row ``k``'s warp sum to shared memory; on the simulator (no shuffles) every lane's partials go
    to shared memory and ``total`` walks the same tree there: the same bits on
    both.  ``red`` is a shared fp32 array of ``words`` (two halves, used in
    turn by ``parity``: a half is written again only two calls later, after
    the next call's barrier, so readers of this call never race a writer).
    Every thread calls ``publish``; after it, ``total(red, k, parity)`` is row
    ``k``'s sum (any thread)."""
    wl = min(lanes, 32)
    nw = lanes // wl
    levels = wl.bit_length() - 1
    top = wl // 2
    mask = np.uint32(0xFFFFFFFF if wl == 32 else (1 << wl) - 1)
    assert wl & (wl - 1) == 0 and lanes % wl == 0, lanes

    if simulator_enabled():
        half = hold * lanes

        @cuda.jit(device=True)
        def lane_tree_publish(red, part, lane, parity):
            for k in range(hold):
                red[parity * half + k * lanes + lane] = part[k]
            # Barrier: every lane's partials are in.
            cuda.syncthreads()

        @cuda.jit(device=True)
        def lane_tree_total(red, k, parity):
            vals = cuda.local.array(32, np.float32)
            s = _ZERO
            for w in range(nw):
                base = parity * half + k * lanes + w * wl
                for i in range(wl):
                    vals[i] = red[base + i]
                span = top
                for _ in range(levels):
                    for i in range(span):
                        vals[i] = np.float32(vals[i] + vals[i + span])
                    span //= 2
                s = vals[0] if w == 0 else np.float32(s + vals[0])
            return s

        return lane_tree_publish, lane_tree_total, 2 * half

    half = hold * nw

    one_each = hold <= wl  # a constant: each lane writes one row at most (one store after the tree)

    @cuda.jit(device=True)
    def lane_tree_publish(red, part, lane, parity):
        me = lane & (wl - 1)
        mine = _ZERO
        for k in range(hold):  # unrolled (hold is a constant): part stays in registers
            v = part[k]
            off = top
            for _ in range(levels):
                v = np.float32(v + cuda.shfl_xor_sync(mask, v, np.int32(off)))
                off //= 2
            if one_each:
                if me == k:
                    mine = v
            elif me == k % wl:
                red[parity * half + k * nw + lane // wl] = v
        if one_each and me < hold:
            red[parity * half + me * nw + lane // wl] = mine
        # Barrier: every warp's sums are in.
        cuda.syncthreads()

    @cuda.jit(device=True)
    def lane_tree_total(red, k, parity):
        base = parity * half + k * nw
        s = red[base]
        for w in range(1, nw):
            s = np.float32(s + red[base + w])
        return s

    return lane_tree_publish, lane_tree_total, 2 * half
