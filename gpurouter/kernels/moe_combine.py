"""``token_combine`` (TE ``permutation.token_combine``): Numba kernels, forward and
a one-pass backward.

``row_id_map [T, E] int32`` holds the dispatched row of each routed pair
``(t, e)`` or -1 (a row outside ``[0, R)`` counts as not routed); ``w =
merging_probs [T, E]`` (all ones without)::

    out[t]         = sum_{e routed, ascending} w[t, e] z[row(t, e)]      (fp32)
    d_z[row(t, e)] = w[t, e] dy[t]         (every row no pair points to: exactly 0)
    d_w[t, e]      = sum_h z[row(t, e), h] dy[t, h]  if routed, else 0

Tiling (``combine_tiling``): a block per ``CMB_TOKENS`` tokens, taken in
turn, its W lanes over the row units (16 bytes: eight bf16 columns,
``_moe_rows``) of the hidden row, lane ``l`` units ``l, l + W, ...``.  A
token's routed experts are listed in ascending order in shared memory
(``_moe_rows.token_lister``: a flag per expert, the flags packed into 32-bit words, each
routed expert's rank the set bits before it: three barriers, no scan), with
their rows and weights, into one of two lists: the loads of a token's first
``CMB_HOLD`` rows (all the lane's units) go out, then the next token is
listed into the other list while they are in flight; then

- forward: the listed rows ``CMB_HOLD`` at a time, summed in list order, one
  store per unit;
- backward: per ``CMB_HOLD`` listed rows, each lane has ``dy[t]``'s units and
  the rows' units, stores ``w dy`` into their ``d_z`` rows and keeps a partial
  dot per row; the lanes' partials are summed in shared memory in a fixed
  two-stage order (``moe_grouped_dbias``'s), written as ``d_w``.  The
  experts the token is not routed to get ``d_w = 0`` while listing: ``d_z``
  and ``d_w`` come out of one pass over ``dy`` and the routed rows of ``z``.

The rows of ``d_z`` no pair points to are zeroed by three small kernels
before it (a scratch ``int32 [R]`` flag per row: cleared, marked from the map,
then the unmarked rows written with zeros): no NaN from an uninitialised
row of ``z`` or ``dy`` reaches any output.  Every sum has a fixed order:
bit-identical run to run.  No warp intrinsics (the simulator runs the same
kernels).
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from . import _launch as L
from ._moe_rows import OCT, cols_io, lane_sums, row_io, row_mode, row_units, row_width, token_lister
from .moe_io import _ZERO, moe_jit, pow2_at_least, scalar_io

OP = "token_combine"

#: lanes (threads) per block at most (H = 2048 bf16: 256 row units of 16 bytes)
CMB_THREADS = 256
#: listed rows whose loads a lane issues at once (forward and backward)
CMB_HOLD = 8
#: loads in flight per lane at most (rows x units): a lane with more units takes them in groups
CMB_LOADS = 16
#: tokens per block, in turn: a token's first row loads go out before the next token is listed
CMB_TOKENS = 4
#: experts per token at most: the shared list holds every routed expert
CMB_MAX_EXPERTS = 1024
#: register cap of the token kernels (0: the compiler's choice): more resident blocks
CMB_MAX_REGS = 0
#: the d_z padding kernels: threads per block, blocks at most (grid-strided flags)
CMB_FILL_THREADS = 256
CMB_FILL_BLOCKS = 1024
#: rows per block of the zero-row kernel
CMB_ZERO_ROWS = 64


def combine_tiling(hidden: int, kind: str = L.F32):
    """``(lanes, units, mode, per)``: W lanes per block (at most ``CMB_THREADS``,
    as few as give each lane the same number of units: a power of two up to
    32, else a multiple of 32), row units per row, their mode
    (``_moe_rows.row_mode``: 16-byte units of eight bf16 columns where
    H % 8 == 0) and the units per lane, ``ceil(units / W)``."""
    mode = row_mode(kind, int(hidden))
    units = row_units(mode, hidden)
    per = max(1, -(-units // CMB_THREADS))  # units per lane: every lane the same count (or one less)
    need = max(1, -(-units // per))
    lanes = min(CMB_THREADS, pow2_at_least(need) if need <= 32 else -(-need // 32) * 32)
    return lanes, units, mode, max(1, -(-units // lanes))


def unit_groups(per: int) -> tuple[int, int]:
    """``(group, groups)``: a lane's ``per`` units taken ``group`` at a time
    (``CMB_HOLD`` rows each: at most ``CMB_LOADS`` loads in flight)."""
    group = max(1, min(per, CMB_LOADS // max(CMB_HOLD, 1)))
    return group, -(-per // group)


def expert_cap(num_experts: int) -> int:
    """The shared list's length for E experts: a power of two >= max(E, 32)
    (the kernels are specialised on it: small shared arrays, more blocks per SM)."""
    return pow2_at_least(max(int(num_experts), 32))


@functools.cache
def _row_loader(kind, mode, hold, per):
    """``issue(a, lrow, off, k0, m, raw, ubase, nl, units, h)``: the raw words of
    listed rows ``k0 .. k0 + m - 1`` (m <= hold) at the ``per`` units ``ubase +
    p nl``, every load issued before any is used (the rest: 0)."""
    load = row_io(kind, mode)[0]

    @cuda.jit(device=True)
    def issue_listed_rows(a, lrow, off, k0, m, raw, ubase, nl, units, h):
        for p in range(per):
            u = ubase + p * nl
            for k in range(hold):
                w0 = w1 = w2 = w3 = _ZERO
                if k < m and u < units:
                    w0, w1, w2, w3 = load(a, lrow[off + k0 + k], u, units, h)
                o = 4 * (p * hold + k)
                raw[o] = w0
                raw[o + 1] = w1
                raw[o + 2] = w2
                raw[o + 3] = w3

    return issue_listed_rows


@cuda.jit(device=True)
def _no_words(a, i, u, units, h):  # stands in for a raw loader the kernel never calls
    return _ZERO, _ZERO, _ZERO, _ZERO


@cuda.jit(device=True)
def _no_unpack(w0, w1, w2, w3, dst, off):
    pass


@functools.cache
def _combine_fwd_kernel(z_kind, w_kind, mode, has_w, hold, ecap, per, groups, tpb, max_regs=0):
    unpack, store_o = row_io(z_kind, mode)[1:]
    issue = _row_loader(z_kind, mode, hold, per)
    list_routed = token_lister(w_kind, has_w, False)
    uw = row_width(mode)
    nwords = ecap // 32
    lists = 2 * ecap  # two lists: this token's and the next one's
    raw_words, unit_words = 4 * hold * per, uw * per

    @moe_jit(max_regs)
    def token_combine_fwd_kernel(
        z,  # [R, H] z_kind (row_view)
        rid,  # [T * E] int32 (flat)
        w,  # [T * E] w_kind (flat; placeholder without)
        out,  # [T, H] z_kind, out (row_view)
        e_count, r_count, h, units, t_count,
    ):
        frow = cuda.shared.array(ecap, int32)
        fw = cuda.shared.array(ecap, float32)
        words = cuda.shared.array(nwords, uint32)
        lrow = cuda.shared.array(lists, int32)  # two lists: this token's and the next one's
        le = cuda.shared.array(lists, int32)
        lw = cuda.shared.array(lists, float32)
        raw = cuda.local.array(raw_words, float32)
        val = cuda.local.array(uw, float32)
        acc = cuda.local.array(unit_words, float32)
        lane = np.int32(cuda.threadIdx.x)
        nl = np.int32(cuda.blockDim.x)
        t0 = np.int64(cuda.blockIdx.x) * tpb
        t1 = min(t0 + tpb, t_count)
        cnt = list_routed(rid, w, w, t0, e_count, r_count, frow, fw, words, lrow, le, lw, 0, lane, nl)
        off = np.int32(0)
        for t in range(t0, t1):
            issue(z, lrow, off, 0, min(np.int32(hold), cnt), raw, lane, nl, units, h)
            nxt = np.int32(0)
            if t + 1 < t1:  # the next token listed while this one's first rows are in flight
                nxt = list_routed(rid, w, w, t + 1, e_count, r_count, frow, fw, words, lrow, le, lw,
                                  ecap - off, lane, nl)
            for gi in range(groups):
                ubase = lane + gi * per * nl
                for j in range(uw * per):
                    acc[j] = _ZERO
                k0 = np.int32(0)
                m = min(np.int32(hold), cnt)
                if gi > 0:
                    issue(z, lrow, off, k0, m, raw, ubase, nl, units, h)
                while True:
                    for p in range(per):  # the sums in list order
                        for k in range(hold):
                            if k < m:
                                o = 4 * (p * hold + k)
                                unpack(raw[o], raw[o + 1], raw[o + 2], raw[o + 3], val, 0)
                                c = lw[off + k0 + k]
                                for j in range(uw):
                                    x = np.float32(c * val[j]) if has_w else val[j]
                                    acc[p * uw + j] = np.float32(acc[p * uw + j] + x)
                    k0 += m
                    if k0 >= cnt:
                        break
                    m = min(np.int32(hold), cnt - k0)
                    issue(z, lrow, off, k0, m, raw, ubase, nl, units, h)
                for p in range(per):
                    u = ubase + p * nl
                    if u < units:
                        store_o(out, t, u, units, h, acc, p * uw)
            off = ecap - off
            cnt = nxt

    return token_combine_fwd_kernel


# Backward (docs/ops/moe_ops.md section 5): out[t] = sum_e w[t, e] z[row(t, e)] is
# linear in each z row and each weight, so with dy = d out[t]:
#   d z[row(t, e)] = w[t, e] dy[t]   (a row appears in one pair at most: no sum)
#   d w[t, e]      = <z[row(t, e)], dy[t]>
# and rows no pair points to get no cotangent (0).
@functools.cache
def _combine_bwd_kernel(dy_kind, z_kind, w_kind, mode, has_w, hold, ecap, max_lanes, per, groups, tpb,
                        max_regs=0):
    dy_raw = dy_kind == z_kind or mode != OCT  # else: dy's units are two fp32/fp16 quads, read as values
    load_dy, unpack_dy = row_io(dy_kind, mode)[:2] if dy_raw else (_no_words, _no_unpack)
    load_dyv = cols_io(dy_kind, mode)[0]
    unpack, store_dz = row_io(z_kind, mode)[1:]
    issue = _row_loader(z_kind, mode, hold, per)
    store_w = scalar_io(w_kind)[1]
    list_routed = token_lister(w_kind, has_w, has_w)
    stage, total = lane_sums(hold)
    uw = row_width(mode)
    nwords = ecap // 32
    lists = 2 * ecap  # two lists: this token's and the next one's
    raw_words, unit_words, draw_words = 4 * hold * per, uw * per, 4 * per
    red_words = hold * max_lanes

    @cuda.jit(device=True)
    def issue_group(dy, z, lrow, off, k0, m, draw, dyv, raw, t, ubase, nl, units, h, cnt):
        """dy[t]'s units ``ubase + p nl`` (raw words) and the listed rows' ones: all in flight at once."""
        for p in range(per):
            u = ubase + p * nl
            w0 = w1 = w2 = w3 = _ZERO
            if u < units and cnt > 0:
                if dy_raw:
                    w0, w1, w2, w3 = load_dy(dy, t, u, units, h)
                else:
                    load_dyv(dy, t, u, units, h, dyv, p * uw)
            draw[4 * p] = w0
            draw[4 * p + 1] = w1
            draw[4 * p + 2] = w2
            draw[4 * p + 3] = w3
        if has_w:
            issue(z, lrow, off, k0, m, raw, ubase, nl, units, h)

    @moe_jit(max_regs)
    def token_combine_bwd_kernel(
        dy,  # [T, H] dy_kind (row_view for z's mode)
        z,  # [R, H] z_kind (row_view)
        rid,  # [T * E] int32 (flat)
        w,  # [T * E] w_kind (flat; placeholder without)
        d_z,  # [R, H] z_kind, out (row_view)
        d_w,  # [T * E] w_kind, out (flat; placeholder without)
        e_count, r_count, h, units, t_count,
    ):
        frow = cuda.shared.array(ecap, int32)
        fw = cuda.shared.array(ecap, float32)
        words = cuda.shared.array(nwords, uint32)
        lrow = cuda.shared.array(lists, int32)  # two lists: this token's and the next one's
        le = cuda.shared.array(lists, int32)
        lw = cuda.shared.array(lists, float32)
        red = cuda.shared.array(red_words, float32)  # [hold, W] lane partial dots
        red2 = cuda.shared.array(red_words, float32)  # [hold, P] stage-1 sums
        raw = cuda.local.array(raw_words, float32)
        draw = cuda.local.array(draw_words, float32)
        dyv = cuda.local.array(unit_words, float32)
        val = cuda.local.array(uw, float32)
        part = cuda.local.array(hold, float32)
        lane = np.int32(cuda.threadIdx.x)
        nl = np.int32(cuda.blockDim.x)
        parts = max(np.int32(1), np.int32(nl // hold))
        t0 = np.int64(cuda.blockIdx.x) * tpb
        t1 = min(t0 + tpb, t_count)
        cnt = list_routed(rid, w, d_w, t0, e_count, r_count, frow, fw, words, lrow, le, lw, 0, lane, nl)
        off = np.int32(0)
        for t in range(t0, t1):
            k0 = np.int32(0)
            m = min(np.int32(hold), cnt)
            issue_group(dy, z, lrow, off, k0, m, draw, dyv, raw, t, lane, nl, units, h, cnt)
            nxt = np.int32(0)
            if t + 1 < t1:  # the next token listed while this one's first rows are in flight
                nxt = list_routed(rid, w, d_w, t + 1, e_count, r_count, frow, fw, words, lrow, le, lw,
                                  ecap - off, lane, nl)
            while k0 < cnt:  # the same count in every thread: the barriers below are uniform
                for k in range(hold):
                    part[k] = _ZERO
                for gi in range(groups):
                    ubase = lane + gi * per * nl
                    if k0 > 0 or gi > 0:
                        issue_group(dy, z, lrow, off, k0, m, draw, dyv, raw, t, ubase, nl, units, h, cnt)
                    if dy_raw:
                        for p in range(per):
                            unpack_dy(draw[4 * p], draw[4 * p + 1], draw[4 * p + 2], draw[4 * p + 3], dyv, p * uw)
                    for p in range(per):
                        u = ubase + p * nl
                        if u < units:
                            for k in range(hold):
                                if k < m:
                                    c = lw[off + k0 + k]
                                    for j in range(uw):
                                        val[j] = np.float32(c * dyv[p * uw + j])
                                    store_dz(d_z, lrow[off + k0 + k], u, units, h, val, 0)
                                    if has_w:
                                        o = 4 * (p * hold + k)
                                        unpack(raw[o], raw[o + 1], raw[o + 2], raw[o + 3], val, 0)
                                        s = part[k]
                                        for j in range(uw):
                                            s = np.float32(s + np.float32(val[j] * dyv[p * uw + j]))
                                        part[k] = s
                if has_w:
                    stage(red, red2, part, lane, nl, parts)
                    for k in range(lane, m, nl):
                        store_w(d_w, t * e_count + le[off + k0 + k], total(red2, k, parts))
                k0 += m
                m = min(np.int32(hold), cnt - k0)
            off = ecap - off
            cnt = nxt

    return token_combine_bwd_kernel


@cuda.jit
def moe_clear_row_flags_kernel(owned, r_count):  # owned [R] int32 := 0 (grid-strided)
    for i in range(cuda.grid(1), r_count, cuda.gridsize(1)):
        owned[i] = 0


@cuda.jit
def moe_mark_routed_rows_kernel(rid, owned, pairs, r_count):  # rid [T * E] int32; owned[row] := 1 for each routed pair
    for i in range(cuda.grid(1), pairs, cuda.gridsize(1)):
        v = rid[i]
        if v >= 0 and v < r_count:
            owned[v] = 1  # the same value from every writer: no race on the result


@functools.cache
def _zero_rows_kernel(kind, mode, rows_per_block):
    """Block ``b`` owns rows ``b rows_per_block ..`` (``CMB_ZERO_ROWS``): their flags into shared
    memory once, then the block's lanes write zero units into the unflagged
    rows only (a block-uniform branch per row: the rows that are held cost a
    shared read, not a global one per unit)."""
    store = row_io(kind, mode)[2]
    uw = row_width(mode)

    @cuda.jit
    def moe_zero_rows_kernel(d_z, owned, r_count, h, units):  # the units of every row no pair points to := 0
        flags = cuda.shared.array(rows_per_block, int32)
        zero = cuda.local.array(uw, float32)
        for j in range(uw):
            zero[j] = _ZERO
        lane = cuda.threadIdx.x
        r0 = np.int64(cuda.blockIdx.x) * rows_per_block
        for k in range(lane, rows_per_block, cuda.blockDim.x):
            flags[k] = owned[r0 + k] if r0 + k < r_count else np.int32(1)
        # Barrier: the block's row flags are in.
        cuda.syncthreads()
        for k in range(rows_per_block):
            if flags[k] == 0:
                for u in range(lane, units, cuda.blockDim.x):
                    store(d_z, r0 + k, u, units, h, zero, 0)

    return moe_zero_rows_kernel
