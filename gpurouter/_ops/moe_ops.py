"""The numba backend of the token-level MoE ops: ``jax.custom_vjp`` around the
kernels of ``gpurouter/kernels/moe_*.py`` (docs/ops/moe_ops.md).

Called by :mod:`gpurouter.moe_ops` after the arguments were checked (trace
time, ``gpurouter._checks``). Every launch goes through
:func:`gpurouter._transport.kernel_call` with a plan, so the transports
(callback, zero-copy, ffi) need nothing op-specific. The ops reduce over rows
or read rows of other arrays (``offsets`` groups, ``row_id_map`` rows): every
array is a per-call argument (``vmap`` runs one launch per batch element).

- ``compute_grouped_dbias_dscales`` / ``compute_grouped_dbias``: one kernel call;
- ``grouped_scaled_bias_add``: the forward is elementwise jnp (XLA fuses it),
  the backward the grouped dbias/dscales kernels;
- ``token_combine``: forward one kernel call, backward one kernel call that
  computes ``d_inp`` and ``d_merging_probs`` together;
- ``token_dispatch``: the integer index maps (``row_id_map``, counts,
  ``pad_offsets``) and the small ``permuted_probs`` scatter in jnp, the row
  copy on the kernels (the unweighted combine backward's), its backward the
  unweighted combine forward (the K copies summed in fp32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import _backend
from .._checks import (
    GROUPED_DBIAS_DSCALES_OP,
    GROUPED_DBIAS_OP,
    SCALED_BIAS_ADD_OP,
    TOKEN_COMBINE_OP,
    TOKEN_DISPATCH_OP,
    check_kernel_dtype,
    check_moe_kernel_limit,
)
from .._transport import kernel_call, resolve_transport
from ..reference import moe_ops as _ref

F32 = jnp.float32
I32 = jnp.int32

# ----------------------------------------------------------------------------
# Grouped dbias / dscales
# ----------------------------------------------------------------------------


def _dbs_specs(has_db: bool, has_ds: bool, specs):
    """The plan's specs in its order, the absent accumulators as None."""
    dy, scales, bias, offsets, *acc = specs
    db = acc.pop(0) if has_db else None
    ds = acc.pop(0) if has_ds else None
    return dy, scales, bias, offsets, db, ds


def _dbs_plan(has_db, has_ds, *specs):
    return _backend.kernels().grouped_dbias_dscales_plan(*_dbs_specs(has_db, has_ds, specs))


def _dbs_launch(has_db, has_ds, *arrays, **kw):
    dy, scales, bias, offsets, db, ds = _dbs_specs(has_db, has_ds, arrays)
    return _backend.kernels().grouped_dbias_dscales(dy, scales, bias, offsets, db, ds, **kw)


def _db_plan(has_db, dy, offsets, *acc):
    return _backend.kernels().grouped_dbias_dscales_plan(dy, None, None, offsets, acc[0] if has_db else None)


def _db_launch(has_db, dy, offsets, *acc, **kw):
    return (_backend.kernels().grouped_dbias(dy, offsets, acc[0] if has_db else None, **kw),)


def _dbs_call(dy, scales, bias, offsets, dbias, dscales, transport):
    (n, h), g = dy.shape, bias.shape[0]
    args = [dy, scales, bias, offsets] + [a for a in (dbias, dscales) if a is not None]
    flags = (dbias is not None, dscales is not None)
    specs = [jax.ShapeDtypeStruct((g, h), F32), jax.ShapeDtypeStruct((n,), F32)]
    return tuple(kernel_call(functools.partial(_dbs_launch, *flags), functools.partial(_dbs_plan, *flags), specs,
                             [], args, transport))


def _db_call(dy, offsets, num_groups, dbias, transport):
    args = [dy, offsets] + ([dbias] if dbias is not None else [])
    has_db = dbias is not None
    (db,) = kernel_call(functools.partial(_db_launch, has_db), functools.partial(_db_plan, has_db),
                        [jax.ShapeDtypeStruct((num_groups, dy.shape[1]), F32)], [], args, transport)
    return db


def _owned_rows(offsets, n):
    """``(group of each row, owned)`` as the reference computes them."""
    g, owned, _ = _ref._segments(offsets, n)
    return g, owned


