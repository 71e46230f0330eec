"""Pure-jnp reference of the router z-loss (ST-MoE) and of DeepSeek-V3's
aux-loss-free expert-bias update. docs/losses.md says what is normalised by
what, and what is reduced over which mesh axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import (
    BIAS_UPDATE_OP,
    Z_LOSS_OP,
    array_meta,
    check_bias_update_args,
    check_token_mask,
    check_z_loss_args,
)
from .._sharding import axis_size
from .aux_loss import mask_rows


def _row_lse(x: jax.Array) -> jax.Array:
    """``logsumexp`` of each row of ``x [T, E]`` (float32), 0 for an all ``-inf`` row.

    A row whose every expert is masked (-inf) routes nowhere: it adds nothing
    to the z-loss and gets no gradient (its ``logsumexp`` is ``-inf``, whose
    square would be ``inf``). Rows with a NaN give NaN.
    """
    m = jnp.max(x, axis=-1, keepdims=True)
    dead = m == -jnp.inf
    shift = jnp.where(dead, 0.0, jax.lax.stop_gradient(m))
    total = jnp.sum(jnp.exp(x - shift), axis=-1, keepdims=True)
    lse = jnp.log(jnp.where(dead, 1.0, total)) + shift
    return jnp.where(dead, 0.0, lse)[..., 0]


def router_z_loss(
    logits: jax.typing.ArrayLike,
    coeff: float,
    *,
    total_num_tokens: int | jax.typing.ArrayLike | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    token_mask: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Router z-loss of ST-MoE (Zoph et al. 2022, eq. 5), pure-jnp reference.

    ``loss = coeff * (1 / T) * sum_t logsumexp_e(logits[t])^2``, in float32
    whatever the dtype of ``logits``.

    Args:
      logits: ``[..., E]`` float32, bfloat16 or float16 router logits; every
        leading dim is a token (``T`` = their product). ``-inf`` masks an
        expert; a row of all ``-inf`` contributes 0 (and gets no gradient)
        but still counts in ``T``.
      coeff: the loss coefficient (a static Python float; ST-MoE uses 1e-3).
      total_num_tokens: ``T``, a static int >= 1; defaults to the rows of
        ``logits`` (times the axis size with ``axis_name``). Pass the tokens of
        all micro-batches of a step to accumulate shares (docs/losses.md).
      axis_name: inside ``shard_map`` with token-sharded ``logits``: ``T``
        defaults to the global token count (this shard's rows times the axis
        size), so each shard returns its share and the shares sum (``psum``)
        to the loss of the whole batch.
      token_mask: bool, the tokens' shape (or flat ``[T]``): masked tokens
        contribute 0 and get a zero gradient, and ``T`` defaults to
        ``max(valid count, 1)``, summed over ``axis_name`` (docs/contract.md
        section 10).

    ``total_num_tokens`` may also be a traced scalar (no retrace per value).

    Returns:
      A float32 scalar.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter import reference as ref
      >>> round(float(ref.router_z_loss(jnp.zeros((2, 4)), 1.0)), 4)  # log(4)^2
      1.9218
    """
    shape, dtype = array_meta(Z_LOSS_OP, "logits", logits)
    logits, total_num_tokens = mask_rows(Z_LOSS_OP, logits, token_mask, total_num_tokens, axis_name, -jnp.inf)
    coeff, total = check_z_loss_args(shape, dtype, coeff, total_num_tokens,
                                     axis_size(Z_LOSS_OP, axis_name))
    x = jnp.asarray(logits).astype(jnp.float32)
    x = x.reshape(-1, x.shape[-1])
    lse = _row_lse(x)
    return jnp.float32(coeff) * (jnp.sum(lse * lse) / jnp.asarray(total).astype(jnp.float32))


