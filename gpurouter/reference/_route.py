"""The route of the router reference: scores, group-limited selection by
each group-score rule (docs/contract.md sections 2 and 9), and the two
pieces the public op composes around the kernels: the selection alone
(:func:`selection`) and the Quantile-Balancing histogram (:func:`qb_histogram_after`,
section 12)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import ScoreFunction, TopkConfig
from ._scores import _activation
from ._select import selected_indices, topk_mask
from .variants import group_scores, qb_counts, saturating_add


def _eligible(r: jax.Array, cfg: TopkConfig, group_score: str = "sum_topk") -> jax.Array | None:
    """The experts of the kept groups, ``[T, E]`` bool (None without grouping).

    Groups are scored by the ``group_score`` rule (contract section 9); the
    top ``Kg`` group scores are kept, equal scores to the lower group index.
    """
    if not cfg.grouped:
        return None
    num_tokens, num_experts = r.shape
    group_size = num_experts // cfg.num_groups
    per_group = cfg.topk // cfg.group_topk
    grouped = r.reshape(num_tokens, cfg.num_groups, group_size)
    scores = group_scores(lax.stop_gradient(grouped), group_score, per_group)  # [T, G]
    kept = topk_mask(scores, cfg.group_topk)  # [T, G]
    return jnp.repeat(kept, group_size, axis=-1)  # [T, E]


def _select(r: jax.Array, cfg: TopkConfig, group_score: str = "sum_topk") -> jax.Array:
    """Routing mask from the selection scores ``r`` [T, E] (fp32), groups included."""
    return topk_mask(r, cfg.topk, _eligible(r, cfg, group_score))


def _scores(x: jax.Array, expert_bias, cfg: TopkConfig):
    """``(s, r)`` of fp32 logits ``x [T, E]``: the scores and the selection scores."""
    sf = cfg.score_function
    if sf == ScoreFunction.SOFTMAX:
        s = jax.nn.softmax(x, axis=-1) if cfg.use_pre_softmax else x
        return s, s
    s = _activation(x, sf)
    r = s if expert_bias is None else s + lax.stop_gradient(expert_bias).astype(jnp.float32)[None, :]
    return s, r


def selection(logits_rows, expert_bias, cfg: TopkConfig, group_score: str = "sum_topk"):
    """The selected experts of ``logits_rows [T, E]`` as int32 ``[T, K]`` in
    selection order (what a normal call routes to; no weights): used to
    compose the variants around kernels that replay indices."""
    x = lax.stop_gradient(jnp.asarray(logits_rows)).astype(jnp.float32)
    _, r = _scores(x, expert_bias, cfg)
    return selected_indices(r, _select(r, cfg, group_score), cfg.topk)


def qb_call_counts(logits_rows, expert_bias, cfg: TopkConfig, group_score, num_bins, bin_bounds,
                   valid=None) -> jax.Array:
    """This call's QB counts, int32 ``[E, B]`` (contract section 12, step 3)."""
    x = lax.stop_gradient(jnp.asarray(logits_rows)).astype(jnp.float32)
    s, r = _scores(x, expert_bias, cfg)
    return qb_counts(s, r, cfg.topk, num_bins, bin_bounds, _eligible(r, cfg, group_score), valid)


def qb_histogram_after(logits_rows, expert_bias, cfg: TopkConfig, group_score, histogram, bin_bounds,
                       valid=None, axis_name=None) -> jax.Array:
    """The QB histogram after this call (contract section 12): ``histogram``
    plus this call's counts (summed over ``axis_name`` once), saturating."""
    counts = qb_call_counts(logits_rows, expert_bias, cfg, group_score, jnp.shape(histogram)[1], bin_bounds,
                            valid)
    if axis_name is not None:
        counts = lax.psum(counts, axis_name)
    return saturating_add(histogram, counts)
