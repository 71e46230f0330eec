"""Plans and launchers of the token-level MoE kernels: grouped dbias / dscales
(``grouped_bias.py``) and token dispatch / combine (``permute.py``).

A plan is a pure function of the arrays' Specs (cached): the kernels, their
grids and blocks (the tiling functions of the kernel modules, with the
plan's ``tiling`` argument: a ``permute.CombineTiling`` or a
``grouped_bias.DbiasTiling``, None for the library's), the scratch arrays; a launcher checks its arrays, moves
host ones to the device (``_base/launch.device_input``) and executes the plan.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np

from .._base import launch as L
from .._base.limits import pow2_at_least
from .._base.plan import In, Out, Plan, Spec, Step, Tmp, execute, spec_for, spec_of
from . import grouped_bias as G
from . import permute as C
from .rows import row_view

# ----------------------------------------------------------------------------
# Grouped dbias / dscales
# ----------------------------------------------------------------------------

_ONE_F32 = Spec((1,), np.float32)


@functools.cache
def grouped_dbias_dscales_plan(dy: Spec, scales: Spec | None, bias: Spec | None, offsets: Spec,
                               dbias: Spec | None = None, dscales: Spec | None = None,
                               tiling: G.DbiasTiling | None = None) -> Plan:
    """The launches of ``compute_grouped_dbias_dscales`` (``scales`` and ``bias``
    None: ``compute_grouped_dbias``).  Inputs in this order, the absent ones
    left out: ``dy [N, H]``, ``scales [N]``, ``bias [G, H]``, ``offsets [G + 1]
    int32``, ``dbias [G, H] f32``, ``dscales [N] f32``; outputs ``dbias [G, H]
    f32`` and, with scales, ``dscales [N] f32``; scratch: the chunks' A/B rows
    and the dscales partials.  ``tiling``: a ``DbiasTiling`` (None: the library's)."""
    tiling = tiling or G.DBIAS_TILING
    n, h = dy.shape
    g = offsets.shape[0] - 1
    has_scales = scales is not None
    ins = [x for x in (dy, scales, bias, offsets, dbias, dscales) if x is not None]
    idx = {name: i for i, name in enumerate(
        nm for nm, x in zip(("dy", "scales", "bias", "offsets", "dbias", "dscales"),
                            (dy, scales, bias, offsets, dbias, dscales), strict=True) if x is not None)}
    outs = [spec_of((g, h), L.F32)] + ([spec_of((n,), L.F32)] if has_scales else [])
    lanes, ncb, nchunks, units, mode = G.dbias_tiling(n, h, dy.kind, has_scales, tiling)
    final_ds = ncb == 1
    quads = h % 4 == 0 and h > 0  # kernel 2's fp32 rows, flat
    tmps = (spec_of((2 * max(nchunks, 1), h), L.F32),
            spec_of(((ncb * n) if has_scales and not final_ds and n else 1,), L.F32))

    def arr(ref, spec, kind):  # the row view of a [., H] array (moe/rows.row_view)
        view = row_view(kind, spec.shape, mode)
        return ref if view is None else type(ref)(ref.role, ref.index, view)

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
        kern = G._rows_kernel(dy.kind, scales.kind if has_scales else L.F32, bias.kind if has_scales else L.F32,
                              mode, has_scales, dbias is not None, dscales is not None, final_ds,
                              tiling.quads, *G.rows_knobs(has_scales, tiling), lanes)
        steps.append(Step(kern, nchunks * ncb, lanes, 0,
                          (a_dy, a_s, a_b, In(idx["offsets"]), a_dbi, a_dsi, out_db, a_ds, a_part, Tmp(1),
                           n, h, units, g, ncb)))
    units4 = -(-h // 4)  # kernel 2: fp32 units of four columns
    if units4:
        gt = min(tiling.group_threads, pow2_at_least(units4))
        nub = -(-units4 // gt)
        chunk = G.rows_knobs(has_scales, tiling)[1]
        steps.append(Step(G._groups_kernel(quads, dbias is not None, chunk, tiling.group_hold), g * nub, gt, 0,
                          (a_part, a_dbi, out_db, In(idx["offsets"]), n, h, units4, nub)))
    if has_scales and n and not final_ds:
        ft = min(tiling.final_threads, pow2_at_least(n))
        steps.append(Step(G._dscales_kernel(dscales is not None), -(-n // ft), ft, 0,
                          (Tmp(1), a_dsi, Out(1), n, ncb)))
    return Plan(G.OP if has_scales else G.OP_DBIAS, ins, outs, tmps, steps)


def _int32_input(x, name, what, ndim, op, stream):
    """An integer index array (``offsets``: rank 1, ``row_id_map``: [T, E]) as a
    device int32 array: a device array as it is (int32 of that rank, else a
    TypeError); a host one checked, its values past int32 made harmless
    (offsets clipped to [-1, int32 max]; a row past int32: -1, not routed)."""
    if L.is_device_array(x):
        d = x if hasattr(x, "copy_to_host") else L._wrap_cai(x)
        if np.dtype(d.dtype) != np.int32 or len(d.shape) != ndim:
            raise TypeError(f"{op}: a device {name} must be int32 {what}, got {d.dtype} {tuple(d.shape)}.")
        return d
    h = np.asarray(x)
    if h.ndim != ndim or not np.issubdtype(h.dtype, np.integer):
        raise TypeError(f"{op}: {name} must be integers {what}, got {h.dtype} {h.shape}.")
    big = np.iinfo(np.int32).max
    if ndim == 1:
        h = np.clip(h.astype(np.int64), -1, big)
    else:
        h = np.where((h < 0) | (h > big), -1, h)
    return L.device_input(h.astype(np.int32), name, op, stream, allow_int=True)[0]


def _f32_input(x, name, op, stream, shape):
    d, kind = L.device_input(x, name, op, stream, ndim=len(shape))
    if kind != L.F32 or tuple(d.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be float32 of shape {tuple(shape)} (it is accumulated into), "
                         f"got {tuple(d.shape)} {d.dtype}.")
    return d


def _run(op, dy, scales, bias, offsets, dbias, dscales, out, stream, tiling=None):
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
    d_o = _int32_input(offsets, "offsets", "of rank 1", 1, op, s)
    g = int(d_o.shape[0]) - 1
    if g < 1 or (d_b is not None and int(d_b.shape[0]) != g):
        raise ValueError(f"{op}: offsets shape {tuple(d_o.shape)} must be (num_groups + 1,) with num_groups >= 1.")
    d_dbi = None if dbias is None else _f32_input(dbias, "dbias", op, s, (g, h))
    d_dsi = None if dscales is None else _f32_input(dscales, "dscales", op, s, (n,))
    arrays = [d_dy, d_s, d_b, d_o, d_dbi, d_dsi]
    plan = grouped_dbias_dscales_plan(*(None if a is None else spec_for(a.shape, a.dtype) for a in arrays),
                                      tiling=tiling)
    to_host = not L.any_on_device(dy, scales, bias, offsets, dbias, dscales) and out is None
    return execute(plan, [a for a in arrays if a is not None], out, s, to_host)


def grouped_dbias_dscales(dy, scales, bias, offsets, dbias=None, dscales=None, *, tiling=None, out=None,
                          stream=0):
    """``(dbias [G, H] float32, dscales [N] float32)`` (module docstring), deterministic.

    Args:
      dy: (N, H) float32 | bfloat16 | float16.
      scales: (N,) float; bias: (G, H) float.
      offsets: (G + 1,) integers (device: int32), non-decreasing.
      dbias, dscales: optional float32 (G, H) / (N,) added to.
      tiling: a ``DbiasTiling`` (None: the library's).
      out: optional device arrays ``(dbias, dscales)``.
      stream: numba stream or int CUDA stream handle.
    """
    return tuple(_run(G.OP, dy, scales, bias, offsets, dbias, dscales, out, stream, tiling))


def grouped_dbias(dy, offsets, dbias=None, *, tiling=None, out=None, stream=0):
    """``dbias [G, H] float32``: ``dy`` summed per group of rows (``G = len(offsets) - 1``)."""
    return _run(G.OP_DBIAS, dy, None, None, offsets, dbias, None, out, stream, tiling)[0]


# ----------------------------------------------------------------------------
# Token combine
# ----------------------------------------------------------------------------


def _rows(ref_fn, i, spec: Spec, mode: str):
    """``ref_fn(i)`` seen as rows of ``mode`` units (``moe/rows.row_view``)."""
    view = row_view(spec.kind, spec.shape, mode)
    return ref_fn(i) if view is None else ref_fn(i, view)


def _fill_grid(n: int, tiling: C.CombineTiling) -> int:
    return max(1, min(tiling.fill_blocks, -(-n // tiling.fill_threads)))


@functools.cache
def token_combine_fwd_plan(inp: Spec, row_id_map: Spec, merging_probs: Spec | None = None,
                           tiling: C.CombineTiling | None = None) -> Plan:
    """The launches of the forward: inputs ``inp [R, H]``, ``row_id_map [T, E] int32``
    and, maybe, ``merging_probs [T, E]``; output ``[T, H]`` of inp's kind.
    ``tiling``: a ``CombineTiling`` (None: the library's)."""
    tiling = tiling or C.COMBINE_TILING
    r, h = inp.shape
    t, e = row_id_map.shape
    lanes, units, mode = C.combine_tiling(h, inp.kind, tiling)
    has_w = merging_probs is not None
    outs = (spec_of((t, h), inp.kind),)
    rid = In(1, Spec((max(t * e, 1),), np.int32))
    w = In(2, Spec((max(t * e, 1),), merging_probs.dtype)) if has_w else rid
    steps = []
    if t and units:
        kern = C._combine_fwd_kernel(inp.kind, merging_probs.kind if has_w else L.F32, mode, has_w, tiling.hold,
                                     C.expert_cap(e), tiling.max_regs)
        steps.append(Step(kern, t, lanes, 0, (_rows(In, 0, inp, mode), rid, w, _rows(Out, 0, outs[0], mode),
                                              e, r, h, units)))
    return Plan(C.OP + "_fwd", (inp, row_id_map) + ((merging_probs,) if has_w else ()), outs, (), steps)


def _bwd_kernel(grad_kind, inp_kind, w_kind, mode, has_w, e, lanes, tiling):
    return C._combine_bwd_kernel(grad_kind, inp_kind, w_kind, mode, has_w, tiling.bwd_hold, C.expert_cap(e), lanes,
                                 tiling.max_regs)


@functools.cache
def token_combine_bwd_plan(grad: Spec, inp: Spec, row_id_map: Spec, merging_probs: Spec | None = None,
                           tiling: C.CombineTiling | None = None) -> Plan:
    """The launches of the backward: inputs ``grad [T, H]`` (d out), ``inp [R, H]``,
    ``row_id_map [T, E] int32`` and, maybe, ``merging_probs [T, E]``; outputs
    ``d_inp [R, H]`` (inp's kind) and, with probs, ``d_merging_probs [T, E]``
    (their kind); scratch: a flag per row of ``inp``.  ``tiling``: a ``CombineTiling``
    (None: the library's)."""
    tiling = tiling or C.COMBINE_TILING
    r, h = inp.shape
    t, e = row_id_map.shape
    lanes, units, mode = C.combine_tiling(h, inp.kind, tiling)
    has_w = merging_probs is not None
    outs = (spec_of((r, h), inp.kind),) + ((spec_of((t, e), merging_probs.kind),) if has_w else ())
    tmps = (Spec((max(r, 1),), np.int32),)
    flat_te = Spec((max(t * e, 1),), np.int32)
    rid = In(2, flat_te)
    w = In(3, Spec((max(t * e, 1),), merging_probs.dtype)) if has_w else rid
    d_w = Out(1, Spec((max(t * e, 1),), merging_probs.dtype)) if has_w else rid
    d_z = _rows(Out, 0, outs[0], mode)
    steps = _zero_unreferenced_rows(d_z, rid, inp.kind, mode, t * e, r, h, units, tiling)
    if t and (units or has_w):
        kern = _bwd_kernel(grad.kind, inp.kind, merging_probs.kind if has_w else L.F32, mode, has_w, e, lanes, tiling)
        steps.append(Step(kern, t, lanes, 0, (_rows(In, 0, grad, mode), _rows(In, 1, inp, mode), rid, w, d_z,
                                              d_w, e, r, h, units)))
    ins = (grad, inp, row_id_map) + ((merging_probs,) if has_w else ())
    return Plan(C.OP + "_bwd", ins, outs, tmps, steps)


def _zero_unreferenced_rows(rows, rid, kind, mode, pairs, r, h, units, tiling) -> list:
    """The steps that write zeros into the rows of ``rows [R, H]`` no pair of
    ``rid`` points to: a flag per row (``Tmp(0)``) cleared, marked, read."""
    if not (r and units):
        return []
    steps = [Step(C.moe_clear_row_flags_kernel, _fill_grid(r, tiling), tiling.fill_threads, 0, (Tmp(0), r))]
    if pairs:
        steps.append(Step(C.moe_mark_routed_rows_kernel, _fill_grid(pairs, tiling), tiling.fill_threads, 0,
                          (rid, Tmp(0), pairs, r)))
    steps.append(Step(C._zero_rows_kernel(kind, mode, tiling.zero_rows), -(-r // tiling.zero_rows),
                      min(tiling.fill_threads, pow2_at_least(units)), 0, (rows, Tmp(0), r, h, units)))
    return steps


@functools.cache
def token_dispatch_fwd_plan(inp: Spec, row_id_map: Spec, num_rows: int,
                            tiling: C.CombineTiling | None = None) -> Plan:
    """The row copy of ``token_dispatch``: inputs ``inp [T, H]``, ``row_id_map
    [T, E] int32``; output ``[R, H]`` (inp's kind), ``out[row(t, e)] = inp[t]``,
    every other row exactly 0; scratch: a flag per row.  It is the unweighted
    ``token_combine`` backward (the same kernels: a block per token, its routed
    rows listed, ``inp[t]`` loaded once and stored into each); the dispatch's
    backward is the unweighted ``token_combine`` forward (the K copies summed
    in fp32, ascending expert order).  ``tiling``: a ``CombineTiling`` (None: the library's)."""
    tiling = tiling or C.COMBINE_TILING
    t, h = inp.shape
    e = row_id_map.shape[1]
    r = int(num_rows)
    lanes, units, mode = C.combine_tiling(h, inp.kind, tiling)
    outs = (spec_of((r, h), inp.kind),)
    tmps = (Spec((max(r, 1),), np.int32),)
    rid = In(1, Spec((max(t * e, 1),), np.int32))
    out = _rows(Out, 0, outs[0], mode)
    steps = _zero_unreferenced_rows(out, rid, inp.kind, mode, t * e, r, h, units, tiling)
    if t and units and r:
        kern = _bwd_kernel(inp.kind, inp.kind, L.F32, mode, False, e, lanes, tiling)
        # z and the weights are never read without weights: the output and the map stand in
        steps.append(Step(kern, t, lanes, 0, (_rows(In, 0, inp, mode), out, rid, rid, out, rid, e, r, h, units)))
    return Plan("token_dispatch_fwd", (inp, row_id_map), outs, tmps, steps)


def token_dispatch_fwd(inp, row_id_map, num_rows, *, tiling=None, out=None, stream=0):
    """``[R, H]`` (inp's dtype): ``out[row_id_map[t, e]] = inp[t]`` for every
    routed pair, every other row 0 (``token_dispatch_fwd_plan``)."""
    op = "token_dispatch_fwd"
    s = L.resolve_stream(stream)
    d_x, _ = L.device_input(inp, "inp", op, s, ndim=2)
    d_rid = _int32_input(row_id_map, "row_id_map", "[T, E]", 2, op, s)
    if int(d_rid.shape[0]) != int(d_x.shape[0]):
        raise ValueError(f"{op}: row_id_map shape {tuple(d_rid.shape)} must have inp's {int(d_x.shape[0])} rows.")
    plan = token_dispatch_fwd_plan(spec_for(d_x.shape, d_x.dtype), spec_for(d_rid.shape, d_rid.dtype), int(num_rows),
                                   tiling)
    to_host = not L.any_on_device(inp, row_id_map) and out is None
    return execute(plan, [d_x, d_rid], out, s, to_host)[0]


def _inputs(op, inp, row_id_map, merging_probs, stream):
    d_z, _ = L.device_input(inp, "inp", op, stream, ndim=2)
    d_rid = _int32_input(row_id_map, "row_id_map", "[T, E]", 2, op, stream)
    t, e = (int(v) for v in d_rid.shape)
    if e > C.CMB_MAX_EXPERTS:
        raise NotImplementedError(f"{op} (numba): num_experts ({e}) exceeds the kernel limit of "
                                  f"{C.CMB_MAX_EXPERTS}; use backend=\"jax\".")
    d_w = None
    if merging_probs is not None:
        d_w, _ = L.device_input(merging_probs, "merging_probs", op, stream, ndim=2)
        if tuple(d_w.shape) != (t, e):
            raise ValueError(f"{op}: merging_probs shape {tuple(d_w.shape)} must be row_id_map's ({t}, {e}).")
    return d_z, d_rid, d_w


def token_combine_fwd(inp, row_id_map, merging_probs=None, *, tiling=None, out=None, stream=0):
    """``out [T, H]`` (inp's dtype): the routed rows of ``inp [R, H]`` summed per
    token in ascending expert order, weighted by ``merging_probs [T, E]`` if given."""
    op = C.OP + "_fwd"
    s = L.resolve_stream(stream)
    d_z, d_rid, d_w = _inputs(op, inp, row_id_map, merging_probs, s)
    arrays = [a for a in (d_z, d_rid, d_w) if a is not None]
    plan = token_combine_fwd_plan(*(spec_for(a.shape, a.dtype) for a in arrays), tiling=tiling)
    to_host = not L.any_on_device(inp, row_id_map, merging_probs) and out is None
    return execute(plan, arrays, out, s, to_host)[0]


def token_combine_bwd(grad, inp, row_id_map, merging_probs=None, *, tiling=None, out=None, stream=0):
    """``(d_inp [R, H], d_merging_probs [T, E] or None)`` in one pass (module docstring)."""
    op = C.OP + "_bwd"
    s = L.resolve_stream(stream)
    d_z, d_rid, d_w = _inputs(op, inp, row_id_map, merging_probs, s)
    d_g, _ = L.device_input(grad, "grad", op, s, ndim=2)
    if tuple(d_g.shape) != (int(d_rid.shape[0]), int(d_z.shape[1])):
        raise ValueError(f"{op}: grad shape {tuple(d_g.shape)} must be (num_tokens, hidden) = "
                         f"({int(d_rid.shape[0])}, {int(d_z.shape[1])}).")
    arrays = [a for a in (d_g, d_z, d_rid, d_w) if a is not None]
    plan = token_combine_bwd_plan(*(spec_for(a.shape, a.dtype) for a in arrays), tiling=tiling)
    to_host = not L.any_on_device(grad, inp, row_id_map, merging_probs) and out is None
    res = execute(plan, arrays, out, s, to_host)
    return (res[0], res[1] if merging_probs is not None else None)
