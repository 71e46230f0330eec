"""A grouped GEMM built from batched dense GEMMs: ``jax.lax.ragged_dot``'s
result, without XLA's dense rewrite of a ragged dot.

On a GPU, XLA (jax 0.11) rewrites ``ragged_dot`` and its transposes into
dense dots over every group, masked: about ``G`` times the work and memory
of the grouped GEMM (docs/benchmarks.md measured 2.7 TFLOP/s on an H200 for
the MoE block's GEMMs, and out-of-memory at a DeepSeek-V3-like slice).
:func:`batched_ragged_dot` computes the same product as a few rounds of one
batched GEMM each, ``[G, C, K] @ [G, K, M]`` (the weights used in place,
never gathered): round 1 takes rows ``[0, C)`` of every group, each later
round the next ``C_tail = ceil(C / 4)`` rows, while any group has rows left.
A round gathers its rows from ``lhs`` (rows a group does not have read as
0) and scatters its results back. Its own backward does the same for
``d lhs = dy @ rhs^T`` (the forward with ``rhs`` transposed) and
``d rhs[g] = lhs_g^T dy_g`` (one batched GEMM a round, summed over rounds
in fp32).

Cost: ``G * (C + r * C_tail)`` rows are multiplied for ``r`` tail rounds,
``r = ceil((max_g n_g - C) / C_tail)``. With the default ``C`` (the mean
group size, ``ceil(N / G)`` rounded up to 8) and balanced groups that is
about 1.25-1.5 times the grouped GEMM's work; all rows in one group costs
about ``4 G`` rounds, as slow as the dense rewrite. The number of tail
rounds is a ``while`` loop bound by the data (one host-device round trip
of XLA's loop condition per round on a GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import check_batched_ragged_dot_args


def batched_ragged_dot(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
    precision=None,
    preferred_element_type=None,
    *,
    capacity: int | None = None,
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` on batched dense GEMMs.

    Args:
      lhs: ``[N, K]`` rows sorted by group: rows ``[s_g, s_g + n_g)`` belong to
        group ``g`` (``s_g`` the sum of the sizes before it).
      rhs: ``[G, K, M]``, one matrix per group.
      group_sizes: ``[G]`` integers ``n_g >= 0`` summing to at most ``N``.
      precision: as for ``jax.lax.dot_general``.
      preferred_element_type: the output dtype (default: ``lhs`` and ``rhs``
        promoted); the products accumulate in fp32 (float64 for float64).
      capacity: rows of every group in the first round (default: the mean
        group size ``ceil(N / G)`` rounded up to 8); later rounds take
        ``ceil(capacity / 4)``.

    Returns:
      ``[N, M]``: ``out[i] = lhs[i] @ rhs[g(i)]``; rows at or past
      ``sum(group_sizes)`` are 0. Differentiable in ``lhs`` and ``rhs``.

    >>> import jax.numpy as jnp
    >>> lhs = jnp.arange(8.0).reshape(4, 2)
    >>> rhs = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
    >>> batched_ragged_dot(lhs, rhs, jnp.array([1, 2])).tolist()
    [[0.0, 1.0], [4.0, 6.0], [8.0, 10.0], [0.0, 0.0]]
    """
    n, _, g, _ = check_batched_ragged_dot_args(lhs, rhs, group_sizes, capacity)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    mean = -(-n // g)
    first = capacity if capacity is not None else max(8, (mean + 7) // 8 * 8)
    rounds = (first, max(1, -(-first // 4)))
    return _batched(lhs, rhs, jnp.asarray(group_sizes).astype(jnp.int32), rounds, out_dtype, precision)


def _accumulation(*dtypes):
    return jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes) else jnp.float32


def _round_rows(sizes, offset, width: int, num_rows: int):
    """``[G, width]`` row indices of rows ``[offset, offset + width)`` of every
    group; ``num_rows`` (out of range) where a group has no such row."""
    starts = jnp.cumsum(sizes) - sizes
    local = offset + jnp.arange(width, dtype=jnp.int32)
    return jnp.where(local[None, :] < sizes[:, None], starts[:, None] + local[None, :], num_rows)


def _over_rounds(sizes, rounds: tuple[int, int], num_rows: int, step, state):
    """``state`` through ``step(state, rows [G, width])`` for the first round
    and then every tail round while a group has rows left."""
    first, tail = rounds
    state = step(state, _round_rows(sizes, 0, first, num_rows))
    num_tail = jnp.maximum(jnp.max(sizes) - first + tail - 1, 0) // tail
    return lax.fori_loop(0, num_tail, lambda r, s: step(s, _round_rows(sizes, first + r * tail, tail, num_rows)),
                         state)


def _take_rows(x, rows):
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def _product(lhs, rhs, sizes, rounds, out_dtype, precision):
    n, m = lhs.shape[0], rhs.shape[2]
    acc = _accumulation(lhs.dtype, rhs.dtype)

    def step(out, rows):
        y = jnp.einsum("gck,gkm->gcm", _take_rows(lhs, rows), rhs, precision=precision, preferred_element_type=acc)
        return out.at[rows.reshape(-1)].set(y.reshape(-1, m).astype(out_dtype), mode="drop")

    return _over_rounds(sizes, rounds, n, step, jnp.zeros((n, m), out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _batched(lhs, rhs, sizes, rounds, out_dtype, precision):
    return _product(lhs, rhs, sizes, rounds, out_dtype, precision)


def _batched_fwd(lhs, rhs, sizes, rounds, out_dtype, precision):
    return _product(lhs, rhs, sizes, rounds, out_dtype, precision), (lhs, rhs, sizes)


def _batched_bwd(rounds, out_dtype, precision, res, dy):
    lhs, rhs, sizes = res
    d_lhs = _product(dy, jnp.swapaxes(rhs, 1, 2), sizes, rounds, lhs.dtype, precision)
    acc = _accumulation(lhs.dtype, rhs.dtype, dy.dtype)

    def step(d_rhs, rows):
        return d_rhs + jnp.einsum("gck,gcm->gkm", _take_rows(lhs, rows), _take_rows(dy, rows), precision=precision,
                                  preferred_element_type=acc)

    d_rhs = _over_rounds(sizes, rounds, lhs.shape[0], step, jnp.zeros(rhs.shape, acc))
    return d_lhs, d_rhs.astype(rhs.dtype), None


_batched.defvjp(_batched_fwd, _batched_bwd)

__all__ = ["batched_ragged_dot"]
