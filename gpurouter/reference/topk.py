"""Pure-jnp reference of the router top-k op and of the aux-loss scores.

This file is the executable specification of docs/contract.md sections 2 and 3. The
public function :func:`fused_topk_with_score_function` is differentiable by
plain JAX autodiff (no custom VJP); the low-level pairs
``topk_with_score_function_fwd/_bwd`` and ``score_for_aux_loss_fwd/_bwd``
spell out what the kernels compute, saved fp32 intermediate included, and the
backward formulas of section 3 written by hand. The tests check that the
hand-written backward equals ``jax.vjp`` of the forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._checks import (
    TOPK_OP,
    RoutingMapFormat,
    ScoreFunction,
    TopkConfig,
    array_meta,
    as_bool,
    check_forced_indices,
    check_topk_args,
    check_topk_variants,
    score_function_of,
)
from ._route import _scores, _select, qb_histogram_after
from ._scores import EPS as EPS
from ._scores import SOFTPLUS_THRESHOLD as SOFTPLUS_THRESHOLD
from ._scores import _activation, _activation_and_grad, _normalise, _normalised_grad
from ._scores import _normalise_rows as _normalise_rows
from ._scores import _normalise_rows_jvp as _normalise_rows_jvp
from ._scores import _sqrtsoftplus_jvp as _sqrtsoftplus_jvp
from ._scores import sigmoid as sigmoid
from ._scores import sqrtsoftplus as sqrtsoftplus
from ._scores import sqrtsoftplus_grad as sqrtsoftplus_grad
from ._select import mask_of_indices, replay_indices, selected_indices, topk_mask
from .routing_map import map_of_format, unpack_routing_map
from .variants import flat_token_mask

# The score functions and the normalisation (EPS, sigmoid, sqrtsoftplus, ...) live in
# _scores.py; the names imported above as `X as X` stay importable from this module.


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------


def _topk_forward(logits, expert_bias, cfg: TopkConfig, forced=None, group_score: str = "sum_topk"):
    """Shared forward: returns ``(probs fp32, routing_map, saved fp32, r fp32)``,
    ``r`` the selection scores. With ``forced`` indices ``[T, K]`` (routing
    replay) the experts are those, not selected: bias and groups play no part."""
    x = logits.astype(jnp.float32)
    sf = cfg.score_function
    s, r = _scores(x, expert_bias, cfg)
    mask = _select(r, cfg, group_score) if forced is None else mask_of_indices(forced, x.shape[-1])
    if sf == ScoreFunction.SOFTMAX and not cfg.use_pre_softmax:
        t = jax.nn.softmax(jnp.where(mask, x, -jnp.inf), axis=-1)
        saved = jnp.where(mask, t, -jnp.inf)
    elif sf == ScoreFunction.SOFTMAX:
        t, saved = s, s
    else:
        # the weights from the selected logits only: an expert off the map then
        # gets gradient 0, not 0 * NaN, whatever its logit (contract section 2)
        sw = _activation(jnp.where(mask, x, 0), sf)
        t = _normalise(sw, mask) if cfg.topk > 1 else sw
        saved = s if sf == ScoreFunction.SIGMOID else x
    probs = jnp.where(mask, cfg.scaling_factor * t, 0)
    return probs, mask, saved, r


def _aux_scores_forward(logits, cfg: TopkConfig):
    """Shared aux-score forward: returns ``(scores fp32, routing_map, saved fp32)``."""
    x = logits.astype(jnp.float32)
    sf = cfg.score_function
    if sf == ScoreFunction.SOFTMAX:
        scores = jax.nn.softmax(x, axis=-1)
        saved = scores
    else:
        v = _activation(x, sf)
        scores = _normalise(v, None)
        saved = v if sf == ScoreFunction.SIGMOID else x
    return scores, topk_mask(scores, cfg.topk), saved


def _config(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
            score_function, expert_bias, compute_aux_scores, routing_map_format, op) -> TopkConfig:
    bias_shape, bias_dtype = (None, None) if expert_bias is None else array_meta(op, "expert_bias", expert_bias)
    return check_topk_args(
        *array_meta(op, "logits", logits), topk, use_pre_softmax, num_groups,
        group_topk, scaling_factor, score_function, bias_shape, bias_dtype,
        compute_aux_scores, routing_map_format, op=op,
    )


def _rows(x: jax.Array) -> jax.Array:
    """[..., E] -> [T, E]."""
    return x.reshape(-1, x.shape[-1])


def fused_topk_with_score_function(
    logits: jax.typing.ArrayLike,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int = -1,
    group_topk: int = -1,
    scaling_factor: float = 1.0,
    score_function: str | ScoreFunction = "softmax",
    expert_bias: jax.typing.ArrayLike | None = None,
    compute_aux_scores: bool = False,
    routing_map_format: str | int | RoutingMapFormat = RoutingMapFormat.BYTEMAP,
    *,
    return_indices: bool = False,
    forced_indices: jax.typing.ArrayLike | None = None,
    group_score: str = "sum_topk",
    compact: bool = False,
    indices_dtype="int32",
    qb_histogram: jax.typing.ArrayLike | None = None,
    qb_bin_bounds: jax.typing.ArrayLike | None = None,
    qb_histogram_mode: str | None = None,
    token_mask: jax.typing.ArrayLike | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> tuple[jax.Array, ...]:
    """Routes each token to ``topk`` experts (pure-jnp reference).

    Args:
      logits: ``[..., E]`` float32, bfloat16 or float16 router logits; leading
        dims are tokens.
      topk: ``1 <= topk <= E``.
      use_pre_softmax: softmax only: softmax over all ``E`` before the top-k
        (no renormalisation) instead of a softmax over the selected experts.
      num_groups: ``G``; used iff ``group_topk > 0``; ``E % G == 0``.
      group_topk: ``Kg`` groups kept per token; ``<= 0`` disables grouping;
        ``topk % Kg == 0``, ``Kg <= G``, ``topk / Kg <= E / G``.
      scaling_factor: multiplies the final probs.
      score_function: ``"softmax"``, ``"sigmoid"``, ``"sqrtsoftplus"`` or a
        :class:`ScoreFunction`.
      expert_bias: ``[E]`` float, sigmoid/sqrtsoftplus only; it changes the
        selection, never the probs, and gets no gradient.
      compute_aux_scores: return the dense float32 aux-loss scores over all
        ``E`` (no bias, groups or scaling) instead of the probs.
      routing_map_format: a :class:`RoutingMapFormat`, its name (any case) or
        its int code: ``BYTEMAP`` (0, the default) or ``BITMAP_U8`` (1).
      return_indices: also return the selected experts as ``indices
        [..., topk]`` int32, in selection order (larger selection score
        ``r`` first, the lower index among equal scores).
      forced_indices: routing replay: ``[..., topk]`` integers, the experts
        to route to (e.g. recorded by an inference engine). Nothing is
        selected: ``expert_bias`` and the groups are ignored, and the probs
        (and their gradient) are those a normal call that had selected these
        experts gives. Out-of-range or repeated indices: a ``ValueError``
        where the array is concrete; under ``jit`` an out-of-range entry
        selects nothing and a repeated one its expert once. Not with
        ``compute_aux_scores``. Any integer dtype (int16 and int32 alike).
      group_score: with grouping, how a group is scored from ``r``:
        ``"sum_topk"`` (the sum of its top ``topk / Kg``; TE's rule and the
        default), ``"top2_sum"`` (the sum of its top 2; DeepSeek-V3's
        reference code) or ``"max"`` (docs/contract.md section 9).
      compact: return ``(weights [..., topk], indices [..., topk])`` in
        selection order instead of the dense probs and map (section 11).
      indices_dtype: ``"int32"`` (default) or ``"int16"`` (``E <= 32768``):
        the dtype of the returned indices.
      qb_histogram: Quantile Balancing (section 12): int32 ``[E, B]``
        counts, with ``qb_bin_bounds``; the updated histogram is returned as
        an extra last result. Needs sigmoid (or sqrtsoftplus), an
        ``expert_bias`` and ``topk < E``.
      qb_bin_bounds: float ``[2]``, ``[lower, upper]`` of the histogram's bins.
      qb_histogram_mode: ``None``, ``"two_kernel"`` or ``"fused_atomic"``: TE's
        choice of histogram kernels, accepted (with QB only) so that a TE call
        runs unchanged; the counts are integers, the same in either mode, and
        gpurouter chooses its own passes.
      token_mask: with QB: bool, the tokens' shape (or flat ``[T]``); masked
        tokens are routed as usual but add no counts.
      axis_name: with QB, inside ``shard_map`` over data shards: this call's
        counts are summed over the axis (once) before they are added.

    Returns:
      ``(probs, routing_map)``: ``probs [..., E]`` in the dtype of ``logits``
      (float32 when ``compute_aux_scores``), zero off the selected experts;
      ``routing_map`` with exactly ``topk`` experts set per row: ``[..., E]``
      bool (BYTEMAP), or ``[..., ceil(E / 8)]`` uint8 with bit ``e % 8`` of
      byte ``e // 8`` set for expert ``e`` and padding bits 0 (BITMAP_U8).
      With ``return_indices``: ``(probs, routing_map, indices)``; with
      ``forced_indices`` too, ``indices`` are the forced ones (in
      ``indices_dtype``), -1 where an entry selects nothing (out of range, or a
      repeat). With ``compact``: ``(weights, indices)``,
      ``weights[..., j] = probs[..., indices[..., j]]`` (0 at an index -1). With
      QB the updated histogram follows, last.

    Algorithm (per token, in float32):
      1. score ``s``: softmax (pre), raw logits (softmax post), sigmoid or
         sqrtsoftplus;
      2. selection score ``r = s + expert_bias`` (else ``r = s``);
      3. if grouping: group score = sum of the top ``topk / Kg`` values of ``r``
         in each group; only the top ``Kg`` groups stay eligible;
      4. top-``topk`` of ``r`` among the eligible experts;
      5. weights from the unbiased ``s``: softmax over the selected (post),
         ``s`` (pre), ``s / (sum_selected s + 1e-20)`` (sigmoid/sqrtsoftplus,
         ``topk > 1``);
      6. ``probs = scaling_factor * weights`` on the selected experts.

    Notes:
      Ties go to the lower expert index (as ``jax.lax.top_k`` documents); NaN
      counts as ``-inf`` for selection only; every row selects exactly
      ``topk`` distinct experts.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter import reference as ref
      >>> probs, routing_map = ref.fused_topk_with_score_function(
      ...     jnp.array([[1.0, 3.0, 2.0, 0.0]]), topk=2)
      >>> routing_map.tolist()
      [[False, True, True, False]]
      >>> [round(float(p), 4) for p in probs[0]]
      [0.0, 0.7311, 0.2689, 0.0]
    """
    op = TOPK_OP
    cfg = _config(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                  score_function, expert_bias, compute_aux_scores, routing_map_format, op)
    return_indices = as_bool(op, "return_indices", return_indices)
    if forced_indices is not None:
        check_forced_indices(op, forced_indices, jnp.shape(logits), cfg.topk, cfg.compute_aux_scores)
    from .._sharding import axis_size

    var = check_topk_variants(
        op, cfg, jnp.shape(logits), return_indices=return_indices, group_score=group_score,
        compact=compact, indices_dtype=indices_dtype, expert_bias=expert_bias,
        forced=forced_indices is not None, qb_histogram=qb_histogram, qb_bin_bounds=qb_bin_bounds,
        token_mask=token_mask, axis_name=axis_name, qb_histogram_mode=qb_histogram_mode,
        shards=axis_size(op, axis_name) if qb_histogram is not None else 1)
    logits = jnp.asarray(logits)
    shape = logits.shape
    idx_shape = shape[:-1] + (cfg.topk,)
    x = _rows(logits)
    bias = None
    if cfg.compute_aux_scores:
        out, mask, _ = _aux_scores_forward(x, cfg)
        r = out
    else:
        bias = None if expert_bias is None or forced_indices is not None else jnp.asarray(expert_bias)
        forced = None if forced_indices is None else jnp.asarray(forced_indices).reshape(-1, cfg.topk)
        out, mask, _, r = _topk_forward(x, bias, cfg, forced, var.group_score)
        out = out.astype(logits.dtype)
    if var.return_indices or var.compact:
        if forced_indices is not None:
            indices = replay_indices(jnp.asarray(forced_indices).reshape(-1, cfg.topk), shape[-1])
        else:
            indices = selected_indices(r, mask, cfg.topk)
    if var.compact:
        weights = jnp.take_along_axis(out, jnp.maximum(indices, 0), axis=-1)
        weights = jnp.where(indices >= 0, weights, jnp.zeros((), weights.dtype))
        result = (weights.reshape(idx_shape), indices.astype(var.indices_dtype).reshape(idx_shape))
    else:
        result = (out.reshape(shape), map_of_format(mask.reshape(shape), cfg.routing_map_format))
        if var.return_indices:
            result += (indices.astype(var.indices_dtype).reshape(idx_shape),)
    if var.qb:
        valid = None if token_mask is None else flat_token_mask(token_mask, x.shape[0])
        result += (qb_histogram_after(x, bias, cfg, var.group_score, jnp.asarray(qb_histogram), qb_bin_bounds,
                                valid, axis_name),)
    return result


# ----------------------------------------------------------------------------
# Low level: the pairs the kernels mirror (2-D [T, E] arrays)
# ----------------------------------------------------------------------------


def topk_with_score_function_fwd(
    logits, topk, use_pre_softmax=False, num_groups=-1, group_topk=-1,
    scaling_factor=1.0, score_function="softmax", expert_bias=None,
    routing_map_format=RoutingMapFormat.BYTEMAP,
):
    """Forward of the top-k op on ``logits [T, E]``.

    Returns:
      ``(probs [T, E] logits dtype, routing_map, saved_scores [T, E] float32)``;
      ``routing_map`` is ``[T, E]`` bool or (BITMAP_U8) ``[T, ceil(E / 8)]`` uint8.
      ``saved_scores`` is TE's intermediate: sigmoid(x) (sigmoid), raw x
      (sqrtsoftplus), softmax over all E (softmax pre), and for softmax post
      the softmax over the selected experts with ``-inf`` elsewhere.
    """
    cfg = _config(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                  score_function, expert_bias, False, routing_map_format,
                  "topk_with_score_function_fwd")
    logits = jnp.asarray(logits)
    bias = None if expert_bias is None else jnp.asarray(expert_bias)
    probs, mask, saved, _ = _topk_forward(logits, bias, cfg)
    return (probs.astype(logits.dtype), map_of_format(mask, cfg.routing_map_format),
            saved.astype(jnp.float32))


def topk_with_score_function_bwd(
    routing_map, saved_scores, grad_probs, topk, use_pre_softmax=False,
    scaling_factor=1.0, score_function="softmax",
):
    """Backward of the top-k op (docs/contract.md section 3), written out by hand.

    Args:
      routing_map: from the forward, in either format: ``[T, E]`` bool or
        ``[T, ceil(E / 8)]`` uint8 (BITMAP_U8).
      saved_scores: ``[T, E]`` float32 from the forward.
      grad_probs: ``[T, E]`` cotangent of probs (its dtype is the result's).

    Returns:
      ``grad_logits [T, E]`` in the dtype of ``grad_probs``.
    """
    sf = score_function_of("topk_with_score_function_bwd", score_function)
    saved = jnp.asarray(saved_scores, jnp.float32)
    m = unpack_routing_map(routing_map, saved.shape[-1])
    grad_probs = jnp.asarray(grad_probs)
    g = grad_probs.astype(jnp.float32) * jnp.float32(scaling_factor)
    if sf == ScoreFunction.SOFTMAX and use_pre_softmax:
        mg = jnp.where(m, g, 0)
        dx = saved * (mg - jnp.sum(mg * saved, axis=-1, keepdims=True))
    elif sf == ScoreFunction.SOFTMAX:
        q = jnp.where(m, saved, 0)
        mg = jnp.where(m, g, 0)
        dx = q * (mg - jnp.sum(mg * q, axis=-1, keepdims=True))
    else:
        a, da = _activation_and_grad(saved, sf)
        dx = _normalised_grad(a, da, g, m, normalise=topk > 1)
    return dx.astype(grad_probs.dtype)


def score_for_aux_loss_fwd(logits, topk, score_function="softmax",
                           routing_map_format=RoutingMapFormat.BYTEMAP):
    """Forward of the aux-loss scores on ``logits [T, E]``.

    Returns:
      ``(scores [T, E] float32, routing_map, saved_scores [T, E] float32)``;
      ``routing_map`` as in :func:`topk_with_score_function_fwd`;
      ``saved_scores`` is softmax(x), sigmoid(x), or raw x (sqrtsoftplus).
    """
    cfg = _config(logits, topk, False, -1, -1, 1.0, score_function, None, True,
                  routing_map_format, "score_for_aux_loss_fwd")
    scores, mask, saved = _aux_scores_forward(jnp.asarray(logits), cfg)
    return scores, map_of_format(mask, cfg.routing_map_format), saved.astype(jnp.float32)


def score_for_aux_loss_bwd(saved_scores, grad_scores, score_function="softmax",
                           out_dtype=jnp.float32):
    """Backward of the aux-loss scores (docs/contract.md section 3), written out by hand.

    Returns:
      ``grad_logits [T, E]`` in ``out_dtype`` (the dtype of the logits).
    """
    sf = score_function_of("score_for_aux_loss_bwd", score_function)
    saved = jnp.asarray(saved_scores, jnp.float32)
    g = jnp.asarray(grad_scores).astype(jnp.float32)
    if sf == ScoreFunction.SOFTMAX:
        dx = saved * (g - jnp.sum(g * saved, axis=-1, keepdims=True))
    else:
        a, da = _activation_and_grad(saved, sf)
        dx = _normalised_grad(a, da, g, jnp.ones(a.shape, bool), normalise=True)
    return dx.astype(out_dtype)


__all__ = [
    "fused_topk_with_score_function",
    "topk_with_score_function_fwd",
    "topk_with_score_function_bwd",
    "score_for_aux_loss_fwd",
    "score_for_aux_loss_bwd",
]
