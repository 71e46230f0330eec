"""Grouped bias gradients (TE PR #2864): ``compute_grouped_dbias_dscales`` and
``compute_grouped_dbias``, one kernel family, deterministic (no atomics).

Row ``i`` belongs to group ``g`` iff ``offsets[g] <= i < offsets[g + 1]``
(offsets clipped to ``[0, N]``); with ``s = scales`` (1 without)::

    dbias[g]   = sum_{i in g} s[i] dy[i, :]          (+ a given dbias)
    dscales[i] = sum_h dy[i, h] bias[g(i), h]        (0 for rows no group owns; + a given dscales)

Rows no group owns are never loaded (NaN there reaches nothing).

Tiling (``dbias_tiling``; the knobs: ``DbiasTiling`` below): the
rows are cut into chunks of ``chunk_rows``, the columns into row units
(``moe/rows``: 16 bytes, eight bf16 columns, where H % 8 == 0; else four
columns); block ``(c, cb)`` owns chunk ``c`` and column block ``cb``, lane
``l`` of its ``W`` lanes the units ``cb W Q + l + k W`` (``k < Q = quads``:
consecutive lanes read consecutive units, every warp load is coalesced).
A lane walks the chunk's rows in order, ``hold_rows`` rows at a time (all
their loads issued before any is used: ``Q * hold_rows`` loads in flight per
thread, kept as raw words in registers; the next batch's loads go out before
this batch's dscales barriers), takes the held rows in runs of one group,
keeps ``s[i] dy[i]`` summed in fp32 registers for the current group and
flushes the sum when the group changes:

- a group that lies inside the chunk: straight into ``dbias[g]``;
- the chunk's first group, begun in an earlier chunk: into ``part[2c]`` (A);
- the chunk's last group, going on past it: into ``part[2c + 1]`` (B).

Kernel 2 (one block per group and column block) writes every group that spans
chunks ``c0 < c1``: ``B[c0] + A[c0 + 1] + ... + A[c1]``, in chunk order, and
the empty groups (0, or the given dbias).  ``part`` is a plan scratch array
(two fp32 rows per chunk: ~1.6% of a bf16 ``dy``'s bytes at 256 rows).
Without scales (no dots, no barriers) the kernel has its own batch, chunk and
register cap (``rows_knobs``): more threads with fewer loads each ran faster.

``dscales``: each lane's partial dot over its units (fixed order), then per
held row a fixed tree over the lanes (``moe/rows.lane_tree_sums``: a warp
butterfly of shuffles, then the warps in order; one barrier per
``hold_rows`` rows; it replaced a two-barrier shared-memory sum,
lab/journal/benchmarks.md).  With one column block that is ``dscales``; with several
(more units than Q max_lanes) each writes a partial row ``dsp[cb]`` and
kernel 3 sums them in column-block order.  Every order is fixed by the
shapes: the results are bit-identical run to run.

Warp shuffles only inside ``lane_tree_sums``, whose simulator twin walks the
same tree in shared memory: the simulator runs the same kernels, with the
same bits.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import dataclasses
import functools

import numpy as np
from numba import cuda, float32, int32

from .._base import launch as L
from .._base.limits import pow2_at_least
from .io import _ONE, _ZERO, moe_jit, scalar_io, unit_io
from .rows import cols_io, lane_tree_sums, row_io, row_mode, row_units, row_width

OP = "compute_grouped_dbias_dscales"
OP_DBIAS = "compute_grouped_dbias"

@dataclasses.dataclass(frozen=True)
class DbiasTiling:
    """The grouped dbias / dscales kernels' knobs (the defaults are the library's, measured
    with ``tools/probes/moe_sweep.py``; tests and the sweep pass others to the plans).

    - ``quads``: Q, row units (``io``: 16 bytes of a bf16 row) per lane per row: its dbias
      sums are Q units of fp32;
    - ``hold_rows``: rows a lane loads at once (Q * hold loads in flight per thread); the
      next batch's loads go out before this batch's dscales reduction (its barrier);
    - ``chunk_rows``: rows per chunk (a block's rows): larger chunks, fewer partial rows;
    - ``max_regs``: kernel 1's register cap with scales (0: the compiler's choice);
    - ``hold_rows_dbias``, ``chunk_rows_dbias``, ``max_regs_dbias``: the same without scales
      (``compute_grouped_dbias``: no dots, no barriers; fewer loads in flight per thread,
      more threads: faster on an H200);
    - ``max_lanes``: lanes (threads) per block at most; wider rows take several column blocks
      (512: the DeepSeek-V3-like H = 7168 in 2 column blocks, not 4);
    - ``group_threads``, ``group_hold``: kernel 2 (groups spanning chunks): threads per block,
      partial rows loaded at once;
    - ``final_threads``: kernel 3 (dscales of several column blocks): threads per block."""

    quads: int = 1
    hold_rows: int = 4
    chunk_rows: int = 256
    max_regs: int = 0
    hold_rows_dbias: int = 4
    chunk_rows_dbias: int = 128
    max_regs_dbias: int = 64
    max_lanes: int = 512
    group_threads: int = 128
    group_hold: int = 8
    final_threads: int = 256


#: the library's dbias tiling
DBIAS_TILING = DbiasTiling()


def rows_knobs(has_scales: bool, tiling: DbiasTiling = DBIAS_TILING) -> tuple[int, int, int]:
    """Kernel 1's ``(hold, chunk, max_regs)`` with or without scales."""
    if has_scales:
        return tiling.hold_rows, tiling.chunk_rows, tiling.max_regs
    return tiling.hold_rows_dbias, tiling.chunk_rows_dbias, tiling.max_regs_dbias


