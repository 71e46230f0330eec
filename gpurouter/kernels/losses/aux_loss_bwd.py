"""The aux loss's backward kernels (``aux_loss.py`` holds the forward, the
launchers and the plans): ``grad_probs[r, c] = C * f32(tpe[c]) * f32(grad_loss)``,
every row alike (0 on the masked rows of a ``has_mask`` build)."""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from .._base.parallel import recipe

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import uint8 as nb_u8

from .._base.access import bf16_quad, flat_io, loader_1d, storer_2d
from .._base.device import ZERO, u64
from .._base.launch import BF16, F16, F32
from .mask_bits import all_ones_if, keep_if, opaque_byte_loader

#: a 0 / 0xFFFFFFFF mask times this: 0 / all 64 bits (a bf16 quad's select)
_LOW_AND_HIGH = np.uint64(0x100000001)


def staged_fill(out_kind: str) -> bool:
    """Whether the masked quad fill of ``out_kind`` stages its flags (bf16, fp32) or loads
    each row's flag ahead of its store (fp16); measured on an H200, 2026-11-29: masked /
    unmasked at T = 65536, E = 256 / 384, staged against per row, bf16 1.08-1.12 / 1.08-1.09
    against 1.06-1.11 / 1.19-1.24, fp32 1.05 / 1.03 against 1.07 / 1.05, fp16 1.42 / 1.47
    against 1.08 / 1.09 (``tools/probes/loss_mask_breakdown.py``)."""
    return out_kind != F16


