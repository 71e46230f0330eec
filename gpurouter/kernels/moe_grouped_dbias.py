"""Grouped bias gradients (TE PR #2864): ``compute_grouped_dbias_dscales`` and
``compute_grouped_dbias``, one kernel family, deterministic (no atomics).

Row ``i`` belongs to group ``g`` iff ``offsets[g] <= i < offsets[g + 1]``
(offsets clipped to ``[0, N]``); with ``s = scales`` (1 without)::

    dbias[g]   = sum_{i in g} s[i] dy[i, :]          (+ a given dbias)
    dscales[i] = sum_h dy[i, h] bias[g(i), h]        (0 for rows no group owns; + a given dscales)

Rows no group owns are never loaded (NaN there reaches nothing).

Tiling (``dbias_tiling``; the knobs are the ``DB_*`` constants below): the
rows are cut into chunks of ``DB_CHUNK_ROWS``, the columns into units of four
(``moe_io``); block ``(c, cb)`` owns chunk ``c`` and column block ``cb``, lane
``l`` of its ``W`` lanes the units ``cb W Q + l + k W`` (``k < Q = DB_QUADS``:
consecutive lanes read consecutive units, every warp load is coalesced).
A lane walks the chunk's rows in order, ``DB_HOLD_ROWS`` rows at a time (all
their loads issued before any is used: ``Q * DB_HOLD_ROWS`` loads in flight per
thread), keeps ``s[i] dy[i]`` summed in fp32 registers for the current group
and flushes the sum when the group changes:

- a group that lies inside the chunk: straight into ``dbias[g]``;
- the chunk's first group, begun in an earlier chunk: into ``part[2c]`` (A);
- the chunk's last group, going on past it: into ``part[2c + 1]`` (B).

Kernel 2 (one block per group and column block) writes every group that spans
chunks ``c0 < c1``: ``B[c0] + A[c0 + 1] + ... + A[c1]``, in chunk order, and
the empty groups (0, or the given dbias).  ``part`` is a plan scratch array
(two fp32 rows per chunk: ~3% of a bf16 ``dy``'s bytes at 128 rows).

``dscales``: each lane's partial dot over its units (fixed order), then per
held row a two-stage sum over the lanes in shared memory (``P = W / hold``
lanes per row sum strided lanes, one lane sums the P partials; two barriers
per ``DB_HOLD_ROWS`` rows).  With one column block that is ``dscales``;
with several (H > 4 Q DB_MAX_LANES) each writes a partial row ``dsp[cb]``
and kernel 3 sums them in column-block order.  Every order is fixed by the
shapes: the results are bit-identical run to run.

No warp intrinsics (shared memory and barriers only): the simulator runs the
same kernels.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda, float32, int32

from . import _launch as L
from ._plan import In, Out, Plan, Spec, Step, Tmp, execute, spec_for, spec_of
from .moe_io import _ONE, _ZERO, flat_view, pow2_at_least, scalar_io, unit_io

OP = "compute_grouped_dbias_dscales"
OP_DBIAS = "compute_grouped_dbias"

#: units (four columns) per lane per row: its fp32 dbias accumulators are 4 Q registers
DB_QUADS = 2
#: rows a lane loads at once before using any (Q * hold loads in flight per thread)
DB_HOLD_ROWS = 8
#: rows per chunk (a block's rows): larger chunks, fewer partial rows; smaller, more blocks
DB_CHUNK_ROWS = 128
#: lanes (threads) per block at most; wider rows take several column blocks
DB_MAX_LANES = 256
#: kernel 2 (groups spanning chunks): threads per block, partial rows loaded at once
DB_GROUP_THREADS = 128
DB_GROUP_HOLD = 8
#: kernel 3 (dscales of several column blocks): threads per block
DB_FINAL_THREADS = 256


def dbias_tiling(num_rows: int, hidden: int):
    """``(lanes, ncb, nchunks, units, quads)``: W lanes per block, column blocks,
    row chunks, units of four columns, and whether ``H % 4 == 0`` (flat vector
    accesses).  ``ncb = ceil(units / (DB_MAX_LANES Q))``; W the lanes that cover
    a column block (a multiple of 32 above 32, a power of two below)."""
    units = -(-int(hidden) // 4)
    ncb = max(1, -(-units // (DB_MAX_LANES * DB_QUADS)))
    need = max(1, -(-units // (ncb * DB_QUADS)))
    lanes = pow2_at_least(need) if need <= 32 else -(-need // 32) * 32
    nchunks = -(-int(num_rows) // DB_CHUNK_ROWS)
    return min(lanes, DB_MAX_LANES), ncb, nchunks, units, hidden % 4 == 0 and hidden > 0


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
def _rows_kernel(dy_kind, s_kind, b_kind, quads, has_scales, has_db_in, has_ds_in, final_ds,
                 q, hold, chunk, max_lanes):
    """Kernel 1 (module docstring), specialised on the kinds, the flags and the tile constants."""
    load_dy = unit_io(dy_kind, quads)[0]
    load_b = unit_io(b_kind, quads)[0]
    load_f, store_f = unit_io(L.F32, quads)
    load_s = scalar_io(s_kind)[0]
    acc_words = 4 * q
    held_words = 4 * q * hold
    red_words = hold * max_lanes

    @cuda.jit(device=True)
    def flush(acc, cur, offsets, n, cs, c, dbias, db_in, part, ubase, nl, units, h):
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
                a0, a1, a2, a3 = acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]
                if dest < 0:
                    if has_db_in:
                        b0, b1, b2, b3 = load_f(db_in, cur, u, units, h)
                        a0, a1, a2, a3 = a0 + b0, a1 + b1, a2 + b2, a3 + b3
                    store_f(dbias, cur, u, units, h, a0, a1, a2, a3)
                else:
                    store_f(part, dest, u, units, h, a0, a1, a2, a3)
        for k in range(acc_words):
            acc[k] = _ZERO

    @cuda.jit
    def kernel(
        dy,  # [N, H] dy_kind (quads: flat)
        scales,  # [N] s_kind (placeholder without scales)
        bias,  # [G, H] b_kind (quads: flat; placeholder without scales)
        offsets,  # [G + 1] int32
        db_in,  # [G, H] fp32 (placeholder without)
        ds_in,  # [N] fp32 (placeholder without)
        dbias,  # [G, H] fp32, out
        dscales,  # [N] fp32, out (placeholder without scales)
        part,  # [2 * nchunks, H] fp32 scratch: A and B rows
        dsp,  # [ncb * N] fp32 scratch: dscales partials (ncb > 1)
        n, h, units, g, ncb,
    ):
        gid = cuda.shared.array(chunk, int32)  # the chunk's rows' groups (-1: none)
        srow = cuda.shared.array(chunk, float32)  # their scales
        red = cuda.shared.array(red_words, float32)  # [hold, W] lane partial dots
        red2 = cuda.shared.array(red_words, float32)  # [hold, P] stage-1 sums
        acc = cuda.local.array(acc_words, float32)
        bia = cuda.local.array(acc_words, float32)
        held = cuda.local.array(held_words, float32)
        lane = np.int32(cuda.threadIdx.x)
        nl = np.int32(cuda.blockDim.x)
        blk = np.int64(cuda.blockIdx.x)
        c = blk // ncb
        cb = blk - c * ncb
        cs = c * chunk
        rows = min(np.int64(chunk), n - cs)
        for r in range(lane, chunk, nl):
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
        parts = max(np.int32(1), np.int32(nl // hold))  # P: stage-1 summers per row
        # Barrier: every lane reads the chunk's groups and scales.
        cuda.syncthreads()
        for r0 in range(0, chunk, hold):
            for hr in range(hold):  # every load of the held rows before any use
                r = r0 + hr
                own = r < rows
                if own:
                    own = gid[r] >= 0  # rows no group owns are never loaded
                for k in range(q):
                    u = ubase + k * nl
                    v0 = v1 = v2 = v3 = _ZERO
                    if own and u < units:
                        v0, v1, v2, v3 = load_dy(dy, cs + r, u, units, h)
                    o = 4 * (hr * q + k)
                    held[o] = v0
                    held[o + 1] = v1
                    held[o + 2] = v2
                    held[o + 3] = v3
            for hr in range(hold):
                r = r0 + hr
                gg = np.int32(-1)
                if r < rows:
                    gg = gid[r]
                dot = _ZERO
                if gg >= 0:
                    if gg != cur:
                        if cur >= 0:
                            flush(acc, cur, offsets, n, cs, c, dbias, db_in, part, ubase, nl, units, h)
                        cur = gg
                        if has_scales:
                            for k in range(q):
                                u = ubase + k * nl
                                b0 = b1 = b2 = b3 = _ZERO
                                if u < units:
                                    b0, b1, b2, b3 = load_b(bias, cur, u, units, h)
                                bia[4 * k] = b0
                                bia[4 * k + 1] = b1
                                bia[4 * k + 2] = b2
                                bia[4 * k + 3] = b3
                    sv = srow[r]
                    for k in range(acc_words):
                        x = held[hr * acc_words + k]
                        if has_scales:
                            acc[k] = np.float32(acc[k] + np.float32(x * sv))
                            dot = np.float32(dot + np.float32(x * bia[k]))
                        else:
                            acc[k] = np.float32(acc[k] + x)
                if has_scales:
                    red[hr * nl + lane] = dot
            if has_scales:
                # Barrier: the lanes' partial dots of the held rows are in.
                cuda.syncthreads()
                for idx in range(lane, hold * parts, nl):
                    hr = idx // parts
                    p = idx - hr * parts
                    s = _ZERO
                    for j in range(p, nl, parts):
                        s = np.float32(s + red[hr * nl + j])
                    red2[idx] = s
                # Barrier: the stage-1 sums are in (and ``red`` is free again).
                cuda.syncthreads()
                for hr in range(lane, hold, nl):
                    r = r0 + hr
                    if r < rows:
                        s = _ZERO
                        for p in range(parts):
                            s = np.float32(s + red2[hr * parts + p])
                        i = cs + r
                        if final_ds:
                            if has_ds_in:
                                s = np.float32(s + ds_in[i])
                            dscales[i] = s
                        else:
                            dsp[cb * n + i] = s
        if cur >= 0:
            flush(acc, cur, offsets, n, cs, c, dbias, db_in, part, ubase, nl, units, h)

    return kernel


@functools.cache
def _groups_kernel(quads, has_db_in, chunk, hold):
    """Kernel 2: the groups that span chunks (their A/B rows in chunk order) and the empty ones."""
    load_f, store_f = unit_io(L.F32, quads)
    held_words = 4 * hold

    @cuda.jit
    def kernel(
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

    return kernel


@functools.cache
def _dscales_kernel(has_ds_in):
    """Kernel 3: ``dscales[i] = sum_cb dsp[cb, i]`` in column-block order (+ the given dscales)."""

    @cuda.jit
    def kernel(dsp, ds_in, dscales, n, ncb):  # dsp [ncb * N], ds_in / dscales [N] fp32
        i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        if i >= n:
            return
        s = _ZERO
        for cb in range(ncb):
            s = np.float32(s + dsp[cb * n + i])
        if has_ds_in:
            s = np.float32(s + ds_in[i])
        dscales[i] = s

    return kernel


# ----------------------------------------------------------------------------
# Plans and launchers
# ----------------------------------------------------------------------------

_ONE_F32 = Spec((1,), np.float32)


@functools.cache
def grouped_dbias_dscales_plan(dy: Spec, scales: Spec | None, bias: Spec | None, offsets: Spec,
                               dbias: Spec | None = None, dscales: Spec | None = None) -> Plan:
    """The launches of ``compute_grouped_dbias_dscales`` (``scales`` and ``bias``
    None: ``compute_grouped_dbias``).  Inputs in this order, the absent ones
    left out: ``dy [N, H]``, ``scales [N]``, ``bias [G, H]``, ``offsets [G + 1]
    int32``, ``dbias [G, H] f32``, ``dscales [N] f32``; outputs ``dbias [G, H]
    f32`` and, with scales, ``dscales [N] f32``; scratch: the chunks' A/B rows
    and the dscales partials."""
    n, h = dy.shape
    g = offsets.shape[0] - 1
    has_scales = scales is not None
    ins = [x for x in (dy, scales, bias, offsets, dbias, dscales) if x is not None]
    idx = {name: i for i, name in enumerate(
        nm for nm, x in zip(("dy", "scales", "bias", "offsets", "dbias", "dscales"),
                            (dy, scales, bias, offsets, dbias, dscales), strict=True) if x is not None)}
    outs = [spec_of((g, h), L.F32)] + ([spec_of((n,), L.F32)] if has_scales else [])
    lanes, ncb, nchunks, units, quads = dbias_tiling(n, h)
    final_ds = ncb == 1
    tmps = (spec_of((2 * max(nchunks, 1), h), L.F32),
            spec_of(((ncb * n) if has_scales and not final_ds and n else 1,), L.F32))

    def arr(ref, spec, kind):  # the flat view of a [., H] array on the quads path
        return type(ref)(ref.role, ref.index, flat_view(kind, spec.shape)) if quads else ref

    out_db = arr(Out(0), outs[0], L.F32)
    placeholder = Out(0, _ONE_F32)
    a_dy = arr(In(idx["dy"]), dy, dy.kind)
    a_s = In(idx["scales"]) if has_scales else placeholder
    a_b = arr(In(idx["bias"]), bias, bias.kind) if has_scales else out_db
    a_dbi = arr(In(idx["dbias"]), dbias, L.F32) if dbias is not None else out_db
    a_dsi = In(idx["dscales"]) if dscales is not None else placeholder
    a_ds = Out(1) if has_scales else placeholder
    a_part = arr(Tmp(0), tmps[0], L.F32)
    steps = []
    if n:
        kern = _rows_kernel(dy.kind, scales.kind if has_scales else L.F32, bias.kind if has_scales else L.F32,
                            quads, has_scales, dbias is not None, dscales is not None, final_ds,
                            DB_QUADS, DB_HOLD_ROWS, DB_CHUNK_ROWS, DB_MAX_LANES)
        steps.append(Step(kern, nchunks * ncb, lanes, 0,
                          (a_dy, a_s, a_b, In(idx["offsets"]), a_dbi, a_dsi, out_db, a_ds, a_part, Tmp(1),
                           n, h, units, g, ncb)))
    if units:
        gt = min(DB_GROUP_THREADS, pow2_at_least(units))
        nub = -(-units // gt)
        steps.append(Step(_groups_kernel(quads, dbias is not None, DB_CHUNK_ROWS, DB_GROUP_HOLD), g * nub, gt, 0,
                          (a_part, a_dbi, out_db, In(idx["offsets"]), n, h, units, nub)))
    if has_scales and n and not final_ds:
        ft = min(DB_FINAL_THREADS, pow2_at_least(n))
        steps.append(Step(_dscales_kernel(dscales is not None), -(-n // ft), ft, 0,
                          (Tmp(1), a_dsi, Out(1), n, ncb)))
    return Plan(OP if has_scales else OP_DBIAS, ins, outs, tmps, steps)


def _offsets_input(offsets, op, stream):
    if L.is_device_array(offsets):
        d = offsets if hasattr(offsets, "copy_to_host") else L._wrap_cai(offsets)
        if np.dtype(d.dtype) != np.int32 or len(d.shape) != 1:
            raise TypeError(f"{op}: a device offsets must be int32 of rank 1, got {d.dtype} {tuple(d.shape)}.")
        return d
    h = np.asarray(offsets)
    if h.ndim != 1 or not np.issubdtype(h.dtype, np.integer):
        raise TypeError(f"{op}: offsets must be integers of rank 1, got {h.dtype} {h.shape}.")
    h = np.clip(h.astype(np.int64), -1, np.iinfo(np.int32).max).astype(np.int32)
    return L.device_input(h, "offsets", op, stream, allow_int=True)[0]


def _f32_input(x, name, op, stream, shape):
    d, kind = L.device_input(x, name, op, stream, ndim=len(shape))
    if kind != L.F32 or tuple(d.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be float32 of shape {tuple(shape)} (it is accumulated into), "
                         f"got {tuple(d.shape)} {d.dtype}.")
    return d


def _run(op, dy, scales, bias, offsets, dbias, dscales, out, stream):
    s = L.resolve_stream(stream)
    d_dy, _ = L.device_input(dy, "dy", op, s, ndim=2)
    n, h = (int(v) for v in d_dy.shape)
    d_s = d_b = None
    if scales is not None:
        d_s, _ = L.device_input(scales, "scales", op, s, ndim=1)
        d_b, _ = L.device_input(bias, "bias", op, s, ndim=2)
        if tuple(d_s.shape) != (n,) or int(d_b.shape[1]) != h:
            raise ValueError(f"{op}: scales {tuple(d_s.shape)} and bias {tuple(d_b.shape)} must be "
                             f"({n},) and (num_groups, {h}).")
    d_o = _offsets_input(offsets, op, s)
    g = int(d_o.shape[0]) - 1
    if g < 1 or (d_b is not None and int(d_b.shape[0]) != g):
        raise ValueError(f"{op}: offsets shape {tuple(d_o.shape)} must be (num_groups + 1,) with num_groups >= 1.")
    d_dbi = None if dbias is None else _f32_input(dbias, "dbias", op, s, (g, h))
    d_dsi = None if dscales is None else _f32_input(dscales, "dscales", op, s, (n,))
    arrays = [d_dy, d_s, d_b, d_o, d_dbi, d_dsi]
    plan = grouped_dbias_dscales_plan(*(None if a is None else spec_for(a.shape, a.dtype) for a in arrays))
    to_host = not L.any_on_device(dy, scales, bias, offsets, dbias, dscales) and out is None
    return execute(plan, [a for a in arrays if a is not None], out, s, to_host)


def grouped_dbias_dscales(dy, scales, bias, offsets, dbias=None, dscales=None, *, out=None, stream=0):
    """``(dbias [G, H] float32, dscales [N] float32)`` (module docstring), deterministic.

    Args:
      dy: (N, H) float32 | bfloat16 | float16.
      scales: (N,) float; bias: (G, H) float.
      offsets: (G + 1,) integers (device: int32), non-decreasing.
      dbias, dscales: optional float32 (G, H) / (N,) added to.
      out: optional device arrays ``(dbias, dscales)``.
      stream: numba stream or int CUDA stream handle.
    """
    return tuple(_run(OP, dy, scales, bias, offsets, dbias, dscales, out, stream))


def grouped_dbias(dy, offsets, dbias=None, *, out=None, stream=0):
    """``dbias [G, H] float32``: ``dy`` summed per group of rows (``G = len(offsets) - 1``)."""
    return _run(OP_DBIAS, dy, None, None, offsets, dbias, None, out, stream)[0]
