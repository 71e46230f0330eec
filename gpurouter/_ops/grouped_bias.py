"""The grouped bias ops (public in :mod:`gpurouter.moe`, docs/ops/moe_ops.md):
the backend choice and, for ``backend="numba"``, ``jax.custom_vjp`` around the
kernels of ``gpurouter/kernels/moe/grouped_bias.py`` (launched through
``gpurouter/kernels/moe/plans.py``).

- ``compute_grouped_dbias_dscales`` / ``compute_grouped_dbias``: one kernel call;
- ``grouped_scaled_bias_add``: the forward is elementwise jnp (XLA fuses it),
  the backward the grouped dbias/dscales kernels.

Each public function takes the arguments of its pure-jnp reference in
:mod:`gpurouter.reference.grouped_bias` (same name, same signature) plus the
keyword-only ``backend`` and ``transport``; the choice between them is
``gpurouter/_auto.py``'s ``moe_op_on_kernels``.

Every array is a per-call argument (``vmap`` runs one launch per batch
element); every launch goes through :func:`gpurouter._transport.kernel_call`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._auto import moe_op_on_kernels
from .._checks import (
    GROUPED_DBIAS_DSCALES_OP,
    GROUPED_DBIAS_OP,
    SCALED_BIAS_ADD_OP,
    check_grouped_dbias_args,
    check_grouped_dbias_dscales_args,
    check_kernel_dtype,
    check_scaled_bias_add_args,
)
from .._transport import kernel_call, resolve_transport
from ..reference import grouped_bias as _ref

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
    from ..kernels.moe import plans

    return plans.grouped_dbias_dscales_plan(*_dbs_specs(has_db, has_ds, specs))


def _db_plan(has_db, dy, offsets, *acc):
    from ..kernels.moe import plans

    return plans.grouped_dbias_dscales_plan(dy, None, None, offsets, acc[0] if has_db else None)


def _dbs_call(dy, scales, bias, offsets, dbias, dscales, transport):
    (n, h), g = dy.shape, bias.shape[0]
    args = [dy, scales, bias, offsets] + [a for a in (dbias, dscales) if a is not None]
    flags = (dbias is not None, dscales is not None)
    specs = [jax.ShapeDtypeStruct((g, h), F32), jax.ShapeDtypeStruct((n,), F32)]
    return tuple(kernel_call(functools.partial(_dbs_plan, *flags), specs,
                             [], args, transport))


def _db_call(dy, offsets, num_groups, dbias, transport):
    args = [dy, offsets] + ([dbias] if dbias is not None else [])
    has_db = dbias is not None
    (db,) = kernel_call(functools.partial(_db_plan, has_db),
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


def _kernel_dbias_dscales(dy, scales, bias, offsets, dbias, dscales, transport: str):
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


def _kernel_dbias(dy, offsets, num_groups: int, dbias, transport: str):
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
    db, ds = _kernel_dbias_dscales(dy, scales, bias, offsets, None, None, transport)
    return dy, db.astype(bias.dtype), ds.astype(scales.dtype), None


_scaled_bias_add.defvjp(_scaled_bias_add_fwd, _scaled_bias_add_bwd)


def _kernel_scaled_bias_add(y, bias, scales, group_sizes, transport: str):
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
# The public functions (gpurouter.moe): the backend choice, then the
# reference or the kernels above
# ----------------------------------------------------------------------------


def compute_grouped_dbias_dscales(
    dy: jax.typing.ArrayLike,
    scales: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike,
    offsets: jax.typing.ArrayLike,
    dbias: jax.typing.ArrayLike | None = None,
    dscales: jax.typing.ArrayLike | None = None,
    *,
    backend: str = "auto",
    transport: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """``(dbias [G, H] float32, dscales [N] float32)`` of a per-row-scaled grouped bias.

    TE PR #2864's ``compute_grouped_dbias_dscales``, deterministic: see
    :func:`gpurouter.reference.grouped_bias.compute_grouped_dbias_dscales` for
    the arguments, the algorithm and the differences from TE.

    Args:
      backend: ``"jax"`` (the reference), ``"numba"`` (the kernels: row chunks
        with per-group fp32 sums, no atomics, bit-identical run to run) or
        ``"auto"`` (the kernels where they measured faster, ``gpurouter/_auto.py``).
      transport: how the kernels reach JAX (``"auto"``, ``"callback"``,
        ``"zero-copy"``, ``"ffi"``), as for the router ops.
    """
    if not moe_op_on_kernels(GROUPED_DBIAS_DSCALES_OP, backend, transport, None,
                             *[a for a in (scales, bias, dbias, dscales) if a is not None], dy):
        return _ref.compute_grouped_dbias_dscales(dy, scales, bias, offsets, dbias, dscales)
    check_grouped_dbias_dscales_args(dy, scales, bias, offsets, dbias, dscales)
    return _kernel_dbias_dscales(dy, scales, bias, offsets, dbias, dscales, transport)


def compute_grouped_dbias(
    dy: jax.typing.ArrayLike,
    offsets: jax.typing.ArrayLike,
    num_groups: int,
    dbias: jax.typing.ArrayLike | None = None,
    *,
    backend: str = "auto",
    transport: str = "auto",
) -> jax.Array:
    """``dbias [G, H] float32``: ``dy`` summed per group of rows, deterministic.

    See :func:`gpurouter.reference.grouped_bias.compute_grouped_dbias`.

    Args:
      backend: ``"jax"``, ``"numba"`` (the dbias/dscales kernels without scales)
        or ``"auto"`` (the measured rule, ``gpurouter/_auto.py``).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not moe_op_on_kernels(GROUPED_DBIAS_OP, backend, transport, None, *([] if dbias is None else [dbias]), dy):
        return _ref.compute_grouped_dbias(dy, offsets, num_groups, dbias)
    _, _, g = check_grouped_dbias_args(dy, offsets, num_groups, dbias)
    return _kernel_dbias(dy, offsets, g, dbias, transport)


def grouped_scaled_bias_add(
    y: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike,
    scales: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
    *,
    backend: str = "auto",
    transport: str = "auto",
) -> jax.Array:
    """``y + bias[g(i)] * scales[i]`` (fp32 math, ``y.dtype`` out), differentiable.

    See :func:`gpurouter.reference.grouped_bias.grouped_scaled_bias_add`; the
    backward is :func:`compute_grouped_dbias_dscales`.

    Args:
      backend: ``"jax"``, ``"numba"`` (jnp forward, the backward on the
        :func:`compute_grouped_dbias_dscales` kernels) or ``"auto"`` (the measured rule, ``gpurouter/_auto.py``).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not moe_op_on_kernels(SCALED_BIAS_ADD_OP, backend, transport, None, bias, scales, y):
        return _ref.grouped_scaled_bias_add(y, bias, scales, group_sizes)
    check_scaled_bias_add_args(y, bias, scales, group_sizes)
    return _kernel_scaled_bias_add(y, bias, scales, group_sizes, transport)


__all__ = ["compute_grouped_dbias", "compute_grouped_dbias_dscales", "grouped_scaled_bias_add"]
