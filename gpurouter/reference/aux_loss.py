"""Pure-jnp reference of the switch load-balancing aux loss (docs/contract.md section 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import AuxLossConfig, array_meta, check_aux_loss_args, check_token_mask
from .._host import aux_loss_coeff as host_coeff


def aux_loss_coeff(num_experts, coeff, topk, total_num_tokens) -> jax.Array:
    """``C = num_experts * coeff / (topk * T * T)`` in float32, divided in TE's order.

    With Python numbers the chain runs on the host (``gpurouter._host``, the
    kernels' own computation, bit for bit). ``total_num_tokens`` may also be a
    traced scalar; then the same float32 operations run in the graph.
    """
    if isinstance(total_num_tokens, (int, np.integer)):
        return jnp.asarray(host_coeff(num_experts, coeff, topk, total_num_tokens), jnp.float32)
    f32 = np.float32
    c = f32(f32(num_experts) * f32(coeff)) / f32(topk)
    t = jnp.asarray(total_num_tokens).astype(jnp.float32)
    return (jnp.float32(c) / t) / t


def global_counts(op, probs, tokens_per_expert, total_num_tokens, axis_name):
    """``(tokens_per_expert, total_num_tokens)`` at the global level.

    With ``axis_name`` (inside ``shard_map``/``vmap``/``pmap`` over it) the
    counts are all-reduced over that axis, and the token count defaults to
    the local row count times the number of shards (static: every shard has
    the same shape); each shard's loss is then its share of the global loss.
    Without it they are returned as given. Either way the two arrays are
    checked to be arrays first (a list is a ``TypeError`` naming it).
    """
    array_meta(op, "probs", probs)
    array_meta(op, "tokens_per_expert", tokens_per_expert)
    if axis_name is None:
        return tokens_per_expert, total_num_tokens
    from .._sharding import axis_size

    shards = axis_size(op, axis_name)
    if total_num_tokens is None:
        total_num_tokens = jnp.shape(probs)[0] * shards
    return jax.lax.psum(jnp.asarray(tokens_per_expert), axis_name), total_num_tokens


def checked_mask(op, rows, token_mask, total_num_tokens, axis_name, name="probs"):
    """``(mask bool [T], total_num_tokens)`` of a checked ``token_mask`` (not
    None) for ``rows [..., C]`` (``name``: how errors call them), ``T``
    defaulting to ``max(valid count, 1)`` (global over ``axis_name``; contract
    section 10). The numba backend gives the mask to its kernels as it is."""
    from .variants import flat_token_mask, valid_count

    shape, _ = array_meta(op, name, rows)
    check_token_mask(op, token_mask, tuple(shape[:-1]))
    if axis_name is not None:
        from .._sharding import axis_size

        axis_size(op, axis_name)  # checks that the axis is bound
    mask = flat_token_mask(token_mask, int(np.prod(shape[:-1], dtype=np.int64)))
    if total_num_tokens is None:
        total_num_tokens = valid_count(mask, axis_name)
    return mask, total_num_tokens


def mask_rows(op, rows, token_mask, total_num_tokens, axis_name, fill):
    """``(rows, total_num_tokens)`` with the masked rows of ``rows [T, C]`` set
    to ``fill`` and ``T`` defaulting to ``max(valid count, 1)`` (global over
    ``axis_name``; contract section 10). Without a mask: as given."""
    if token_mask is None:
        return rows, total_num_tokens
    shape, _ = array_meta(op, "probs" if fill == 0 else "logits", rows)
    mask, total_num_tokens = checked_mask(op, rows, token_mask, total_num_tokens, axis_name,
                                          "probs" if fill == 0 else "logits")
    rows = jnp.asarray(rows)
    rows = jnp.where(mask.reshape(shape[:-1] + (1,)), rows, jnp.asarray(fill, rows.dtype))
    return rows, total_num_tokens


def _config(probs, tokens_per_expert, topk, coeff, total_num_tokens, num_experts, op):
    return check_aux_loss_args(
        *array_meta(op, "probs", probs), *array_meta(op, "tokens_per_expert", tokens_per_expert),
        topk, coeff, total_num_tokens, num_experts, op=op,
    )


def _loss(probs, tokens_per_expert, cfg: AuxLossConfig) -> jax.Array:
    column_sums = jnp.sum(probs.astype(jnp.float32), axis=0)  # [C]
    tpe = jax.lax.stop_gradient(jnp.asarray(tokens_per_expert).astype(jnp.float32))
    c = aux_loss_coeff(cfg.num_experts, cfg.coeff, cfg.topk, cfg.total_num_tokens)
    return c * jnp.sum(column_sums * tpe)


def fused_moe_aux_loss(
    probs: jax.typing.ArrayLike,
    tokens_per_expert: jax.typing.ArrayLike,
    topk: int,
    coeff: float,
    *,
    total_num_tokens: int | jax.typing.ArrayLike | None = None,
    num_experts: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    token_mask: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Switch load-balancing aux loss (pure-jnp reference).

    ``loss = C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c]`` with
    ``C = num_experts * coeff / (topk * T * T)`` and ``T = total_num_tokens``,
    all in float32.

    Args:
      probs: ``[T, C]`` float32, bfloat16 or float16 router scores;
        ``C % num_experts == 0`` (``C = B * E`` for a sequence aux loss).
      tokens_per_expert: ``[C]`` int32, int64, float32 or bfloat16 counts; no
        gradient flows to them.
      topk: experts per token.
      coeff: the loss coefficient.
      total_num_tokens: ``T`` in ``C``; defaults to ``probs.shape[0]``. Under
        token sharding pass the GLOBAL count together with global counts.
      num_experts: ``E``; defaults to ``probs.shape[1]``.
      axis_name: a mesh axis name (or tuple) to use inside ``shard_map`` with
        token-sharded ``probs``: ``tokens_per_expert`` is all-reduced over it
        and ``total_num_tokens`` defaults to the global count, so that the
        psum of the per-shard losses is the unsharded loss (docs/sharding.md).
      token_mask: bool ``[T]``, the valid rows (docs/contract.md section
        10): masked rows are left out of the column sums and get a zero
        gradient, and ``total_num_tokens`` defaults to ``max(valid count,
        1)`` (summed over ``axis_name``). Pass the masked counts as
        ``tokens_per_expert`` (``gr.tokens_per_expert(map, token_mask=)``).

    ``total_num_tokens`` may be a traced scalar (no retrace per value).

    Returns:
      A scalar in the dtype of ``probs`` (with ``axis_name``: this shard's
      share of the global loss).

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter import reference as ref
      >>> probs = jnp.full((4, 2), 0.5)
      >>> float(ref.fused_moe_aux_loss(probs, jnp.array([3, 1]), topk=1, coeff=1.0))
      1.0
    """
    probs, total_num_tokens = mask_rows("fused_moe_aux_loss", probs, token_mask, total_num_tokens, axis_name, 0)
    tokens_per_expert, total_num_tokens = global_counts(
        "fused_moe_aux_loss", probs, tokens_per_expert, total_num_tokens, axis_name)
    cfg = _config(probs, tokens_per_expert, topk, coeff, total_num_tokens, num_experts,
                  "fused_moe_aux_loss")
    probs = jnp.asarray(probs)
    return _loss(probs, tokens_per_expert, cfg).astype(probs.dtype)


def moe_aux_loss_fwd(probs, tokens_per_expert, topk, coeff, total_num_tokens=None,
                     num_experts=None):
    """Forward: ``(loss () dtype of probs, saved_coeff () float32)``."""
    cfg = _config(probs, tokens_per_expert, topk, coeff, total_num_tokens, num_experts,
                  "moe_aux_loss_fwd")
    probs = jnp.asarray(probs)
    c = aux_loss_coeff(cfg.num_experts, cfg.coeff, cfg.topk, cfg.total_num_tokens)
    return _loss(probs, tokens_per_expert, cfg).astype(probs.dtype), c


def moe_aux_loss_bwd(saved_coeff, tokens_per_expert, grad_loss, num_rows):
    """Backward: ``grad_probs[r, c] = C * tokens_per_expert[c] * grad_loss``.

    Returns:
      ``grad_probs [num_rows, C]`` in the dtype of ``grad_loss``.
    """
    grad_loss = jnp.asarray(grad_loss)
    tpe = jnp.asarray(tokens_per_expert).astype(jnp.float32)
    row = jnp.asarray(saved_coeff, jnp.float32) * tpe * grad_loss.astype(jnp.float32)
    return jnp.broadcast_to(row, (num_rows, tpe.shape[0])).astype(grad_loss.dtype)


__all__ = ["fused_moe_aux_loss", "moe_aux_loss_fwd", "moe_aux_loss_bwd", "aux_loss_coeff", "mask_rows"]
