"""The selection rule of docs/contract.md section 2, in plain jnp.

One function, :func:`topk_mask`, picks exactly ``k`` entries per row:
larger value first, the lower index among equal values, NaN counted as
``-inf``, ``-0.0`` equal to ``+0.0``, and entries outside ``eligible`` never
picked (not even as fillers). It never depends on the tie order of
``jax.lax.top_k``: ``lax.top_k`` only finds the k-th largest *key* (a value,
which is unique whatever the tie order), and the tied entries at that key are
then taken in index order with a cumulative sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_INELIGIBLE = jnp.iinfo(jnp.int32).min


def _order_key(values: jax.Array) -> jax.Array:
    """Maps float32 values to int32 keys with the same order, NaN as -inf.

    Non-negative floats keep their bits; negative floats flip their magnitude
    bits, so the int32 order equals the float order. ``-0.0`` is first folded
    into ``+0.0`` (they compare equal as floats) on the bits, so subnormals keep
    their order even where the arithmetic flushes them, and NaN becomes ``-inf``.
    The key of ``-inf`` is ``-2**31 + 2**23 - 1``, above ``_INELIGIBLE``.
    """
    v = values.astype(jnp.float32)
    v = jnp.where(jnp.isnan(v), -jnp.inf, v)
    bits = lax.bitcast_convert_type(v, jnp.int32)
    # -0.0 folded into +0.0 on the bits: a float ``v == 0`` would also fold the
    # subnormals where the arithmetic flushes them (XLA:CPU), and 3e-40 must
    # stay above 2e-40 (docs/contract.md section 2)
    bits = jnp.where(bits == jnp.int32(-(2**31)), jnp.int32(0), bits)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def topk_mask(values: jax.Array, k: int, eligible: jax.Array | None = None) -> jax.Array:
    """Boolean mask of the top ``k`` entries of each row of ``values``.

    Args:
      values: ``[..., N]`` floats (any float dtype; compared as float32).
      k: static int, ``1 <= k <= number of eligible entries per row``.
      eligible: optional ``[..., N]`` bool; ineligible entries are never picked.

    Returns:
      ``[..., N]`` bool with exactly ``k`` True per row.
    """
    key = _order_key(lax.stop_gradient(values))
    if eligible is not None:
        key = jnp.where(eligible, key, _INELIGIBLE)
    kth = lax.top_k(key, k)[0][..., k - 1 : k]  # the k-th largest key, [..., 1]
    above = key > kth
    at = key == kth
    need = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    rank_at = jnp.cumsum(at, axis=-1, dtype=jnp.int32)  # 1-based rank among ties, by index
    return above | (at & (rank_at <= need))


def sum_topk_values(values: jax.Array, k: int) -> jax.Array:
    """Sum of the ``k`` largest values of each row, NaN counted as ``-inf``.

    The sum is taken left to right in descending order, ``((v0 + v1) + v2) ...``,
    the order the kernels use, so group scores agree bit for bit.
    """
    v = values.astype(jnp.float32)
    v = jnp.where(jnp.isnan(v), -jnp.inf, v)
    top = lax.top_k(v, k)[0]
    total = top[..., 0]
    for i in range(1, k):
        total = total + top[..., i]
    return total


def selected_indices(values: jax.Array, mask: jax.Array, k: int) -> jax.Array:
    """The ``k`` experts of ``mask`` as indices ``[..., k]`` int32, in the
    selection order: larger ``values`` first, the lower index among equal
    values (NaN as ``-inf``, ``-0.0 == +0.0``), as :func:`topk_mask` ranks.

    ``mask`` must hold exactly ``k`` True per row (what :func:`topk_mask`
    returns); a sort by (descending key, ascending index) puts them first.
    """
    key = jnp.where(mask, _order_key(lax.stop_gradient(values)), _INELIGIBLE)
    iota = lax.broadcasted_iota(jnp.int32, key.shape, key.ndim - 1)
    # ~key reverses the int32 order without overflow (~INT_MIN = INT_MAX: last)
    _, order = lax.sort((~key, iota), dimension=key.ndim - 1, num_keys=2)
    return order[..., :k]


def mask_of_indices(indices: jax.Array, num_experts: int) -> jax.Array:
    """``[..., K]`` integer indices -> ``[..., E]`` bool mask; out-of-range
    entries select nothing and a repeated entry selects its expert once."""
    idx = indices.astype(jnp.int32)[..., :, None]  # [..., K, 1]
    experts = lax.broadcasted_iota(jnp.int32, (1,) * (idx.ndim - 1) + (num_experts,), idx.ndim - 1)
    return jnp.any(idx == experts, axis=-2)


def replay_indices(indices: jax.Array, num_experts: int) -> jax.Array:
    """The ``indices`` a replay returns: the forced ``[..., K]`` entries as
    int32, with -1 for each entry that selects nothing (out of ``[0, E)``, or
    a repeat of an expert already forced earlier in the row), so that they are
    exactly the experts of :func:`mask_of_indices` (docs/contract.md section 2)."""
    idx = indices.astype(jnp.int32)
    k = idx.shape[-1]
    valid = (idx >= 0) & (idx < num_experts)
    # earlier[i, j]: slot j comes before slot i and holds the same expert
    before = jnp.tril(jnp.ones((k, k), bool), -1).reshape((1,) * (idx.ndim - 1) + (k, k))
    earlier = (idx[..., :, None] == idx[..., None, :]) & before
    first = ~jnp.any(earlier, axis=-1)
    return jnp.where(valid & first, idx, -1)