def staged_flag_bytes(num_rows: int, grid: int, row_lanes: int) -> int:
    """Host: the dynamic shared bytes of ``aux_loss_bwd_quad_kernel(..., has_mask=True)``
    on ``grid`` blocks of ``row_lanes`` row lanes: a byte for each row a row lane
    writes, ``row_lanes * ceil(num_rows / (grid * row_lanes))``."""
    return row_lanes * -(-num_rows // (grid * row_lanes))

# ----------------------------------------------------------------------------
# Backward: grad_probs[r, c] = C * f32(tpe[c]) * f32(grad_loss), every row alike.
# ----------------------------------------------------------------------------


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def aux_loss_bwd_kernel(tpe_kind: str, out_kind: str, has_mask: bool = False):
    """``has_mask`` (compile-time): a bool ``mask [R]`` after ``grad_probs``; its
    False rows get 0."""
    load_tpe = loader_1d(tpe_kind)
    load_grad = loader_1d(out_kind)
    store = storer_2d(out_kind)

    @cuda.jit(device=True)
    def run(coeff, tokens_per_expert, grad_loss, grad_probs, mask, rows_per_block, col_lanes):
        # Thread (rl, cl) computes its columns' value once and writes it down
        # its rows: no index division, coalesced stores.
        num_rows = grad_probs.shape[0]
        num_cols = grad_probs.shape[1]
        tid = cuda.threadIdx.x
        nrl = cuda.blockDim.x // col_lanes
        rl = tid // col_lanes
        cl = tid - rl * col_lanes
        r0 = cuda.blockIdx.x * rows_per_block
        r1 = min(num_rows, r0 + rows_per_block)
        c0 = coeff[0]
        g = load_grad(grad_loss, 0)
        for c in range(cl, num_cols, col_lanes):
            v = np.float32(np.float32(c0 * load_tpe(tokens_per_expert, c)) * g)
            for r in range(r0 + rl, r1, nrl):
                if has_mask and not mask[r]:
                    store(grad_probs, r, c, ZERO)
                else:
                    store(grad_probs, r, c, v)

    if has_mask:

        @cuda.jit
        def aux_loss_bwd_masked(coeff, tokens_per_expert, grad_loss, grad_probs, mask, rows_per_block, col_lanes):
            run(coeff, tokens_per_expert, grad_loss, grad_probs, mask, rows_per_block, col_lanes)

        return aux_loss_bwd_masked

    @cuda.jit
    def aux_loss_bwd(
        coeff,  # [1] fp32: C
        tokens_per_expert,  # [C] tpe_kind
        grad_loss,  # [1] out_kind
        grad_probs,  # [R, C] out_kind, out
        rows_per_block,
        col_lanes,  # CL; blockDim.x == RL * CL
    ):
        run(coeff, tokens_per_expert, grad_loss, grad_probs, coeff, rows_per_block, col_lanes)  # no mask read

    return aux_loss_bwd


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def aux_loss_bwd_quad_kernel(tpe_kind: str, out_kind: str, has_mask: bool = False):
    """The backward for C a multiple of 4, a quad of columns per store, grad_probs
    seen flat (``array_views``): fp32 as 16-byte stores that L2 evicts first
    (``_base/vec.quad_store_once_f32``: the output is larger than L2 and the
    kernel never reads it), bf16 as one uint64 per quad, fp16 as elements.
    ``has_mask`` (compile-time): a bool ``mask [R]`` after ``num_cols``; its
    False rows get 0 (+0.0: a bitwise select, ``mask_bits.keep_if``).  fp16
    (``staged_fill``): each thread loads its rows' flags three trips of 8 rows
    ahead of their stores (``masked_rows``).  bf16 and fp32: the block
    first copies the flags of every row it writes into dynamic shared memory
    (``staged_flag_bytes``: a byte a row, row lane ``rl``'s k-th row at ``rl * per + k``),
    four loads a thread in flight a trip, one barrier; the stores then read shared bytes
    (a thread's next 8 rows' global flags before their 8 stores, as until 2026-11-28,
    waited a load's latency every 8 rows: the masked fill 1.14-1.29x the unmasked
    one on an H200); a thread's first quad's values are loaded before the staging,
    so that their loads and the flags' share one trip to memory."""
    from .._base.vec import quad_store_once_f32

    load_tpe = loader_1d(tpe_kind)
    load_grad = loader_1d(out_kind)
    stages = staged_fill(out_kind)  # compile-time: bf16 and fp32 stage the flags, fp16 loads them a row at a time
    load_byte = opaque_byte_loader()  # (fp16) the flags' loads stay where they are written, ahead of their use
    store4 = quad_store_once_f32() if out_kind == F32 else flat_io(out_kind)[1]

    @cuda.jit(device=True)
    def value(c0, tokens_per_expert, c, g):
        return np.float32(np.float32(c0 * load_tpe(tokens_per_expert, c)) * g)

    @cuda.jit(device=True)
    def quad_values(c0, tokens_per_expert, cq, g):
        c = u64(4 * cq)
        return (value(c0, tokens_per_expert, c, g), value(c0, tokens_per_expert, c + u64(1), g),
                value(c0, tokens_per_expert, c + u64(2), g), value(c0, tokens_per_expert, c + u64(3), g))

    if out_kind == BF16:  # the quad's uint64 of bf16 words packed once, the select on it (not 4 roundings a row)

        @cuda.jit(device=True)
        def pack(v0, v1, v2, v3):
            return bf16_quad(v0, v1, v2, v3)

        @cuda.jit(device=True)
        def store_kept(grad_probs, r, eq, cq, q, v0, v1, v2, v3, m):
            grad_probs[u64(np.int64(r) * eq + cq)] = np.uint64(q & np.uint64(np.uint64(m) * _LOW_AND_HIGH))

    else:

        @cuda.jit(device=True)
        def pack(v0, v1, v2, v3):
            return np.uint64(0)

        @cuda.jit(device=True)
        def store_kept(grad_probs, r, eq, cq, q, v0, v1, v2, v3, m):
            # the quad, or +0.0 (0 in every kind) where m is 0: a select on the bits, no branch
            store4(grad_probs, np.int64(r) * eq + cq, keep_if(v0, m), keep_if(v1, m), keep_if(v2, m),
                   keep_if(v3, m))

    @cuda.jit(device=True)
    def flag(mask, r, last):
        """1 if row ``r`` is valid, the load clamped to ``last`` (a staged byte past the rows is never read)."""
        return np.uint8(mask[min(r, last)] != 0)

    @cuda.jit(device=True)
    def row_of(i, first0, nrl, step, per):
        """The row of staged byte ``i``: row lane ``l = i // per``'s ``(i - l per)``-th row."""
        lane = i // per
        return first0 + lane + (i - lane * per) * step

    @cuda.jit(device=True)
    def stage(mask, staged, num_rows, first0, nrl, step, per, tid, nthreads):
        """``staged[l * per + k]`` = the flag of row ``first0 + l + k step`` (row lane l's k-th row):
        trips of four bytes a thread, their four loads in flight together (clamped past the
        bytes: no branch before a load), then the stores of those in range."""
        last = num_rows - 1
        n = nrl * per
        i = tid
        while i < n:
            j1 = i + nthreads
            j2 = j1 + nthreads
            j3 = j2 + nthreads
            f0 = flag(mask, row_of(i, first0, nrl, step, per), last)
            f1 = flag(mask, row_of(min(j1, n - 1), first0, nrl, step, per), last)
            f2 = flag(mask, row_of(min(j2, n - 1), first0, nrl, step, per), last)
            f3 = flag(mask, row_of(min(j3, n - 1), first0, nrl, step, per), last)
            staged[i] = f0
            if j1 < n:
                staged[j1] = f1
            if j2 < n:
                staged[j2] = f2
            if j3 < n:
                staged[j3] = f3
            i = j3 + nthreads

    @cuda.jit(device=True)
    def kept(staged, j):
        return all_ones_if(np.uint32(staged[j]))

    @cuda.jit(device=True)
    def row_flag(mask, r, last):
        """Row ``r``'s mask as 0 / 0xFFFFFFFF (``all_ones_if``), the load clamped to ``last`` (no branch
        before a load; the flag of a row past the last is loaded but never used)."""
        return all_ones_if(np.uint32(load_byte(mask, min(r, last)) != 0))

    @cuda.jit(device=True)
    def flags8(mask, r, st, last):
        """The flags of rows ``r + k st``, k < 8 (one trip's)."""
        return (row_flag(mask, r, last), row_flag(mask, r + st, last), row_flag(mask, r + 2 * st, last),
                row_flag(mask, r + 3 * st, last), row_flag(mask, r + 4 * st, last), row_flag(mask, r + 5 * st, last),
                row_flag(mask, r + 6 * st, last), row_flag(mask, r + 7 * st, last))

    @cuda.jit(device=True)
    def store8(grad_probs, r, st, n, eq, cq, q, v0, v1, v2, v3, m):
        """Rows ``r + k st`` for k < ``n`` (at most 8), row k kept where ``m[k]``."""
        store_kept(grad_probs, r, eq, cq, q, v0, v1, v2, v3, m[0])
        if n > 1:
            store_kept(grad_probs, r + st, eq, cq, q, v0, v1, v2, v3, m[1])
        if n > 2:
            store_kept(grad_probs, r + 2 * st, eq, cq, q, v0, v1, v2, v3, m[2])
        if n > 3:
            store_kept(grad_probs, r + 3 * st, eq, cq, q, v0, v1, v2, v3, m[3])
        if n > 4:
            store_kept(grad_probs, r + 4 * st, eq, cq, q, v0, v1, v2, v3, m[4])
        if n > 5:
            store_kept(grad_probs, r + 5 * st, eq, cq, q, v0, v1, v2, v3, m[5])
        if n > 6:
            store_kept(grad_probs, r + 6 * st, eq, cq, q, v0, v1, v2, v3, m[6])
        if n > 7:
            store_kept(grad_probs, r + 7 * st, eq, cq, q, v0, v1, v2, v3, m[7])

    @cuda.jit(device=True)
    def masked_rows(grad_probs, mask, num_rows, first, step, eq, cq, q, v0, v1, v2, v3):
        """Quad ``cq``'s values (or 0) down rows ``first + k step``, 8 rows a trip, each trip's
        flags loaded three trips ahead of its stores (24 rows: software pipelining, so that a
        flag's load is in flight while the three trips before it store; the first three trips'
        flags share one trip to memory with the quad's values).  Every lane of a warp reads the
        same flag (a broadcast).  The fp16 fill's (``staged_fill`` False)."""
        last = np.int64(num_rows) - 1
        st = np.int64(step)
        r = np.int64(first)
        a = flags8(mask, r, st, last)
        b = flags8(mask, r + 8 * st, st, last)
        c = flags8(mask, r + 16 * st, st, last)
        while r + 7 * st < num_rows:
            d = flags8(mask, r + 24 * st, st, last)
            store8(grad_probs, r, st, 8, eq, cq, q, v0, v1, v2, v3, a)
            a, b, c = b, c, d
            r += 8 * st
        if r < num_rows:  # the last trip's rows (fewer than 8), their flags loaded
            store8(grad_probs, r, st, (num_rows - 1 - r) // st + 1, eq, cq, q, v0, v1, v2, v3, a)

    @cuda.jit(device=True)
    def run(coeff, tokens_per_expert, grad_loss, grad_probs, num_rows, num_cols, mask, staged, col_lanes):
        # Thread (rl, cl) computes its column quads' values once and writes
        # them down its rows, grid-strided (tiling.fill_tiling; int32
        # counters, unsigned indices: _device.u64).
        eq = np.int32(num_cols // 4)
        tid = np.int32(cuda.threadIdx.x)
        nrl = np.int32(cuda.blockDim.x // col_lanes)
        rl = np.int32(tid // col_lanes)
        cl = np.int32(tid - rl * col_lanes)
        first = np.int32(cuda.blockIdx.x * nrl + rl)
        step = np.int32(cuda.gridDim.x * nrl)
        c0 = coeff[0]
        g = load_grad(grad_loss, 0)
        cq = cl
        # the first quad's values before the staging: their loads in flight with the flags' (one round
        # trip to memory before the first store, as unmasked, not two)
        v0, v1, v2, v3 = quad_values(c0, tokens_per_expert, min(cq, eq - 1), g)
        per = np.int32(0)  # (has_mask and stages) rows a row lane writes at most
        if has_mask and stages:
            per = np.int32((np.int32(num_rows) + step - 1) // step)
            stage(mask, staged, np.int32(num_rows), np.int32(cuda.blockIdx.x * nrl), nrl, step, per, tid,
                  np.int32(cuda.blockDim.x))
            # Barrier: every staged flag is written before any thread reads one.
            cuda.syncthreads()
        base = rl * per  # row lane rl's flags
        while cq < eq:
            r = first
            if has_mask and not stages:  # fp16: each row's flag loaded 3 trips ahead
                masked_rows(grad_probs, mask, num_rows, first, step, eq, cq, pack(v0, v1, v2, v3), v0, v1, v2, v3)
            elif has_mask:
                q = pack(v0, v1, v2, v3)
                j = base  # the staged flag of row r
                # 8 rows a trip: their 8 shared flags read first, then 8 stores of the kept values
                while np.int64(r) + 7 * np.int64(step) < num_rows:
                    m0 = kept(staged, j)
                    m1 = kept(staged, j + 1)
                    m2 = kept(staged, j + 2)
                    m3 = kept(staged, j + 3)
                    m4 = kept(staged, j + 4)
                    m5 = kept(staged, j + 5)
                    m6 = kept(staged, j + 6)
                    m7 = kept(staged, j + 7)
                    store_kept(grad_probs, r, eq, cq, q, v0, v1, v2, v3, m0)
                    store_kept(grad_probs, r + step, eq, cq, q, v0, v1, v2, v3, m1)
                    store_kept(grad_probs, r + 2 * step, eq, cq, q, v0, v1, v2, v3, m2)
                    store_kept(grad_probs, r + 3 * step, eq, cq, q, v0, v1, v2, v3, m3)
                    store_kept(grad_probs, r + 4 * step, eq, cq, q, v0, v1, v2, v3, m4)
                    store_kept(grad_probs, r + 5 * step, eq, cq, q, v0, v1, v2, v3, m5)
                    store_kept(grad_probs, r + 6 * step, eq, cq, q, v0, v1, v2, v3, m6)
                    store_kept(grad_probs, r + 7 * step, eq, cq, q, v0, v1, v2, v3, m7)
                    r = np.int32(r + 8 * step)
                    j += 8
                while r < num_rows:
                    store_kept(grad_probs, r, eq, cq, q, v0, v1, v2, v3, kept(staged, j))
                    r = np.int32(r + step)
                    j += 1
            else:
                while r < num_rows:
                    store4(grad_probs, np.int64(r) * eq + cq, v0, v1, v2, v3)
                    r = np.int32(r + step)
            cq = np.int32(cq + col_lanes)
            if cq < eq:
                v0, v1, v2, v3 = quad_values(c0, tokens_per_expert, cq, g)

    if has_mask:

        @cuda.jit
        def aux_loss_bwd_quad_masked(coeff, tokens_per_expert, grad_loss, grad_probs, num_rows, num_cols, mask,
                                     col_lanes):
            staged = cuda.shared.array(0, nb_u8)  # the block's rows' flags (the launch's staged_flag_bytes)
            run(coeff, tokens_per_expert, grad_loss, grad_probs, num_rows, num_cols, mask, staged, col_lanes)

        return aux_loss_bwd_quad_masked

    @cuda.jit
    def aux_loss_bwd_quad(
        coeff,  # [1] fp32: C
        tokens_per_expert,  # [C] tpe_kind
        grad_loss,  # [1] out_kind
        grad_probs,  # [R, C] out_kind, flat (bf16: [R*C/4] uint64), out
        num_rows,
        num_cols,
        col_lanes,  # CL; blockDim.x == RL * CL
    ):
        run(coeff, tokens_per_expert, grad_loss, grad_probs, num_rows, num_cols, coeff, coeff, col_lanes)  # no mask

    return aux_loss_bwd_quad