def update_expert_bias(
    expert_bias: jax.typing.ArrayLike,
    tokens_per_expert: jax.typing.ArrayLike,
    rate: float | jax.typing.ArrayLike,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    token_mask: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """DeepSeek-V3's aux-loss-free balancing step: the expert bias, updated.

    ``new_bias = expert_bias + rate * sign(mean(load) - load)`` with ``load``
    the tokens routed to each expert (DeepSeek-V3 technical report, section
    2.1.2: an overloaded expert's bias goes down by ``rate``, an underloaded
    one's up; an expert exactly at the mean keeps its bias). Pure jnp, no
    gradient: call it outside the differentiated function, once per step.

    Args:
      expert_bias: ``[E]`` float bias (the router's ``expert_bias``).
      tokens_per_expert: ``[E]`` int or float counts of this step
        (e.g. :func:`gpurouter.tokens_per_expert` of the routing map).
      rate: the update speed (DeepSeek-V3: 0.001); a Python float or a scalar
        array (a schedule).
      axis_name: inside ``shard_map`` over data shards: the counts are summed
        over this axis first, so every shard computes the same new bias.
      token_mask: bool, the valid tokens (docs/contract.md section 10). With
        it, ``tokens_per_expert`` is the routing map itself (bool ``[..., E]``
        or BITMAP_U8) and the counts are its valid rows'
        (:func:`gpurouter.tokens_per_expert` with the mask): padding moves
        no bias.

    Returns:
      ``[E]``, the dtype of ``expert_bias`` (the arithmetic is float32).

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter import reference as ref
      >>> ref.update_expert_bias(jnp.zeros(3), jnp.array([5, 1, 3]), 0.1).tolist()
      [-0.10000000149011612, 0.10000000149011612, 0.0]
    """
    bias_meta = array_meta(BIAS_UPDATE_OP, "expert_bias", expert_bias)
    if token_mask is not None:
        tokens_per_expert = masked_counts(BIAS_UPDATE_OP, tokens_per_expert, bias_meta[0], token_mask)
    counts_meta = array_meta(BIAS_UPDATE_OP, "tokens_per_expert", tokens_per_expert)
    check_bias_update_args(*bias_meta, *counts_meta, rate)
    load = jnp.asarray(tokens_per_expert)
    load = load.astype(jnp.int32 if jnp.issubdtype(load.dtype, jnp.integer) else jnp.float32)
    if axis_name is not None:
        axis_size(BIAS_UPDATE_OP, axis_name)  # checks that the axis is bound
        load = jax.lax.psum(load, axis_name)
    bias = jnp.asarray(expert_bias)
    step = jnp.asarray(rate, jnp.float32) * _sign_of_mean_minus(load).astype(jnp.float32)
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)


def masked_counts(op, routing_map, bias_shape, token_mask) -> jax.Array:
    """The counts of a routing map's valid rows, for ``update_expert_bias``
    with a ``token_mask`` (its ``tokens_per_expert`` is then the map)."""
    from .routing_map import tokens_per_expert

    shape, dtype = array_meta(op, "tokens_per_expert", routing_map)
    if len(bias_shape) != 1 or np.dtype(dtype).name not in ("bool", "uint8") or len(shape) < 2:
        raise ValueError(f"{op}: tokens_per_expert (shape {tuple(shape)}, {np.dtype(dtype).name}) must be "
                         "a routing map (bool [..., num_experts] or uint8 BITMAP_U8) with token_mask.")
    check_token_mask(op, token_mask, tuple(shape[:-1]))
    return tokens_per_expert(routing_map, bias_shape[0], token_mask=token_mask)


def _sign_of_mean_minus(load: jax.Array) -> jax.Array:
    """``sign(mean(load) - load)`` (int32 or float32 ``load``) without rounding
    the mean: a float32 mean is a sum times ``1/E`` under XLA, so an expert
    exactly at the mean (60 tokens over 15 experts, 4 each) could read as
    below it and move. int32 counts compare with ``total // E`` and the
    remainder (exact while the total fits int32); float counts compare
    ``total`` with ``E * load``."""
    num_experts = load.shape[-1]
    total = jnp.sum(load)
    if load.dtype != jnp.int32:
        return jnp.sign(total - num_experts * load)
    quotient, remainder = total // num_experts, total % num_experts
    # at the quotient, the mean (quotient + remainder / E) is above or equal
    return jnp.where(load < quotient, 1, jnp.where(load > quotient, -1, jnp.sign(remainder)))


__all__ = ["router_z_loss", "update_expert_bias"]