# The op is linear in dy and bilinear in (dy, scales) and (dy, bias), so its
# VJP is the op itself with the cotangents in the roles of scales and bias:
# with ddb [G, H] = d dbias and dds [N] = d dscales,
#   d scales[i] = <dy[i], ddb[g(i)]>        = dscales of (dy, _, ddb)
#   d bias[g]   = sum_{i in g} dds[i] dy[i]  = dbias of (dy, dds, _)
#   d dy[i]     = s[i] ddb[g(i)] + dds[i] bias[g(i)]   (owned rows; else 0)
# and the accumulators pass their cotangents through.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _dbias_dscales(dy, scales, bias, offsets, dbias, dscales, transport):
    return _dbs_call(dy, scales, bias, offsets, dbias, dscales, transport)


def _dbias_dscales_fwd(dy, scales, bias, offsets, dbias, dscales, transport):
    out = _dbs_call(dy, scales, bias, offsets, dbias, dscales, transport)
    return out, (dy, scales, bias, offsets, dbias is not None, dscales is not None)


def _dbias_dscales_bwd(transport, res, cts):
    dy, scales, bias, offsets, has_db, has_ds = res
    ddb, dds = (c.astype(F32) for c in cts)
    g, owned = _owned_rows(offsets, dy.shape[0])
    d_dy = scales.astype(F32)[:, None] * ddb[g] + dds[:, None] * bias.astype(F32)[g]
    d_dy = jnp.where(owned[:, None], d_dy, 0.0).astype(dy.dtype)
    d_bias, d_scales = _dbs_call(dy, jnp.where(owned, dds, 0.0), ddb, offsets, None, None, transport)
    return (d_dy, d_scales.astype(scales.dtype), d_bias.astype(bias.dtype), None,
            ddb if has_db else None, dds if has_ds else None)


_dbias_dscales.defvjp(_dbias_dscales_fwd, _dbias_dscales_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 4))
def _dbias(dy, offsets, num_groups, dbias, transport):
    return _db_call(dy, offsets, num_groups, dbias, transport)


def _dbias_fwd(dy, offsets, num_groups, dbias, transport):
    # (N, 0) zeros carry dy's row count and dtype into the backward
    like = jnp.zeros((dy.shape[0], 0), dy.dtype)
    return _db_call(dy, offsets, num_groups, dbias, transport), (offsets, like, dbias is not None)


def _dbias_bwd(num_groups, transport, res, ddb):
    # dbias[g] = sum_{i in g} dy[i]: d dy[i] = d dbias[g(i)] on owned rows, 0 elsewhere
    offsets, like, has_db = res
    ddb = ddb.astype(F32)
    g, owned = _owned_rows(offsets, like.shape[0])
    d_dy = jnp.where(owned[:, None], ddb[g], 0.0).astype(like.dtype)
    return d_dy, None, ddb if has_db else None


_dbias.defvjp(_dbias_fwd, _dbias_bwd)


def grouped_dbias_dscales(dy, scales, bias, offsets, dbias, dscales, transport: str):
    """``(dbias [G, H] f32, dscales [N] f32)`` by the kernels (arguments checked)."""
    op = GROUPED_DBIAS_DSCALES_OP
    transport = resolve_transport(op, transport)
    for name, x in (("dy", dy), ("scales", scales), ("bias", bias)):
        check_kernel_dtype(op, name, jnp.asarray(x).dtype)
    dy, scales, bias = jnp.asarray(dy), jnp.asarray(scales), jnp.asarray(bias)
    if dy.shape[0] == 0 or dy.shape[1] == 0:  # nothing to launch on: the reference's zeros (and accumulators)
        return _ref.compute_grouped_dbias_dscales(dy, scales, bias, offsets, dbias, dscales)
    acc = [None if a is None else jnp.asarray(a) for a in (dbias, dscales)]
    return _dbias_dscales(dy, scales, bias, jnp.asarray(offsets).astype(I32), *acc, transport)


def grouped_dbias(dy, offsets, num_groups: int, dbias, transport: str):
    """``dbias [G, H] f32`` by the kernels (arguments checked)."""
    op = GROUPED_DBIAS_OP
    transport = resolve_transport(op, transport)
    check_kernel_dtype(op, "dy", jnp.asarray(dy).dtype)
    dy = jnp.asarray(dy)
    if dy.shape[0] == 0 or dy.shape[1] == 0:
        return _ref.compute_grouped_dbias(dy, offsets, num_groups, dbias)
    return _dbias(dy, jnp.asarray(offsets).astype(I32), num_groups, None if dbias is None else jnp.asarray(dbias),
                    transport)


