"""Public token-level MoE ops: grouped bias gradients, the grouped scaled bias
add, token dispatch and combine (docs/ops/moe_ops.md).

Each op takes the arguments of its pure-jnp reference in
:mod:`gpurouter.reference.moe_ops` (same name, same signature) plus the
keyword-only ``backend`` and ``transport``: ``"jax"`` runs the reference;
``"numba"`` the Numba kernels (``gpurouter/kernels/moe_*.py``, bound in
``gpurouter/_ops/moe_ops.py``) through ``transport`` (as for the router ops):
``compute_grouped_dbias_dscales`` and ``compute_grouped_dbias`` (one kernel
family, deterministic), ``grouped_scaled_bias_add`` (its backward on those
kernels, its elementwise forward in jnp), ``token_combine`` (forward, and a
backward giving ``d_inp`` and ``d_merging_probs`` in one pass) and
``token_dispatch`` (its integer index maps in jnp, the row copy and the
backward's fp32 sum of the K copies on the kernels). ``"auto"`` (the
default) runs the reference: the kernels have no GPU measurement against it
yet (``tools/moe_bench.py``). The backend is checked before the arguments; the arguments are checked at trace
time, with the reference's messages, on every backend.
"""

from __future__ import annotations

import jax

from . import _backend
from ._checks import (
    GROUPED_DBIAS_DSCALES_OP,
    GROUPED_DBIAS_OP,
    SCALED_BIAS_ADD_OP,
    TOKEN_COMBINE_OP,
    TOKEN_DISPATCH_OP,
    check_grouped_dbias_args,
    check_grouped_dbias_dscales_args,
    check_moe_kernel_backend,
    check_scaled_bias_add_args,
    check_token_combine_args,
    check_token_dispatch_args,
    check_transport,
)
from .reference import moe_ops as _ref


def _numba(op: str, backend: str, transport: str) -> bool:
    """True when ``op`` runs on the kernels: ``backend`` and ``transport``
    checked, ``"auto"`` the reference (no GPU measurement yet)."""
    check_moe_kernel_backend(op, backend)
    check_transport(op, transport)
    return _backend.resolve(op, backend) == "numba"


def _kernels():
    from ._ops import moe_ops

    return moe_ops


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
    :func:`gpurouter.reference.moe_ops.compute_grouped_dbias_dscales` for
    the arguments, the algorithm and the differences from TE.

    Args:
      backend: ``"jax"`` (the reference), ``"numba"`` (the kernels: row chunks
        with per-group fp32 sums, no atomics, bit-identical run to run) or
        ``"auto"`` (jax).
      transport: how the kernels reach JAX (``"auto"``, ``"callback"``,
        ``"zero-copy"``, ``"ffi"``), as for the router ops.
    """
    if not _numba(GROUPED_DBIAS_DSCALES_OP, backend, transport):
        return _ref.compute_grouped_dbias_dscales(dy, scales, bias, offsets, dbias, dscales)
    check_grouped_dbias_dscales_args(dy, scales, bias, offsets, dbias, dscales)
    return _kernels().grouped_dbias_dscales(dy, scales, bias, offsets, dbias, dscales, transport)


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

    See :func:`gpurouter.reference.moe_ops.compute_grouped_dbias`.

    Args:
      backend: ``"jax"``, ``"numba"`` (the dbias/dscales kernels without scales) or ``"auto"`` (jax).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not _numba(GROUPED_DBIAS_OP, backend, transport):
        return _ref.compute_grouped_dbias(dy, offsets, num_groups, dbias)
    _, _, g = check_grouped_dbias_args(dy, offsets, num_groups, dbias)
    return _kernels().grouped_dbias(dy, offsets, g, dbias, transport)


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

    See :func:`gpurouter.reference.moe_ops.grouped_scaled_bias_add`; the
    backward is :func:`compute_grouped_dbias_dscales`.

    Args:
      backend: ``"jax"``, ``"numba"`` (jnp forward, the backward on the
        :func:`compute_grouped_dbias_dscales` kernels) or ``"auto"`` (jax).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not _numba(SCALED_BIAS_ADD_OP, backend, transport):
        return _ref.grouped_scaled_bias_add(y, bias, scales, group_sizes)
    check_scaled_bias_add_args(y, bias, scales, group_sizes)
    return _kernels().grouped_scaled_bias_add(y, bias, scales, group_sizes, transport)


def token_dispatch(
    inp: jax.typing.ArrayLike,
    routing_map: jax.typing.ArrayLike,
    num_out_tokens: int,
    probs: jax.typing.ArrayLike | None = None,
    align_size: int | None = None,
    *,
    num_experts: int | None = None,
    backend: str = "auto",
    transport: str = "auto",
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array | None, jax.Array]:
    """Tokens to expert-major rows; drop-in for TE's ``permutation.token_dispatch``.

    Returns ``(output, permuted_probs, row_id_map, pad_offsets,
    tokens_per_expert)``; see :func:`gpurouter.reference.moe_ops.token_dispatch`
    (``row_id_map`` is ``int32 [T, E]``, the padded output row or -1).

    Args:
      num_experts: ``E`` for a BITMAP_U8 ``routing_map`` without ``probs``.
      backend: ``"jax"``, ``"numba"`` (the index maps in jnp, the row copy on
        the kernels, the backward's K copies summed by the combine kernel) or
        ``"auto"`` (jax).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not _numba(TOKEN_DISPATCH_OP, backend, transport):
        return _ref.token_dispatch(inp, routing_map, num_out_tokens, probs, align_size,
                                   num_experts=num_experts)
    cfg = check_token_dispatch_args(inp, routing_map, num_out_tokens, probs, align_size, num_experts)
    return _kernels().token_dispatch(inp, routing_map, probs, cfg, transport)


def token_combine(
    inp: jax.typing.ArrayLike,
    row_id_map: jax.typing.ArrayLike,
    merging_probs: jax.typing.ArrayLike | None = None,
    pad_offsets: jax.typing.ArrayLike | None = None,
    *,
    backend: str = "auto",
    transport: str = "auto",
) -> jax.Array:
    """Expert rows back to ``[T, H]`` tokens, prob-weighted; drop-in for TE's ``token_combine``.

    See :func:`gpurouter.reference.moe_ops.token_combine`.

    Args:
      backend: ``"jax"``, ``"numba"`` (a block per token; the backward gives
        ``d_inp`` and ``d_merging_probs`` in one pass) or ``"auto"`` (jax).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not _numba(TOKEN_COMBINE_OP, backend, transport):
        return _ref.token_combine(inp, row_id_map, merging_probs, pad_offsets)
    check_token_combine_args(inp, row_id_map, merging_probs, pad_offsets)
    return _kernels().token_combine(inp, row_id_map, merging_probs, transport)


__all__ = [
    "compute_grouped_dbias",
    "compute_grouped_dbias_dscales",
    "grouped_scaled_bias_add",
    "token_combine",
    "token_dispatch",
]
