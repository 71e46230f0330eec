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
  computes ``d_inp`` and ``d_merging_probs`` together.
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


def grouped_dbias_dscales(dy, scales, bias, offsets, dbias, dscales, transport: str):
    """``(dbias [G, H] f32, dscales [N] f32)`` by the kernels (arguments checked)."""
    op = GROUPED_DBIAS_DSCALES_OP
    transport = resolve_transport(op, transport)
    for name, x in (("dy", dy), ("scales", scales), ("bias", bias)):
        check_kernel_dtype(op, name, jnp.asarray(x).dtype)
    dy, scales, bias = jnp.asarray(dy), jnp.asarray(scales), jnp.asarray(bias)
    (n, h), g = dy.shape, bias.shape[0]
    if n == 0 or h == 0:  # nothing to launch on: the reference's zeros (and accumulators)
        return _ref.compute_grouped_dbias_dscales(dy, scales, bias, offsets, dbias, dscales)
    args = [dy, scales, bias, jnp.asarray(offsets).astype(I32)]
    args += [jnp.asarray(a) for a in (dbias, dscales) if a is not None]
    flags = (dbias is not None, dscales is not None)
    specs = [jax.ShapeDtypeStruct((g, h), F32), jax.ShapeDtypeStruct((n,), F32)]
    return kernel_call(functools.partial(_dbs_launch, *flags), functools.partial(_dbs_plan, *flags), specs,
                       [], args, transport)


def grouped_dbias(dy, offsets, num_groups: int, dbias, transport: str):
    """``dbias [G, H] f32`` by the kernels (arguments checked)."""
    op = GROUPED_DBIAS_OP
    transport = resolve_transport(op, transport)
    check_kernel_dtype(op, "dy", jnp.asarray(dy).dtype)
    dy = jnp.asarray(dy)
    n, h = dy.shape
    if n == 0 or h == 0:
        return _ref.compute_grouped_dbias(dy, offsets, num_groups, dbias)
    args = [dy, jnp.asarray(offsets).astype(I32)] + ([jnp.asarray(dbias)] if dbias is not None else [])
    has_db = dbias is not None
    (db,) = kernel_call(functools.partial(_db_launch, has_db), functools.partial(_db_plan, has_db),
                        [jax.ShapeDtypeStruct((num_groups, h), F32)], [], args, transport)
    return db


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