# ----------------------------------------------------------------------------
# Grouped scaled bias add: jnp forward, kernel backward
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _scaled_bias_add(y, bias, scales, offsets, transport):
    return _ref._scaled_bias_add(y, bias, scales, offsets)


def _scaled_bias_add_fwd(y, bias, scales, offsets, transport):
    return _ref._scaled_bias_add(y, bias, scales, offsets), (bias, scales, offsets)


def _scaled_bias_add_bwd(transport, res, dy):
    bias, scales, offsets = res
    # d_y = dy on every row (the tail too); d_bias, d_scales: op 1 on dy.
    db, ds = grouped_dbias_dscales(dy, scales, bias, offsets, None, None, transport)
    return dy, db.astype(bias.dtype), ds.astype(scales.dtype), None


_scaled_bias_add.defvjp(_scaled_bias_add_fwd, _scaled_bias_add_bwd)


def grouped_scaled_bias_add(y, bias, scales, group_sizes, transport: str):
    """``y + bias[g(i)] * scales[i]``; its backward on the kernels (arguments checked)."""
    op = SCALED_BIAS_ADD_OP
    transport = resolve_transport(op, transport)
    for name, x in (("y", y), ("bias", bias), ("scales", scales)):
        check_kernel_dtype(op, name, jnp.asarray(x).dtype)
    y = jnp.asarray(y)
    if y.shape[0] == 0:
        return _ref.grouped_scaled_bias_add(y, bias, scales, group_sizes)
    offsets = _ref._group_offsets(jnp.asarray(group_sizes))
    return _scaled_bias_add(y, jnp.asarray(bias), jnp.asarray(scales), offsets, transport)


# ----------------------------------------------------------------------------
# Token combine
# ----------------------------------------------------------------------------


def _cf_plan(*specs):
    return _backend.kernels().token_combine_fwd_plan(*specs)


def _cf_launch(*arrays, **kw):
    return (_backend.kernels().token_combine_fwd(*arrays, **kw),)


def _cb_plan(*specs):
    return _backend.kernels().token_combine_bwd_plan(*specs)


def _cb_launch(*arrays, **kw):
    d_z, d_w = _backend.kernels().token_combine_bwd(*arrays, **kw)
    return (d_z,) if d_w is None else (d_z, d_w)


def _combine_call(inp, rid, w, transport):
    t = rid.shape[0]
    args = [inp, rid] + ([w] if w is not None else [])
    (out,) = kernel_call(_cf_launch, _cf_plan, [jax.ShapeDtypeStruct((t, inp.shape[1]), inp.dtype)], [], args,
                         transport)
    return out


def _combine_bwd_call(dy, inp, rid, w, transport):
    specs = [jax.ShapeDtypeStruct(inp.shape, inp.dtype)]
    if w is not None:
        specs.append(jax.ShapeDtypeStruct(w.shape, w.dtype))
    args = [dy.astype(inp.dtype), inp, rid] + ([w] if w is not None else [])
    return kernel_call(_cb_launch, _cb_plan, specs, [], args, transport)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_weighted(inp, merging_probs, rid, transport):
    return _combine_call(inp, rid, merging_probs, transport)


def _combine_weighted_fwd(inp, merging_probs, rid, transport):
    return _combine_call(inp, rid, merging_probs, transport), (inp, merging_probs, rid)


def _combine_weighted_bwd(transport, res, dy):
    inp, merging_probs, rid = res
    d_inp, d_w = _combine_bwd_call(dy, inp, rid, merging_probs, transport)  # one pass, both
    return d_inp, d_w, None


_combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combine_plain(inp, rid, transport):
    return _combine_call(inp, rid, None, transport)


def _combine_plain_fwd(inp, rid, transport):
    return _combine_call(inp, rid, None, transport), (inp, rid)


def _combine_plain_bwd(transport, res, dy):
    inp, rid = res
    (d_inp,) = _combine_bwd_call(dy, inp, rid, None, transport)
    return d_inp, None


_combine_plain.defvjp(_combine_plain_fwd, _combine_plain_bwd)


