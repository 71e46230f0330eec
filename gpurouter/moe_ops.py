"""Public token-level MoE ops: grouped bias gradients, the grouped scaled bias
add, token dispatch and combine (docs/ops/moe_ops.md).

Each op takes the arguments of its pure-jnp reference in
:mod:`gpurouter.reference.moe_ops` (same name, same signature) plus the
keyword-only ``backend``: ``"auto"`` (the default) and ``"jax"`` run the
reference; ``"numba"`` raises ``NotImplementedError`` (these ops have no
kernels yet). The backend is checked before the arguments; the arguments are
checked at trace time by the reference, with the same messages.
"""

from __future__ import annotations

import jax

from ._checks import (
    GROUPED_DBIAS_DSCALES_OP,
    GROUPED_DBIAS_OP,
    SCALED_BIAS_ADD_OP,
    TOKEN_COMBINE_OP,
    TOKEN_DISPATCH_OP,
    check_moe_backend,
)
from .reference import moe_ops as _ref


def compute_grouped_dbias_dscales(
    dy: jax.typing.ArrayLike,
    scales: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike,
    offsets: jax.typing.ArrayLike,
    dbias: jax.typing.ArrayLike | None = None,
    dscales: jax.typing.ArrayLike | None = None,
    *,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """``(dbias [G, H] float32, dscales [N] float32)`` of a per-row-scaled grouped bias.

    TE PR #2864's ``compute_grouped_dbias_dscales``, deterministic: see
    :func:`gpurouter.reference.moe_ops.compute_grouped_dbias_dscales` for
    the arguments, the algorithm and the differences from TE.

    Args:
      backend: ``"auto"`` or ``"jax"`` (the reference); ``"numba"`` raises
        ``NotImplementedError`` (no kernel yet).
    """
    check_moe_backend(GROUPED_DBIAS_DSCALES_OP, backend)
    return _ref.compute_grouped_dbias_dscales(dy, scales, bias, offsets, dbias, dscales)


def compute_grouped_dbias(
    dy: jax.typing.ArrayLike,
    offsets: jax.typing.ArrayLike,
    num_groups: int,
    dbias: jax.typing.ArrayLike | None = None,
    *,
    backend: str = "auto",
) -> jax.Array:
    """``dbias [G, H] float32``: ``dy`` summed per group of rows, deterministic.

    See :func:`gpurouter.reference.moe_ops.compute_grouped_dbias`.

    Args:
      backend: ``"auto"`` or ``"jax"``; ``"numba"`` raises ``NotImplementedError``.
    """
    check_moe_backend(GROUPED_DBIAS_OP, backend)
    return _ref.compute_grouped_dbias(dy, offsets, num_groups, dbias)


def grouped_scaled_bias_add(
    y: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike,
    scales: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
    *,
    backend: str = "auto",
) -> jax.Array:
    """``y + bias[g(i)] * scales[i]`` (fp32 math, ``y.dtype`` out), differentiable.

    See :func:`gpurouter.reference.moe_ops.grouped_scaled_bias_add`; the
    backward is :func:`compute_grouped_dbias_dscales`.

    Args:
      backend: ``"auto"`` or ``"jax"``; ``"numba"`` raises ``NotImplementedError``.
    """
    check_moe_backend(SCALED_BIAS_ADD_OP, backend)
    return _ref.grouped_scaled_bias_add(y, bias, scales, group_sizes)


def token_dispatch(
    inp: jax.typing.ArrayLike,
    routing_map: jax.typing.ArrayLike,
    num_out_tokens: int,
    probs: jax.typing.ArrayLike | None = None,
    align_size: int | None = None,
    *,
    num_experts: int | None = None,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array | None, jax.Array]:
    """Tokens to expert-major rows; drop-in for TE's ``permutation.token_dispatch``.

    Returns ``(output, permuted_probs, row_id_map, pad_offsets,
    tokens_per_expert)``; see :func:`gpurouter.reference.moe_ops.token_dispatch`
    (``row_id_map`` is ``int32 [T, E]``, the padded output row or -1).

    Args:
      num_experts: ``E`` for a BITMAP_U8 ``routing_map`` without ``probs``.
      backend: ``"auto"`` or ``"jax"``; ``"numba"`` raises ``NotImplementedError``.
    """
    check_moe_backend(TOKEN_DISPATCH_OP, backend)
    return _ref.token_dispatch(inp, routing_map, num_out_tokens, probs, align_size,
                               num_experts=num_experts)


def token_combine(
    inp: jax.typing.ArrayLike,
    row_id_map: jax.typing.ArrayLike,
    merging_probs: jax.typing.ArrayLike | None = None,
    pad_offsets: jax.typing.ArrayLike | None = None,
    *,
    backend: str = "auto",
) -> jax.Array:
    """Expert rows back to ``[T, H]`` tokens, prob-weighted; drop-in for TE's ``token_combine``.

    See :func:`gpurouter.reference.moe_ops.token_combine`.

    Args:
      backend: ``"auto"`` or ``"jax"``; ``"numba"`` raises ``NotImplementedError``.
    """
    check_moe_backend(TOKEN_COMBINE_OP, backend)
    return _ref.token_combine(inp, row_id_map, merging_probs, pad_offsets)


__all__ = [
    "compute_grouped_dbias",
    "compute_grouped_dbias_dscales",
    "grouped_scaled_bias_add",
    "token_combine",
    "token_dispatch",
]