def dbias_tiling(num_rows: int, hidden: int, dy_kind: str = L.F32, has_scales: bool = True,
                 tiling: DbiasTiling = DBIAS_TILING):
    """``(lanes, ncb, nchunks, units, mode)``: W lanes per block, column blocks,
    row chunks, row units per row and their mode (``rows.row_mode``).
    ``ncb = ceil(units / (max_lanes Q))``; W the lanes that cover a column
    block (a multiple of 32 above 32, a power of two below)."""
    mode = row_mode(dy_kind, int(hidden))
    units = row_units(mode, hidden)
    ncb = max(1, -(-units // (tiling.max_lanes * tiling.quads)))
    need = max(1, -(-units // (ncb * tiling.quads)))
    lanes = pow2_at_least(need) if need <= 32 else -(-need // 32) * 32
    nchunks = -(-int(num_rows) // rows_knobs(has_scales, tiling)[1])
    return min(lanes, tiling.max_lanes), ncb, nchunks, units, mode


@cuda.jit(device=True)
def _clip(o, n):
    return min(max(np.int64(o), np.int64(0)), n)


@cuda.jit(device=True)
def _group_of(offsets, i, g, n):
    """The group of row ``i < n``: the k with ``o[k] <= i < o[k + 1]`` (empty
    groups skipped), -1 before ``o[0]`` or at/after ``o[G]`` (binary search)."""
    lo = np.int64(0)
    hi = np.int64(g + 1)
    while lo < hi:  # lo = #{j : o[j] <= i}
        mid = (lo + hi) // 2
        if np.int64(offsets[mid]) <= i:
            lo = mid + 1
        else:
            hi = mid
    if lo >= 1 and lo <= g:
        return np.int32(lo - 1)
    return np.int32(-1)


@functools.cache
def _rows_kernel(dy_kind, s_kind, b_kind, mode, has_scales, has_db_in, has_ds_in, final_ds,
                 q, hold, chunk, max_regs, lanes):
    """Kernel 1 (module docstring), specialised on the kinds, the flags and the tile constants, the
    block's ``lanes`` included (a constant: the lane sums' loops unrolled, their divisions shifts;
    ptxas sm_90 at the Qwen3-like shape: 90 registers instead of 124, 64 at hold_rows = 4
    with no spill)."""
    load_dy, unpack, _ = row_io(dy_kind, mode)
    load_b = cols_io(b_kind, mode)[0]
    load_f, store_f = cols_io(L.F32, mode)
    load_s = scalar_io(s_kind)[0]
    uw = row_width(mode)
    acc_words = uw * q
    raw_words = 4 * q * hold
    publish, total, red_words = lane_tree_sums(hold, lanes)
    cpad = -(-chunk // hold) * hold  # the group list padded to whole batches (-1 past the chunk)

    @cuda.jit(device=True)
    def flush(acc, tmp, cur, offsets, n, cs, c, dbias, db_in, part, ubase, nl, units, h):
        """The lane's sums of group ``cur`` to where they belong; zeroes them."""
        lo = _clip(offsets[cur], n)
        hi = _clip(offsets[cur + 1], n)
        dest = np.int64(-1)  # the group lies inside the chunk: dbias
        if lo < cs:
            dest = 2 * c  # begun in an earlier chunk: A
        elif hi > cs + chunk:
            dest = 2 * c + 1  # goes on past the chunk: B
        for k in range(q):
            u = ubase + k * nl
            if u < units:
                if dest < 0:
                    if has_db_in:
                        load_f(db_in, cur, u, units, h, tmp, 0)
                        for j in range(uw):
                            acc[k * uw + j] = np.float32(acc[k * uw + j] + tmp[j])
                    store_f(dbias, cur, u, units, h, acc, k * uw)
                else:
                    store_f(part, dest, u, units, h, acc, k * uw)
        for k in range(acc_words):
            acc[k] = _ZERO

    @cuda.jit(device=True)
    def issue(dy, raw, gid, r0, rows, cs, ubase, nl, units, h):
        """Every load of the held rows ``r0 ..`` at once (raw words; rows no group owns: never loaded)."""
        for hr in range(hold):
            r = r0 + hr
            own = r < rows
            if own:
                own = gid[r] >= 0
            for k in range(q):
                u = ubase + k * nl
                w0 = w1 = w2 = w3 = _ZERO
                if own and u < units:
                    w0, w1, w2, w3 = load_dy(dy, cs + r, u, units, h)
                o = 4 * (hr * q + k)
                raw[o] = w0
                raw[o + 1] = w1
                raw[o + 2] = w2
                raw[o + 3] = w3

    @moe_jit(max_regs)
    def grouped_dbias_rows_kernel(
        dy,  # [N, H] dy_kind (row_view)
        scales,  # [N] s_kind (placeholder without scales)
        bias,  # [G, H] b_kind (row_view; placeholder without scales)
        offsets,  # [G + 1] int32
        db_in,  # [G, H] fp32 (placeholder without)
        ds_in,  # [N] fp32 (placeholder without)
        dbias,  # [G, H] fp32, out
        dscales,  # [N] fp32, out (placeholder without scales)
        part,  # [2 * nchunks, H] fp32 scratch: A and B rows
        dsp,  # [ncb * N] fp32 scratch: dscales partials (ncb > 1)
        n, h, units, g, ncb,
    ):
        gid = cuda.shared.array(cpad, int32)  # the chunk's rows' groups (-1: none)
        srow = cuda.shared.array(cpad, float32)  # their scales
        red = cuda.shared.array(red_words, float32)  # lane_tree_sums' two halves
        acc = cuda.local.array(acc_words, float32)
        bia = cuda.local.array(acc_words, float32)
        raw = cuda.local.array(raw_words, float32)
        val = cuda.local.array(uw, float32)
        dots = cuda.local.array(hold, float32)
        lane = np.int32(cuda.threadIdx.x)
        nl = np.int32(lanes)  # the block size (the plan launches ``lanes`` threads)
        blk = np.int64(cuda.blockIdx.x)
        c = blk // ncb
        cb = blk - c * ncb
        cs = c * chunk
        rows = min(np.int64(chunk), n - cs)
        for r in range(lane, cpad, nl):
            gg = np.int32(-1)
            sv = _ONE
            if r < rows:
                gg = _group_of(offsets, cs + r, g, n)
                if has_scales:
                    if gg >= 0:
                        sv = load_s(scales, cs + r)
            gid[r] = gg
            srow[r] = sv
        for k in range(acc_words):
            acc[k] = _ZERO
            bia[k] = _ZERO
        cur = np.int32(-1)
        ubase = cb * (nl * q) + lane
        parity = np.int32(0)  # the half of ``red`` this batch's dots go to
        # Barrier: every lane reads the chunk's groups and scales.
        cuda.syncthreads()
        issue(dy, raw, gid, 0, rows, cs, ubase, nl, units, h)
        for r0 in range(0, rows, hold):
            for hr in range(hold):
                dots[hr] = _ZERO
            # The held rows in segments of one group (a group's rows are contiguous).
            h0 = np.int32(0)
            while h0 < hold:
                gg = gid[r0 + h0]
                if gg >= 0 and gg != cur:
                    if cur >= 0:
                        flush(acc, val, cur, offsets, n, cs, c, dbias, db_in, part, ubase, nl, units, h)
                    cur = gg
                    if has_scales:
                        for k in range(q):
                            u = ubase + k * nl
                            if u < units:
                                load_b(bias, cur, u, units, h, bia, k * uw)
                seg = np.int32(0)
                run = True  # the segment ends at the first row of another group (-1 rows: both ends)
                for hr in range(hold):  # unrolled: the held words stay in registers
                    if hr >= h0 and run:
                        run = gid[r0 + hr] == gg
                    if hr >= h0 and run:
                        seg += 1
                        if gg >= 0:
                            sv = srow[r0 + hr]
                            dot = _ZERO
                            for k in range(q):
                                o = 4 * (hr * q + k)
                                unpack(raw[o], raw[o + 1], raw[o + 2], raw[o + 3], val, 0)
                                for j in range(uw):
                                    x = val[j]
                                    if has_scales:
                                        acc[k * uw + j] = np.float32(acc[k * uw + j] + np.float32(x * sv))
                                        dot = np.float32(dot + np.float32(x * bia[k * uw + j]))
                                    else:
                                        acc[k * uw + j] = np.float32(acc[k * uw + j] + x)
                            dots[hr] = dot
                h0 += seg
            if r0 + hold < rows:  # the next batch's loads go out before this batch's barrier
                issue(dy, raw, gid, r0 + hold, rows, cs, ubase, nl, units, h)
            if has_scales:
                publish(red, dots, lane, parity)
                for hr in range(lane, hold, nl):
                    r = r0 + hr
                    if r < rows:
                        s = total(red, hr, parity)
                        i = cs + r
                        if final_ds:
                            if has_ds_in:
                                s = np.float32(s + ds_in[i])
                            dscales[i] = s
                        else:
                            dsp[cb * n + i] = s
                parity ^= 1
        if cur >= 0:
            flush(acc, val, cur, offsets, n, cs, c, dbias, db_in, part, ubase, nl, units, h)

    return grouped_dbias_rows_kernel


@functools.cache
def _groups_kernel(quads, has_db_in, chunk, hold):
    """Kernel 2: the groups that span chunks (their A/B rows in chunk order) and the empty ones."""
    load_f, store_f = unit_io(L.F32, quads)
    held_words = 4 * hold

    @cuda.jit
    def grouped_dbias_spanning_groups_kernel(
        part,  # [2 * nchunks, H] fp32 (kernel 1's A and B rows)
        db_in,  # [G, H] fp32 (placeholder without)
        dbias,  # [G, H] fp32, out
        offsets,  # [G + 1] int32
        n, h, units, nub,
    ):
        held = cuda.local.array(held_words, float32)
        blk = np.int64(cuda.blockIdx.x)
        gg = blk // nub
        u = (blk - gg * nub) * cuda.blockDim.x + cuda.threadIdx.x
        if u >= units:
            return
        lo = _clip(offsets[gg], n)
        hi = _clip(offsets[gg + 1], n)
        a0 = a1 = a2 = a3 = _ZERO
        if lo < hi:
            c0 = lo // chunk
            c1 = (hi - 1) // chunk
            if c0 == c1:
                return  # inside one chunk: kernel 1 wrote it
            a0, a1, a2, a3 = load_f(part, 2 * c0 + 1, u, units, h)
            c = c0 + 1
            while c <= c1:
                m = min(np.int64(hold), c1 - c + 1)
                for k in range(hold):  # the loads first, then the sums in chunk order
                    if k < m:
                        v0, v1, v2, v3 = load_f(part, 2 * (c + k), u, units, h)
                        held[4 * k] = v0
                        held[4 * k + 1] = v1
                        held[4 * k + 2] = v2
                        held[4 * k + 3] = v3
                for k in range(hold):
                    if k < m:
                        a0 = np.float32(a0 + held[4 * k])
                        a1 = np.float32(a1 + held[4 * k + 1])
                        a2 = np.float32(a2 + held[4 * k + 2])
                        a3 = np.float32(a3 + held[4 * k + 3])
                c += m
        if has_db_in:
            b0, b1, b2, b3 = load_f(db_in, gg, u, units, h)
            a0, a1, a2, a3 = a0 + b0, a1 + b1, a2 + b2, a3 + b3
        store_f(dbias, gg, u, units, h, a0, a1, a2, a3)

    return grouped_dbias_spanning_groups_kernel


@functools.cache
def _dscales_kernel(has_ds_in):
    """Kernel 3: ``dscales[i] = sum_cb dsp[cb, i]`` in column-block order (+ the given dscales)."""

    @cuda.jit
    def grouped_dscales_column_blocks_kernel(dsp, ds_in, dscales, n, ncb):  # dsp [ncb * N], ds_in / dscales [N] fp32
        i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        if i >= n:
            return
        s = _ZERO
        for cb in range(ncb):
            s = np.float32(s + dsp[cb * n + i])
        if has_ds_in:
            s = np.float32(s + ds_in[i])
        dscales[i] = s

    return grouped_dscales_column_blocks_kernel
