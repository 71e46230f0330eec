"""The masked aux loss's mask as bits (device functions only; ``aux_loss.py``
launches them, ``column_sums.py`` holds the unmasked sums and the per-element
fallback):

- ``all_ones_if``, ``keep_if``, ``row_bit``: a bitwise select of an fp32 value
  (+0.0 where the mask is 0, whatever the value: NaN and inf too), no branch,
  so no load waits on a mask byte; ``pick``: the same as a float select;
- ``stage_mask_bits``: a block's mask slice as bits in shared memory, a byte
  per 8 rows of a row lane, each mask byte read once a block, the valid rows
  counted on the way (``staged_mask_bytes``: its size, host side);
- ``lane_column_sum_staged(kind)``, ``lane_quad_sum_staged()``: the sums of
  ``column_sums.lane_column_sum`` / ``lane_quad_sum`` (the same rows,
  accumulators and order: the same bits) reading a shared byte per 8 (4) rows
  instead of a global mask byte per element, a trip's loads written before
  their uses (ptxas for sm_90 keeps them in flight together then; written
  interleaved, it issued each after the previous one's add).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .._base.access import flat_io, loader_2d
from .._base.device import ZERO
from .._base.launch import BF16, F32
from .._base.vec import quad_f32

#: every bit of a uint32 (``all_ones_if``)
_ONES = np.uint32(0xFFFFFFFF)


@cuda.jit(device=True)
def all_ones_if(bit):
    """``0xFFFFFFFF`` for ``bit`` 1, 0 for 0 (a uint32 0 or 1)."""
    return np.uint32(_ONES * np.uint32(bit))


@cuda.jit(device=True)
def keep_if(v, m):
    """fp32 ``v`` where ``m`` is ``0xFFFFFFFF``, +0.0 where it is 0: a select on
    the bits (no branch, so no load is made conditional on the mask; a masked
    NaN or inf becomes +0.0, what a zeroed row adds)."""
    return np.uint32(np.float32(v).view(np.uint32) & m).view(np.float32)


@cuda.jit(device=True)
def pick(v, keep):
    """fp32 ``v`` if ``keep`` else +0.0 (a select: both values computed, no branch)."""
    return v if keep else ZERO


@cuda.jit(device=True)
def row_bit(byte, i):
    """``all_ones_if`` of bit ``i`` of ``byte`` (uint32)."""
    return all_ones_if(np.uint32(byte >> np.uint32(i)) & np.uint32(1))


def staged_mask_bytes(rows_per_block: int, row_lanes: int) -> int:
    """Host: the shared bytes ``stage_mask_bits`` fills for a block of
    ``rows_per_block`` rows and ``row_lanes`` row lanes: ``row_lanes * nb``, nb =
    ``ceil(ceil(rows_per_block / row_lanes) / 8)`` (a row lane's bytes)."""
    per_lane = -(-rows_per_block // row_lanes)  # a row lane's rows at most
    return row_lanes * ((per_lane + 7) // 8)


@cuda.jit(device=True)
def valid_bit(mask, r, last):
    """1 if row ``r <= last`` is valid in the bool ``mask``, else 0 (uint32): the load
    clamped to ``last`` and unconditional (no branch before the next row's load)."""
    return np.uint32(np.uint32(mask[min(r, last)] != 0) & np.uint32(r <= last))


@cuda.jit(device=True)
def stage_mask_bits(mask, bits, r0, r1, nrl, nb, tid, nthreads):
    """The block's rows ``r0 <= r < r1`` of the bool ``mask`` as bits in the shared
    uint8 ``bits [nrl * nb]``: byte ``rl * nb + j``, bit i says whether row ``r0 +
    rl + (8 j + i) nrl`` is valid (0 past r1), for row lane rl's k-th row ``r0 +
    rl + k nrl`` at byte ``k // 8``, bit ``k % 8``; the threads share the bytes
    out, each mask byte read once, a byte's 8 loads in flight together (no
    branch between them).  Returns the thread's count of valid rows (exact in
    fp32).  The caller's barrier follows before ``bits`` is read (an empty
    block stages nothing: its sums read no bits)."""
    k = ZERO
    if r1 > r0:
        last = r1 - 1
        idx = tid
        while idx < nrl * nb:
            lane = idx // nb
            r = r0 + lane + 8 * (idx - lane * nb) * nrl
            b0 = valid_bit(mask, r, last)
            b1 = valid_bit(mask, r + nrl, last)
            b2 = valid_bit(mask, r + 2 * nrl, last)
            b3 = valid_bit(mask, r + 3 * nrl, last)
            b4 = valid_bit(mask, r + 4 * nrl, last)
            b5 = valid_bit(mask, r + 5 * nrl, last)
            b6 = valid_bit(mask, r + 6 * nrl, last)
            b7 = valid_bit(mask, r + 7 * nrl, last)
            bits[idx] = np.uint8(b0 | (b1 << np.uint32(1)) | (b2 << np.uint32(2)) | (b3 << np.uint32(3))
                                 | (b4 << np.uint32(4)) | (b5 << np.uint32(5)) | (b6 << np.uint32(6))
                                 | (b7 << np.uint32(7)))
            k += np.float32(b0 + b1 + b2 + b3 + b4 + b5 + b6 + b7)
            idx += nthreads
    return k


@functools.cache
def lane_column_sum_staged(kind: str):
    """Device function ``sum(src, r0, r1, c, rl, nrl, bits, base)``: ``lane_column_sum(kind,
    True)``'s sum (the same rows, accumulators and order: the same bits) with the
    mask read from the staged ``bits`` (``stage_mask_bits``; ``base = rl * nb``):
    one shared byte per 8 rows, the rows' values kept by a bitwise select."""
    raw = loader_2d(kind)

    @cuda.jit(device=True)
    def column_sum(src, r0, r1, c, rl, nrl, bits, base):
        a0 = ZERO
        a1 = ZERO
        a2 = ZERO
        a3 = ZERO
        a4 = ZERO
        a5 = ZERO
        a6 = ZERO
        a7 = ZERO
        r = r0 + rl
        j = base
        while r + 7 * nrl < r1:  # 8 independent loads in flight, their 8 bits in one byte
            # the 8 loads first, then their uses: written interleaved, ptxas (sm_90) issued
            # each load after the previous one's add (one load in flight, not 8)
            x0 = raw(src, r, c)
            x1 = raw(src, r + nrl, c)
            x2 = raw(src, r + 2 * nrl, c)
            x3 = raw(src, r + 3 * nrl, c)
            x4 = raw(src, r + 4 * nrl, c)
            x5 = raw(src, r + 5 * nrl, c)
            x6 = raw(src, r + 6 * nrl, c)
            x7 = raw(src, r + 7 * nrl, c)
            b = np.uint32(bits[j])
            a0 += keep_if(x0, row_bit(b, 0))
            a1 += keep_if(x1, row_bit(b, 1))
            a2 += keep_if(x2, row_bit(b, 2))
            a3 += keep_if(x3, row_bit(b, 3))
            a4 += keep_if(x4, row_bit(b, 4))
            a5 += keep_if(x5, row_bit(b, 5))
            a6 += keep_if(x6, row_bit(b, 6))
            a7 += keep_if(x7, row_bit(b, 7))
            r += 8 * nrl
            j += 1
        if r < r1:  # the last (< 8) rows: bits 0, 1, ... of byte j
            b = np.uint32(bits[j])
            i = 0
            while r < r1:
                a0 += keep_if(raw(src, r, c), row_bit(b, i))
                r += nrl
                i += 1
        return np.float32(np.float32(np.float32(a0 + a1) + np.float32(a2 + a3))
                          + np.float32(np.float32(a4 + a5) + np.float32(a6 + a7)))

    return column_sum


@functools.cache
def lane_quad_sum_staged(kind: str = F32):
    """Device function ``sum4(src, r0, r1, cq, eq, rl, nrl, bits, base) -> 4 x fp32``:
    ``lane_quad_sum(True, kind)``'s sums (the same rows, accumulators and order) with
    the mask read from the staged ``bits`` (``stage_mask_bits``; ``base = rl *
    nb``): one shared byte per 4 rows (a nibble of it each), the values kept
    by a float select (``pick``; with ``keep_if``'s bitcasts ptxas for sm_90
    kept one 16-byte load in flight, with ``pick`` two)."""
    raw4 = flat_io(kind)[0] if kind == BF16 else quad_f32()[0]

    @cuda.jit(device=True)
    def load4(src, r, eq, cq, m):
        x0, x1, x2, x3 = raw4(src, np.int64(r) * eq + cq)
        return keep_if(x0, m), keep_if(x1, m), keep_if(x2, m), keep_if(x3, m)

    @cuda.jit(device=True)
    def quad_sum(src, r0, r1, cq, eq, rl, nrl, bits, base):
        a0 = ZERO
        a1 = ZERO
        a2 = ZERO
        a3 = ZERO
        b0 = ZERO
        b1 = ZERO
        b2 = ZERO
        b3 = ZERO
        c0 = ZERO
        c1 = ZERO
        c2 = ZERO
        c3 = ZERO
        d0 = ZERO
        d1 = ZERO
        d2 = ZERO
        d3 = ZERO
        r = r0 + rl
        k = 0  # the row lane's row index: bit k % 8 of byte base + k // 8
        while r + 3 * nrl < r1:  # 4 independent 16-byte loads in flight, their bits one nibble
            x0, x1, x2, x3 = raw4(src, np.int64(r) * eq + cq)  # the loads first (see lane_column_sum_staged)
            y0, y1, y2, y3 = raw4(src, np.int64(r + nrl) * eq + cq)
            z0, z1, z2, z3 = raw4(src, np.int64(r + 2 * nrl) * eq + cq)
            w0, w1, w2, w3 = raw4(src, np.int64(r + 3 * nrl) * eq + cq)
            b = np.uint32(np.uint32(bits[base + (k >> 3)]) >> np.uint32(k & 7))
            m = (b & np.uint32(1)) != 0
            a0 += pick(x0, m)
            a1 += pick(x1, m)
            a2 += pick(x2, m)
            a3 += pick(x3, m)
            m = (b & np.uint32(2)) != 0
            b0 += pick(y0, m)
            b1 += pick(y1, m)
            b2 += pick(y2, m)
            b3 += pick(y3, m)
            m = (b & np.uint32(4)) != 0
            c0 += pick(z0, m)
            c1 += pick(z1, m)
            c2 += pick(z2, m)
            c3 += pick(z3, m)
            m = (b & np.uint32(8)) != 0
            d0 += pick(w0, m)
            d1 += pick(w1, m)
            d2 += pick(w2, m)
            d3 += pick(w3, m)
            r += 4 * nrl
            k += 4
        while r < r1:
            x0, x1, x2, x3 = load4(src, r, eq, cq, row_bit(np.uint32(bits[base + (k >> 3)]), k & 7))
            a0 += x0
            a1 += x1
            a2 += x2
            a3 += x3
            r += nrl
            k += 1
        return (np.float32(np.float32(a0 + b0) + np.float32(c0 + d0)),
                np.float32(np.float32(a1 + b1) + np.float32(c1 + d1)),
                np.float32(np.float32(a2 + b2) + np.float32(c2 + d2)),
                np.float32(np.float32(a3 + b3) + np.float32(c3 + d3)))

    return quad_sum