def token_combine(inp, row_id_map, merging_probs, transport: str):
    """``[T, H]`` in ``inp.dtype`` by the kernels (arguments checked)."""
    op = TOKEN_COMBINE_OP
    transport = resolve_transport(op, transport)
    inp, rid = jnp.asarray(inp), jnp.asarray(row_id_map)
    check_kernel_dtype(op, "inp", inp.dtype)
    if merging_probs is not None:
        merging_probs = jnp.asarray(merging_probs)
        check_kernel_dtype(op, "merging_probs", merging_probs.dtype)
    check_moe_kernel_limit(op, "num_experts", rid.shape[1], _backend.kernels().CMB_MAX_EXPERTS)
    if inp.shape[0] == 0 or inp.shape[1] == 0 or rid.shape[0] == 0:
        return _ref.token_combine(inp, rid, merging_probs)
    rid = rid.astype(I32)
    if merging_probs is None:
        return _combine_plain(inp, rid, transport)
    return _combine_weighted(inp, merging_probs, rid, transport)


# ----------------------------------------------------------------------------
# Token dispatch: the index maps in jnp (integer, exact), the row copy on the kernels
# ----------------------------------------------------------------------------


def _df_plan(num_rows, *specs):
    return _backend.kernels().token_dispatch_fwd_plan(*specs, num_rows)


def _df_launch(num_rows, *arrays, **kw):
    return (_backend.kernels().token_dispatch_fwd(*arrays, num_rows, **kw),)


_dispatch_maps = jax.jit(_ref._dispatch_maps, static_argnums=(1,))  # integer maps, one program eagerly


def _routed(rid, num_rows):
    return (rid >= 0) & (rid < num_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dispatch_apply(inp, probs, rid, num_rows, transport):
    return _dispatch_apply_fwd(inp, probs, rid, num_rows, transport)[0]


def _dispatch_apply_fwd(inp, probs, rid, num_rows, transport):
    (out,) = kernel_call(functools.partial(_df_launch, num_rows), functools.partial(_df_plan, num_rows),
                         [jax.ShapeDtypeStruct((num_rows, inp.shape[1]), inp.dtype)], [], [inp, rid], transport)
    pp = None
    if probs is not None:
        # permuted_probs[row(t, e)] = probs[t, e]: an integer-indexed scatter of
        # unique rows (each written once: deterministic), padding rows 0.
        dest = jnp.where(_routed(rid, num_rows), rid, num_rows).reshape(-1)
        pp = jnp.zeros((num_rows,), probs.dtype).at[dest].set(probs.reshape(-1), mode="drop")
    like = jnp.zeros((0,), inp.dtype)
    return (out, pp), (rid, like, None if probs is None else probs[:0, :0])


def _dispatch_apply_bwd(num_rows, transport, res, cts):
    rid, like, probs_like = res
    d_out, d_pp = cts
    # d_inp[t] = sum of the K copies' cotangents: the unweighted combine forward
    # (fp32, ascending expert order); padding rows are never read.
    d_inp = _combine_call(d_out.astype(like.dtype), rid, None, transport)
    d_probs = None
    if probs_like is not None:
        routed = _routed(rid, num_rows)
        d_pp = jnp.zeros((num_rows,), probs_like.dtype) if d_pp is None else d_pp
        d_probs = jnp.where(routed, d_pp[jnp.where(routed, rid, 0)], 0).astype(probs_like.dtype)
    return d_inp, d_probs, None


_dispatch_apply.defvjp(_dispatch_apply_fwd, _dispatch_apply_bwd)


def token_dispatch(inp, routing_map, probs, cfg, transport: str):
    """``(output, permuted_probs, row_id_map, pad_offsets, tokens_per_expert)``
    with the row copy on the kernels (``cfg``: the checked DispatchConfig)."""
    from ..reference.routing_map import unpack_routing_map

    op = TOKEN_DISPATCH_OP
    transport = resolve_transport(op, transport)
    inp = jnp.asarray(inp)
    check_kernel_dtype(op, "inp", inp.dtype)
    if probs is not None:
        probs = jnp.asarray(probs)
        check_kernel_dtype(op, "probs", probs.dtype)
    check_moe_kernel_limit(op, "num_experts", cfg.num_experts, _backend.kernels().CMB_MAX_EXPERTS)
    if inp.shape[0] == 0 or inp.shape[1] == 0:
        return _ref.token_dispatch(inp, routing_map, cfg.num_out_tokens, probs, cfg.align_size,
                                   num_experts=cfg.num_experts)
    m = unpack_routing_map(jnp.asarray(routing_map), cfg.num_experts)
    rid, pad_offsets, tpe = _dispatch_maps(m, cfg)
    out, pp = _dispatch_apply(inp, probs, rid, cfg.num_rows, transport)
    return out, pp, rid, (None if cfg.align_size is None else pad_offsets), tpe
