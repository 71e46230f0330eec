"""The aux loss forward's column sums (``aux_loss.py``; device functions only).

A block is RL row lanes x CL column lanes (``tiling.column_tiling``).
Thread (rl, cl) owns columns (or, with C % 4 == 0, column quads) cl,
cl + CL, ... and, of its block's rows, those congruent to rl mod RL, summed
with independent accumulators so that several loads are in flight per
thread (the sums are bandwidth-bound only if enough bytes are in flight,
~4 MB on an H200): 8 element loads, or 4 quad loads (16 bytes fp32, 8 bf16
and fp16).  Every order is fixed: deterministic.

- ``lane_column_sum(kind, has_mask)``: one column, elements of ``kind``;
- ``lane_quad_sum(has_mask, kind)``: one column quad, fp32 (``_base/vec.quad_f32``),
  bf16 or fp16 (a uint64 word, ``access.flat_io`` / ``access.f16_quad_loader``);

``has_mask`` (a compile-time flag): the sums take a bool ``mask [T]`` too and
leave out the rows where it is False (a bitwise select, ``mask_bits.keep_if``,
not a product: a masked NaN or inf adds +0.0, exactly what a zeroed row
adds); without it the ``mask`` argument is never read.  A row's mask byte is
loaded with its values, in the same trip (docs/kernels.md, "Token masks in
the loss kernels", has what else was measured).
- ``block_tree_sum``: a block's values summed by a fixed-shape tree
  (``block_tree_sum2``: two arrays in one tree, the masked aux loss's sums
  and valid-row counts).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .._base.access import f16_quad_loader, flat_io, loader_2d
from .._base.device import ZERO
from .._base.launch import BF16, F16, F32
from .._base.vec import quad_f32
from .mask_bits import all_ones_if, keep_if


@functools.cache
def lane_column_sum(kind: str, has_mask: bool = False):
    """Device function ``sum(src, r0, r1, c, rl, nrl, mask)``: fp32 sum of ``src[r, c]``
    (``src`` of ``kind``) over ``r0 <= r < r1`` with ``r = r0 + rl (mod nrl)`` (and,
    ``has_mask``, ``mask[r]``), in a fixed order: 8 interleaved accumulators, then
    a pairwise tree of them."""
    raw = loader_2d(kind)

    if has_mask:

        @cuda.jit(device=True)
        def load(src, r, c, mask):
            # a select on the value's bits, no branch: the load is issued whatever the mask
            return keep_if(raw(src, r, c), all_ones_if(np.uint32(mask[r] != 0)))

    else:

        @cuda.jit(device=True)
        def load(src, r, c, mask):
            return raw(src, r, c)

    @cuda.jit(device=True)
    def column_sum(src, r0, r1, c, rl, nrl, mask):
        a0 = ZERO
        a1 = ZERO
        a2 = ZERO
        a3 = ZERO
        a4 = ZERO
        a5 = ZERO
        a6 = ZERO
        a7 = ZERO
        r = r0 + rl
        while r + 7 * nrl < r1:  # 8 independent loads in flight
            a0 += load(src, r, c, mask)
            a1 += load(src, r + nrl, c, mask)
            a2 += load(src, r + 2 * nrl, c, mask)
            a3 += load(src, r + 3 * nrl, c, mask)
            a4 += load(src, r + 4 * nrl, c, mask)
            a5 += load(src, r + 5 * nrl, c, mask)
            a6 += load(src, r + 6 * nrl, c, mask)
            a7 += load(src, r + 7 * nrl, c, mask)
            r += 8 * nrl
        while r < r1:
            a0 += load(src, r, c, mask)
            r += nrl
        return np.float32(np.float32(np.float32(a0 + a1) + np.float32(a2 + a3))
                          + np.float32(np.float32(a4 + a5) + np.float32(a6 + a7)))

    return column_sum


@cuda.jit(device=True)
def block_tree_sum(red, tid, n):
    """``red[0] = red[0] + ... + red[n - 1]`` by a fixed-shape tree (pairs ``(i, i +
    ceil(n / 2))``, any n), every thread of the block calling it; ``red[tid]``
    written by its thread before the call.  Deterministic."""
    # Barrier: the tree reads other threads' values.
    cuda.syncthreads()
    while n > 1:
        half = (n + 1) // 2
        if tid < n - half:
            red[tid] = np.float32(red[tid] + red[tid + half])
        # Barrier: the next level reads this level's results.
        cuda.syncthreads()
        n = half


@cuda.jit(device=True)
def block_tree_sum2(red, red2, tid, n):
    """``block_tree_sum`` of two arrays at once (the same fixed tree, the same
    barriers): ``red[0]`` and ``red2[0]`` the sums of their first n values."""
    # Barrier: the tree reads other threads' values.
    cuda.syncthreads()
    while n > 1:
        half = (n + 1) // 2
        if tid < n - half:
            red[tid] = np.float32(red[tid] + red[tid + half])
            red2[tid] = np.float32(red2[tid] + red2[tid + half])
        # Barrier: the next level reads this level's results.
        cuda.syncthreads()
        n = half


@functools.cache
def lane_quad_sum(has_mask: bool = False, kind: str = F32):
    """Device function ``sum4(src, r0, r1, cq, eq, rl, nrl, mask) -> 4 x fp32``: the column
    sums of quad ``cq`` of ``src`` (flat, ``eq`` quads a row: fp32 elements, bf16 and fp16
    as uint64 words, ``access.quad_words``) over ``r0 <= r < r1`` with ``r = r0 + rl (mod
    nrl)`` (and, ``has_mask``, ``mask[r]``): a load a quad (fp32: 16 bytes, ``_base/vec.quad_f32``;
    bf16 and fp16: 8, ``flat_io`` / ``f16_quad_loader``), 4 rows in flight, then a pairwise
    tree of the 4 row accumulators, in a fixed order."""
    raw4 = flat_io(kind)[0] if kind == BF16 else f16_quad_loader() if kind == F16 else quad_f32()[0]

    if has_mask:

        @cuda.jit(device=True)
        def load4(src, r, eq, cq, mask):
            x0, x1, x2, x3 = raw4(src, np.int64(r) * eq + cq)
            m = all_ones_if(np.uint32(mask[r] != 0))
            return keep_if(x0, m), keep_if(x1, m), keep_if(x2, m), keep_if(x3, m)

    else:

        @cuda.jit(device=True)
        def load4(src, r, eq, cq, mask):
            return raw4(src, np.int64(r) * eq + cq)

    @cuda.jit(device=True)
    def quad_sum(src, r0, r1, cq, eq, rl, nrl, mask):
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
        while r + 3 * nrl < r1:  # 4 independent 16-byte loads in flight
            x0, x1, x2, x3 = load4(src, r, eq, cq, mask)
            y0, y1, y2, y3 = load4(src, r + nrl, eq, cq, mask)
            z0, z1, z2, z3 = load4(src, r + 2 * nrl, eq, cq, mask)
            w0, w1, w2, w3 = load4(src, r + 3 * nrl, eq, cq, mask)
            a0 += x0
            a1 += x1
            a2 += x2
            a3 += x3
            b0 += y0
            b1 += y1
            b2 += y2
            b3 += y3
            c0 += z0
            c1 += z1
            c2 += z2
            c3 += z3
            d0 += w0
            d1 += w1
            d2 += w2
            d3 += w3
            r += 4 * nrl
        while r < r1:
            x0, x1, x2, x3 = load4(src, r, eq, cq, mask)
            a0 += x0
            a1 += x1
            a2 += x2
            a3 += x3
            r += nrl
        return (np.float32(np.float32(a0 + b0) + np.float32(c0 + d0)),
                np.float32(np.float32(a1 + b1) + np.float32(c1 + d1)),
                np.float32(np.float32(a2 + b2) + np.float32(c2 + d2)),
                np.float32(np.float32(a3 + b3) + np.float32(c3 + d3)))

    return quad_sum

