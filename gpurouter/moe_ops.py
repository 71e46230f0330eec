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
default) runs the kernels where they measured faster than the reference
(``gpurouter/_auto.py``: on a CUDA GPU with a device transport, from 2^23
elements of the op's rows, the dispatch from 2^27), the reference elsewhere.
The backend is checked before the arguments; the arguments are checked at trace
time, with the reference's messages, on every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _backend
from ._auto import moe_kernels_faster
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


def _numba(op: str, backend: str, transport: str, rows: int | None, *arrays, maps=None) -> bool:
    """True when ``op`` runs on the kernels: ``backend`` and ``transport``
    checked; ``"auto"`` where they measured faster (``_auto.moe_kernels_faster``)
    for ``rows`` (None: the last array's) x hidden (the last array's last
    axis) elements, ``arrays``' dtypes and the E of ``maps`` = ``(index_map,
    probs or None)``. Anything that is not a concrete, well-formed call (a
    list, a traced size, a wrong rank) stays on the reference, whose checks
    say what is wrong."""
    check_moe_kernel_backend(op, backend)
    check_transport(op, transport)

    def faster() -> bool:
        if not all(isinstance(a, jax.Array | np.ndarray) for a in arrays) or jnp.ndim(arrays[-1]) < 1:
            return False
        n = arrays[-1].shape[0] if rows is None else rows
        if not isinstance(n, int | np.integer):
            return False
        experts = None if maps is None else _experts(*maps)
        return moe_kernels_faster(op, transport, int(n) * arrays[-1].shape[-1], [a.dtype for a in arrays], experts)

    return _backend.resolve(op, backend, faster=faster) == "numba"


def _experts(index_map, probs) -> int:
    """E of a ``[T, E]`` map (a packed BITMAP_U8 map: ``probs``' E), -1 where not known."""
    if isinstance(probs, jax.Array | np.ndarray) and probs.ndim == 2:
        return probs.shape[1]
    if isinstance(index_map, jax.Array | np.ndarray) and index_map.ndim == 2 and index_map.dtype != np.uint8:
        return index_map.shape[1]
    return -1


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
        ``"auto"`` (the kernels where they measured faster, ``gpurouter/_auto.py``).
      transport: how the kernels reach JAX (``"auto"``, ``"callback"``,
        ``"zero-copy"``, ``"ffi"``), as for the router ops.
    """
    if not _numba(GROUPED_DBIAS_DSCALES_OP, backend, transport, None,
                  *[a for a in (scales, bias, dbias, dscales) if a is not None], dy):
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
      backend: ``"jax"``, ``"numba"`` (the dbias/dscales kernels without scales)
        or ``"auto"`` (the measured rule, ``gpurouter/_auto.py``).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not _numba(GROUPED_DBIAS_OP, backend, transport, None, *([] if dbias is None else [dbias]), dy):
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
        :func:`compute_grouped_dbias_dscales` kernels) or ``"auto"`` (the measured rule, ``gpurouter/_auto.py``).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not _numba(SCALED_BIAS_ADD_OP, backend, transport, None, bias, scales, y):
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
        ``"auto"`` (the measured rule, ``gpurouter/_auto.py``: from 2^27 output row elements).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not _numba(TOKEN_DISPATCH_OP, backend, transport, num_out_tokens, *([] if probs is None else [probs]), inp,
                  maps=(routing_map, probs)):
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
        ``d_inp`` and ``d_merging_probs`` in one pass) or ``"auto"`` (the measured rule, ``gpurouter/_auto.py``).
      transport: as for :func:`compute_grouped_dbias_dscales`.
    """
    if not _numba(TOKEN_COMBINE_OP, backend, transport, None, *([] if merging_probs is None else [merging_probs]),
                  inp, maps=(row_id_map, None)):
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
