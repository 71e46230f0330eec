"""Pure-jnp reference of the router variants of docs/contract.md sections
9-12: the group-score rules, token masks, and Quantile Balancing (QB): the
histogram a QB call adds to, and :func:`qb_update_expert_bias`, the bias
step that reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import INT32_MAX, check_qb_update_args
from ._select import sum_topk_values


def group_scores(grouped: jax.Array, rule: str, per_group: int) -> jax.Array:
    """The score of each group, ``grouped [T, G, E/G]`` -> ``[T, G]`` (contract section 9).

    ``"sum_topk"``: the sum of the top ``per_group`` values; ``"top2_sum"``:
    of the top 2; ``"max"``: the largest. NaN counts as ``-inf``; sums run in
    descending order.
    """
    if rule == "sum_topk":
        return sum_topk_values(grouped, per_group)
    if rule == "top2_sum":
        return sum_topk_values(grouped, 2)
    return sum_topk_values(grouped, 1)  # "max": the top 1, NaN as -inf


def flat_token_mask(token_mask, num_tokens: int) -> jax.Array:
    """A checked token mask (the tokens' shape or flat) as ``bool [T]``."""
    return jnp.asarray(token_mask).reshape(num_tokens)


def valid_count(mask: jax.Array, axis_name=None) -> jax.Array:
    """``max(number of valid tokens, 1)`` as an int32 scalar, summed over
    ``axis_name`` (the global count) when given (contract section 10)."""
    n = jnp.sum(mask, dtype=jnp.int32)
    if axis_name is not None:
        n = lax.psum(n, axis_name)
    return jnp.maximum(n, 1)


def qb_cutoff(r: jax.Array, topk: int, eligible: jax.Array | None = None) -> jax.Array:
    """``alpha [T]``: the ``(topk + 1)``-th largest selection score ``r [T, E]``
    (NaN as ``-inf``), among the ``eligible`` experts when given."""
    v = jnp.where(jnp.isnan(r), -jnp.inf, r.astype(jnp.float32))
    if eligible is not None:
        v = jnp.where(eligible, v, -jnp.inf)
    return lax.top_k(v, topk + 1)[0][..., topk]


def qb_bins(rb: jax.Array, bin_bounds: jax.Array, num_bins: int) -> jax.Array:
    """``bin(rb)``: ``floor((rb - lower) * (B / (upper - lower)))`` in float32 (the
    scale ``B / (upper - lower)`` rounded once), clamped into ``[0, B - 1]``, NaN
    to bin 0 (int32, the shape of ``rb``).

    Written with the scale first on purpose: XLA rewrites a division of an
    array by a scalar into a product with its reciprocal, and reassociates
    that product under ``jit``, so ``((rb - lower) * B) / (upper - lower)``
    gave different bins eagerly and under ``jit``; this form has nothing left
    to rewrite, and the QB kernels compute it alike (docs/contract.md section
    12)."""
    bounds = jnp.asarray(bin_bounds).astype(jnp.float32)
    lower, upper = bounds[0], bounds[1]
    scale = jnp.float32(num_bins) / (upper - lower)
    v = jnp.floor((rb - lower) * scale)
    v = jnp.clip(v, 0, num_bins - 1)  # +-inf clamp too; NaN stays NaN
    return jnp.where(jnp.isnan(v), 0, v).astype(jnp.int32)


def qb_counts(s: jax.Array, r: jax.Array, topk: int, num_bins: int, bin_bounds,
              eligible: jax.Array | None = None, valid: jax.Array | None = None) -> jax.Array:
    """This call's QB counts, int32 ``[E, B]`` (contract section 12, step 3).

    ``s [T, E]`` the unbiased scores, ``r [T, E]`` the biased ones (float32),
    ``valid [T]`` the token mask. Every (valid token, expert) pair adds one
    count to ``bin(alpha_t - s[t, e])`` of its expert's row.
    """
    s = lax.stop_gradient(s).astype(jnp.float32)
    alpha = qb_cutoff(lax.stop_gradient(r), topk, eligible)
    bins = qb_bins(alpha[:, None] - s, bin_bounds, num_bins)  # [T, E]
    num_tokens, num_experts = s.shape
    flat = bins + num_bins * lax.broadcasted_iota(jnp.int32, bins.shape, 1)
    ones = jnp.ones(bins.shape, jnp.int32) if valid is None else jnp.broadcast_to(
        valid[:, None], bins.shape).astype(jnp.int32)
    counts = jnp.zeros((num_experts * num_bins,), jnp.int32).at[flat.reshape(-1)].add(ones.reshape(-1))
    return counts.reshape(num_experts, num_bins)


def saturating_add(histogram: jax.Array, counts: jax.Array) -> jax.Array:
    """``histogram + counts`` (int32, ``counts >= 0``), each bin held at
    ``2**31 - 1`` instead of wrapping (contract section 12, step 5)."""
    h = jnp.asarray(histogram)
    return jnp.where(h > INT32_MAX - counts, jnp.int32(INT32_MAX), h + counts)


def qb_update_expert_bias(
    histogram: jax.typing.ArrayLike,
    bin_bounds: jax.typing.ArrayLike,
    topk: int,
    expert_bias: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Quantile Balancing's bias step: the next ``expert_bias`` and bin bounds.

    Kimi K3 report section 2.3.3 (eqs. 13-14), as Megatron #6637 implements
    it: per expert, the ``topk / E`` quantile of the "bias needed to win this
    token" the histogram holds, linear inside its bin; then centred on its
    mean; the next bounds are ``[min - 1, max + 1]`` (docs/contract.md
    section 12). Pure jnp, no gradient; call it once per global batch on the
    globally reduced histogram, then reset the histogram to zeros.

    Args:
      histogram: int32 ``[E, B]`` counts (what
        :func:`gpurouter.fused_topk_with_score_function` returns with
        ``qb_histogram=``).
      bin_bounds: float ``[2]``, the ``[lower, upper]`` the counts were
        binned with.
      topk: the router's ``topk``, ``1 <= topk < E``.
      expert_bias: optional, the current float ``[E]`` bias. It only matters
        when the histogram holds no count at all: then nothing is learned and
        the bias and the bounds come back as they are (Megatron #6637's
        rule); otherwise the new bias replaces it.

    Returns:
      ``(expert_bias float32 [E], bin_bounds float32 [2])``. An empty
      histogram gives ``expert_bias`` and ``bin_bounds`` unchanged when
      ``expert_bias`` is given, else a zero bias and bounds ``[-1, 1]``. A
      row without counts (hand-made: every routed token adds one to every
      row) takes the lower bound as its quantile.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter import reference as ref
      >>> hist = jnp.array([[0, 4, 0, 0], [0, 0, 0, 4]], jnp.int32)
      >>> bias, bounds = ref.qb_update_expert_bias(hist, jnp.array([-2.0, 2.0]), 1)
      >>> bias.tolist(), bounds.tolist()
      ([-1.0, 1.0], [-2.0, 2.0])
    """
    topk, num_experts, num_bins = check_qb_update_args(histogram, bin_bounds, topk, expert_bias=expert_bias)
    h = jnp.asarray(histogram).astype(jnp.float32)
    cum = jnp.cumsum(h, axis=1)
    total = cum[:, -1]
    target = (total * jnp.float32(topk)) / jnp.float32(num_experts)  # q N_e
    # the first bin reaching it: c_i >= q N_e compared as c_i E >= N_e topk, products of integers (exact
    # below 2**24, rounded alike when equal); not against target, which XLA computes as a product with
    # fp32(1 / E): 21 / 7 gave 3.0000002, and a bin ending exactly at 3 was passed over
    i = jnp.argmax(cum * jnp.float32(num_experts) >= (total * jnp.float32(topk))[:, None], axis=1)
    before = jnp.concatenate([jnp.zeros((num_experts, 1), jnp.float32), cum[:, :-1]], axis=1)
    c_prev = jnp.take_along_axis(before, i[:, None], axis=1)[:, 0]
    h_i = jnp.take_along_axis(h, i[:, None], axis=1)[:, 0]
    frac = jnp.where(h_i > 0, (target - c_prev) / jnp.where(h_i > 0, h_i, 1), 0)
    bounds = jnp.asarray(bin_bounds).astype(jnp.float32)
    width = (bounds[1] - bounds[0]) / jnp.float32(num_bins)
    x = bounds[0] + (i.astype(jnp.float32) + frac) * width
    bias = x - jnp.mean(x)
    new_bounds = jnp.stack([jnp.min(bias) - 1, jnp.max(bias) + 1])
    if expert_bias is None:
        return bias, new_bounds
    empty = jnp.all(jnp.asarray(histogram) == 0)  # nothing counted: keep what the caller has
    return (jnp.where(empty, jnp.asarray(expert_bias).astype(jnp.float32), bias),
            jnp.where(empty, bounds, new_bounds))


__all__ = ["qb_update_expert_bias"]
