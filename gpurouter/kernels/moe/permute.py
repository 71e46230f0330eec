"""``token_combine`` (TE ``permutation.token_combine``): Numba kernels, forward and
a one-pass backward.

``row_id_map [T, E] int32`` holds the dispatched row of each routed pair
``(t, e)`` or -1 (a row outside ``[0, R)`` counts as not routed); ``w =
merging_probs [T, E]`` (all ones without)::

    out[t]         = sum_{e routed, ascending} w[t, e] z[row(t, e)]      (fp32)
    d_z[row(t, e)] = w[t, e] dy[t]         (every row no pair points to: exactly 0)
    d_w[t, e]      = sum_h z[row(t, e), h] dy[t, h]  if routed, else 0

Tiling (``combine_tiling``): one block per token, its W lanes over the
row units (16 bytes: eight bf16 columns where H % 8 == 0, ``moe/rows``) of
the hidden row, lane ``l`` units ``l, l + W, ...`` (``CombineTiling.lane_units`` or
more each: fewer lanes per token, more tokens per SM).  First the token's routed experts are listed in
ascending order in shared memory (``_lister``: a flag per expert, the flags
packed into 32-bit words, each routed expert's rank the set bits before it:
three barriers, no scan), with their rows and weights; then

- forward: per unit, the listed rows ``CombineTiling.hold`` at a time (their loads
  issued before any is used), summed in list order, one store;
- backward: per ``CombineTiling.bwd_hold`` listed rows, each lane loads ``dy[t]``'s unit and
  the rows' units, stores ``w dy`` into their ``d_z`` rows and keeps a partial
  dot per row; the lanes' partials are summed in a fixed tree
  (``moe/rows.lane_tree_sums``: warp shuffles, then the warps in order; the
  same tree in shared memory on the simulator), written as ``d_w``.  The
  experts the token is not routed to get ``d_w = 0`` while listing: ``d_z``
  and ``d_w`` come out of one pass over ``dy`` and the routed rows of ``z``.

The rows of ``d_z`` no pair points to are zeroed by three small kernels
before it (a scratch ``int32 [R]`` flag per row: cleared, marked from the map,
then the unmarked rows written with zeros): no NaN from an uninitialised
row of ``z`` or ``dy`` reaches any output.  Every sum has a fixed order:
bit-identical run to run.  Warp shuffles only inside ``lane_tree_sums``
(its simulator twin gives the same bits: the simulator runs the same
kernels).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import dataclasses
import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from .._base import launch as L
from .._base.limits import pow2_at_least
from .io import _ONE, _ZERO, moe_jit, popc32, scalar_io
from .rows import cols_io, lane_tree_sums, row_io, row_mode, row_units, row_width

OP = "token_combine"

@dataclasses.dataclass(frozen=True)
class CombineTiling:
    """The combine and dispatch kernels' knobs (the defaults are the library's, measured
    with ``tools/probes/moe_sweep.py``; tests and the sweep pass others to the plans).

    - ``threads``: lanes (threads) per block at most (H = 2048 bf16: 256 row units of
      16 bytes, one per lane);
    - ``lane_units``: units per lane at least (a lane's units are taken in turn: more
      units per lane, fewer lanes per token, more tokens per SM, whose listing phases
      overlap: faster on an H200);
    - ``hold``, ``bwd_hold``: listed rows whose loads a lane issues at once, forward and
      backward (the backward's per-row dot tree comes after each batch: fewer rows a
      batch ran faster on an H200);
    - ``max_regs``: register cap of the token kernels (0: the compiler's choice);
    - ``fill_threads``, ``fill_blocks``: the d_z padding kernels' threads per block and
      blocks at most (grid-strided flags);
    - ``zero_rows``: rows per block of the zero-row kernel."""

    threads: int = 256
    lane_units: int = 2
    hold: int = 8
    bwd_hold: int = 4
    max_regs: int = 0
    fill_threads: int = 256
    fill_blocks: int = 1024
    zero_rows: int = 64


#: the library's combine tiling
COMBINE_TILING = CombineTiling()
#: experts per token at most: the shared list holds every routed expert
CMB_MAX_EXPERTS = 1024


def combine_tiling(hidden: int, kind: str = L.F32, tiling: CombineTiling = COMBINE_TILING):
    """``(lanes, units, mode)``: W lanes per block (``tiling.lane_units`` units per
    lane where ``tiling.threads`` lanes allow it, else more; as few lanes as give
    each the same count: a power of two up to 32, else a multiple of 32), row
    units per row and their mode
    (``rows.row_mode``: 16-byte units of eight bf16 columns where H % 8 == 0)."""
    mode = row_mode(kind, int(hidden))
    units = row_units(mode, hidden)
    want = max(1, -(-units // tiling.lane_units))  # lanes for lane_units units each
    per = max(1, -(-units // min(tiling.threads, want)))  # units per lane: every lane the same count (or one less)
    need = max(1, -(-units // per))
    lanes = pow2_at_least(need) if need <= 32 else -(-need // 32) * 32
    return min(tiling.threads, lanes), units, mode


def expert_cap(num_experts: int) -> int:
    """The shared list's length for E experts: a power of two >= max(E, 32)
    (the kernels are specialised on it: small shared arrays, more blocks per SM)."""
    return pow2_at_least(max(int(num_experts), 32))


@functools.cache
def _lister(w_kind: str, has_w: bool, zero_dw: bool):
    """Device function ``list_routed(rid, w, d_w, t, e_count, r_count, frow, fw, words,
    lrow, le, lw, lane, nl) -> count``: token ``t``'s routed experts in
    ascending order into the shared ``lrow`` (rows), ``le`` (experts) and ``lw``
    (weights); ``zero_dw``: ``d_w[t, e] = 0`` for the others.  The map and the
    weights are read in one pass (independent loads) into ``frow`` / ``fw``.
    Every thread of the block calls it (it holds three barriers)."""
    load_w, store_w = scalar_io(w_kind)

    @cuda.jit(device=True)
    def list_routed(rid, w, d_w, t, e_count, r_count, frow, fw, words, lrow, le, lw, lane, nl):
        base = np.int64(t) * e_count
        for e in range(lane, e_count, nl):
            v = rid[base + e]
            if has_w:
                fw[e] = load_w(w, base + e)
            ok = v >= 0 and v < r_count
            frow[e] = v if ok else np.int32(-1)
            if zero_dw and not ok:
                store_w(d_w, base + e, _ZERO)
        # Barrier: the map's row and weights are in.
        cuda.syncthreads()
        nw = (e_count + 31) // 32
        for wi in range(lane, nw, nl):
            m = np.uint32(0)
            for b in range(32):
                e = wi * 32 + b
                if e < e_count:
                    if frow[e] >= 0:
                        m = np.uint32(m | np.uint32(np.uint32(1) << np.uint32(b)))
            words[wi] = m
        # Barrier: the words are in.
        cuda.syncthreads()
        for e in range(lane, e_count, nl):
            v = frow[e]
            if v >= 0:
                wi = e // 32
                below = np.uint32(np.uint32(np.uint32(1) << np.uint32(e - wi * 32)) - np.uint32(1))
                rank = popc32(np.uint32(words[wi] & below))
                for j in range(wi):
                    rank += popc32(words[j])
                lrow[rank] = v
                le[rank] = e
                lw[rank] = fw[e] if has_w else _ONE
        count = np.int32(0)
        for j in range(nw):
            count += popc32(words[j])
        # Barrier: the list is in.
        cuda.syncthreads()
        return count

    return list_routed


@functools.cache
def _combine_fwd_kernel(z_kind, w_kind, mode, has_w, hold, ecap, max_regs=0):
    load_z, unpack, store_o = row_io(z_kind, mode)
    list_routed = _lister(w_kind, has_w, False)
    uw = row_width(mode)
    raw_words = 4 * hold
    nwords = ecap // 32

    @moe_jit(max_regs)
    def token_combine_fwd_kernel(
        z,  # [R, H] z_kind (row_view)
        rid,  # [T * E] int32 (flat)
        w,  # [T * E] w_kind (flat; placeholder without)
        out,  # [T, H] z_kind, out (row_view)
        e_count, r_count, h, units,
    ):
        frow = cuda.shared.array(ecap, int32)
        fw = cuda.shared.array(ecap, float32)
        words = cuda.shared.array(nwords, uint32)
        lrow = cuda.shared.array(ecap, int32)
        le = cuda.shared.array(ecap, int32)
        lw = cuda.shared.array(ecap, float32)
        raw = cuda.local.array(raw_words, float32)
        val = cuda.local.array(uw, float32)
        acc = cuda.local.array(uw, float32)
        lane = np.int32(cuda.threadIdx.x)
        nl = np.int32(cuda.blockDim.x)
        t = np.int64(cuda.blockIdx.x)
        cnt = list_routed(rid, w, w, t, e_count, r_count, frow, fw, words, lrow, le, lw, lane, nl)
        for u in range(lane, units, nl):
            for j in range(uw):
                acc[j] = _ZERO
            k0 = np.int32(0)
            while k0 < cnt:
                m = min(np.int32(hold), cnt - k0)
                for k in range(hold):  # the loads first, then the sums in list order
                    w0 = w1 = w2 = w3 = _ZERO
                    if k < m:
                        w0, w1, w2, w3 = load_z(z, lrow[k0 + k], u, units, h)
                    raw[4 * k] = w0
                    raw[4 * k + 1] = w1
                    raw[4 * k + 2] = w2
                    raw[4 * k + 3] = w3
                for k in range(hold):
                    if k < m:
                        unpack(raw[4 * k], raw[4 * k + 1], raw[4 * k + 2], raw[4 * k + 3], val, 0)
                        c = lw[k0 + k]
                        for j in range(uw):
                            if has_w:
                                acc[j] = np.float32(acc[j] + np.float32(c * val[j]))
                            else:
                                acc[j] = np.float32(acc[j] + val[j])
                k0 += m
            store_o(out, t, u, units, h, acc, 0)

    return token_combine_fwd_kernel


# Backward (docs/ops/moe_ops.md section 5): out[t] = sum_e w[t, e] z[row(t, e)] is
# linear in each z row and each weight, so with dy = d out[t]:
#   d z[row(t, e)] = w[t, e] dy[t]   (a row appears in one pair at most: no sum)
#   d w[t, e]      = <z[row(t, e)], dy[t]>
# and rows no pair points to get no cotangent (0).
@functools.cache
def _combine_bwd_kernel(dy_kind, z_kind, w_kind, mode, has_w, hold, ecap, max_lanes, max_regs=0):
    load_dy = cols_io(dy_kind, mode)[0]
    load_z, unpack, store_dz = row_io(z_kind, mode)
    store_w = scalar_io(w_kind)[1]
    list_routed = _lister(w_kind, has_w, has_w)
    uw = row_width(mode)
    raw_words = 4 * hold
    nwords = ecap // 32
    publish, total, red_words = lane_tree_sums(hold, max_lanes)  # max_lanes: the block size

    @moe_jit(max_regs)
    def token_combine_bwd_kernel(
        dy,  # [T, H] dy_kind (row_view for z's mode)
        z,  # [R, H] z_kind (row_view)
        rid,  # [T * E] int32 (flat)
        w,  # [T * E] w_kind (flat; placeholder without)
        d_z,  # [R, H] z_kind, out (row_view)
        d_w,  # [T * E] w_kind, out (flat; placeholder without)
        e_count, r_count, h, units,
    ):
        frow = cuda.shared.array(ecap, int32)
        fw = cuda.shared.array(ecap, float32)
        words = cuda.shared.array(nwords, uint32)
        lrow = cuda.shared.array(ecap, int32)
        le = cuda.shared.array(ecap, int32)
        lw = cuda.shared.array(ecap, float32)
        red = cuda.shared.array(red_words, float32)  # lane_tree_sums' two halves
        raw = cuda.local.array(raw_words, float32)
        dyv = cuda.local.array(uw, float32)
        val = cuda.local.array(uw, float32)
        part = cuda.local.array(hold, float32)
        lane = np.int32(cuda.threadIdx.x)
        nl = np.int32(cuda.blockDim.x)
        t = np.int64(cuda.blockIdx.x)
        cnt = list_routed(rid, w, d_w, t, e_count, r_count, frow, fw, words, lrow, le, lw, lane, nl)
        parity = np.int32(0)  # the half of ``red`` these rows' dots go to
        k0 = np.int32(0)
        while k0 < cnt:  # the same count in every thread: the barriers below are uniform
            m = min(np.int32(hold), cnt - k0)
            for k in range(hold):
                part[k] = _ZERO
            for u in range(lane, units, nl):
                if has_w:
                    for k in range(hold):  # the rows' loads first
                        w0 = w1 = w2 = w3 = _ZERO
                        if k < m:
                            w0, w1, w2, w3 = load_z(z, lrow[k0 + k], u, units, h)
                        raw[4 * k] = w0
                        raw[4 * k + 1] = w1
                        raw[4 * k + 2] = w2
                        raw[4 * k + 3] = w3
                load_dy(dy, t, u, units, h, dyv, 0)
                for k in range(hold):
                    if k < m:
                        c = lw[k0 + k]
                        for j in range(uw):
                            val[j] = np.float32(c * dyv[j])
                        store_dz(d_z, lrow[k0 + k], u, units, h, val, 0)
                        if has_w:
                            unpack(raw[4 * k], raw[4 * k + 1], raw[4 * k + 2], raw[4 * k + 3], val, 0)
                            p = part[k]
                            for j in range(uw):
                                p = np.float32(p + np.float32(val[j] * dyv[j]))
                            part[k] = p
            if has_w:
                publish(red, part, lane, parity)
                for k in range(lane, m, nl):
                    store_w(d_w, t * e_count + le[k0 + k], total(red, k, parity))
                parity ^= 1
            k0 += m

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
    """Block ``b`` owns rows ``b rows_per_block ..`` (``CombineTiling.zero_rows``): their flags into shared
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
