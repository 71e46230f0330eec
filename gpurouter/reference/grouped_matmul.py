"""A grouped GEMM built from batched dense GEMMs: ``jax.lax.ragged_dot``'s
result, without XLA's dense rewrite of a ragged dot. On a GPU, XLA (jax
0.11) rewrites ``ragged_dot`` and its transposes into dense dots over every
group, masked: about ``G`` times the work and memory of the grouped GEMM
(2.7 TFLOP/s on an H200 for the MoE block's GEMMs, and out of memory at a
DeepSeek-V3-like slice: lab/journal/benchmarks.md).
:func:`batched_ragged_dot` computes the same product as one batched GEMM,
``[G, C, K] @ [G, K, M]``, the weights used in place (never gathered): the
rows of every group are gathered into ``C`` slots (a group's missing rows
read as 0) and each output row is read back from its slot. ``C`` is the
smallest of a few static capacities (the mean group size ``N / G`` times
``FACTORS``: 1/8 to 3/4, then 1 to 1.5 in steps of 1/16, 1.75, 2, 3, 4;
rounded up to 8) that holds the largest group; a ``lax.switch`` on the group
sizes runs that one branch. When none holds a group, rounds follow (the
largest capacity, then the mean while rows are left; each round reads every
weight again: all rows in one group cost about ``4 G`` rounds, bounded memory).

The backward is its own, on the same slots of ``lhs`` and ``dy``:
``d lhs = dy @ rhs^T`` (read back like the output) and
``d rhs[g] = lhs_g^T dy_g``, one batched GEMM each (``d rhs`` summed over
rounds in fp32 when there are rounds).

Cost: ``G * C`` rows multiplied instead of ``N`` (``C``: 1.0-1.5 times the mean
for balanced groups); every GEMM reads all ``G`` weights once, a grouped GEMM's floor.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import check_batched_ragged_dot_args, check_tiled_ragged_dot_args


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
        promoted), written by the GEMMs, which accumulate in fp32 (XLA's
        GPU and CPU dots; float64 for float64).
      capacity: the base of the static capacities (default: the mean group
        size ``ceil(N / G)``); the batched GEMM gives every group the
        smallest of ``capacity`` times ``FACTORS`` (rounded up to a multiple
        of 8) that holds the largest group, else rounds.

    Returns:
      ``[N, M]``: ``out[i] = lhs[i] @ rhs[g(i)]``; rows at or past
      ``sum(group_sizes)`` are 0. Differentiable in ``lhs`` and ``rhs``.

    >>> import jax.numpy as jnp
    >>> lhs = jnp.arange(8.0).reshape(4, 2)
    >>> rhs = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
    >>> batched_ragged_dot(lhs, rhs, jnp.array([1, 2])).tolist()
    [[0.0, 1.0], [4.0, 6.0], [8.0, 10.0], [0.0, 0.0]]
    """
    n, _, g, m = check_batched_ragged_dot_args(lhs, rhs, group_sizes, capacity, precision, preferred_element_type)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    if n == 0:
        return jnp.zeros((0, m), out_dtype)
    first = capacity if capacity is not None else max(1, -(-n // g))
    return _batched(lhs, rhs, jnp.asarray(group_sizes).astype(jnp.int32), first, out_dtype, precision)


def _accumulation(*dtypes):
    return jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes) else jnp.float32


#: The single-round capacities, as multiples of the mean group size ``N / G``:
#: fine near 1, where balanced routing lands (moe-bench's random Qwen3-like
#: layer has its largest group at 1.18x the mean, its DeepSeek-V3-like slice
#: at 1.27x); below 1 for buffers mostly past the groups (the expert-parallel
#: block's receive buffer holds P times the rows it gets on average).
FACTORS = (0.125, 0.1875, 0.25, 0.375, 0.5, 0.75,
           1, 1.0625, 1.125, 1.1875, 1.25, 1.3125, 1.375, 1.4375, 1.5, 1.75, 2, 3, 4)


def _capacities(first: int) -> tuple[int, ...]:
    """The single-round capacities tried, smallest first: ``first`` times
    ``FACTORS``, each rounded up to a multiple of 8."""
    return tuple(sorted({-(-math.ceil(first * f) // 8) * 8 for f in FACTORS}))


def _round_rows(sizes, offset, width: int, num_rows: int):
    """``[G, width]`` row indices of rows ``[offset, offset + width)`` of every
    group; ``num_rows`` (out of range) where a group has no such row."""
    starts = jnp.cumsum(sizes) - sizes
    local = offset + jnp.arange(width, dtype=jnp.int32)
    return jnp.where(local[None, :] < sizes[:, None], starts[:, None] + local[None, :], num_rows)


def _take_rows(x, rows):
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def _by_capacity(sizes, first: int, num_rows: int, one_round, rounds):
    """``one_round(width)`` for the smallest capacity of :func:`_capacities`
    that holds every group (``lax.switch``: one branch runs), else
    ``rounds(first_width, tail_width)``: the largest capacity, then rounds of
    ``first`` rows while a group has rows left."""
    caps = _capacities(first)
    branch = jnp.sum(jnp.max(sizes) > jnp.asarray(caps, sizes.dtype))
    return lax.switch(branch, [functools.partial(one_round, c) for c in caps]
                      + [functools.partial(rounds, caps[-1], first)])


def _over_rounds(sizes, first: int, tail: int, num_rows: int, step, state):
    """``state`` through ``step(state, rows [G, width])`` for rows ``[0, first)``
    of every group, then ``tail`` rows a round while a group has rows left."""
    state = step(state, _round_rows(sizes, 0, first, num_rows))
    num_tail = jnp.maximum(jnp.max(sizes) - first + tail - 1, 0) // tail
    return lax.fori_loop(0, num_tail, lambda r, s: step(s, _round_rows(sizes, first + r * tail, tail, num_rows)),
                         state)


def _read_back(slots, sizes, width: int, num_rows: int, capped: bool = False):
    """Rows ``[num_rows, D]`` from a round's ``slots [G * width, D]``: row ``i``
    of group ``g`` from slot ``g * width + (i - s_g)``; 0 past the groups
    (``capped``: also 0 for a group's rows past its ``width`` slots)."""
    i = jnp.arange(num_rows, dtype=jnp.int32)
    ends = jnp.cumsum(sizes)
    g = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
    last = sizes.shape[0] - 1
    local = i - (ends - sizes)[jnp.minimum(g, last)]
    inside = (g <= last) & (local < width) if capped else g <= last
    slot = jnp.where(inside, g * width + local, slots.shape[0])
    return jnp.take(slots, slot, axis=0, mode="fill", fill_value=0)


def _product(lhs, rhs, sizes, first, out_dtype, precision):
    """``out[i] = lhs[i] @ rhs[g(i)]`` (0 past the groups' rows)."""
    n, m = lhs.shape[0], rhs.shape[2]

    def matmul(rows):  # out_dtype straight from the GEMM (which accumulates in fp32 at least)
        return jnp.einsum("gck,gkm->gcm", _take_rows(lhs, rows), rhs, precision=precision,
                          preferred_element_type=out_dtype).reshape(-1, m)

    def one_round(width):  # every group in one batched GEMM
        return _read_back(matmul(_round_rows(sizes, 0, width, n)), sizes, width, n)

    def rounds(width, tail):
        def step(out, rows):
            return out.at[rows.reshape(-1)].set(matmul(rows), mode="drop")
        return _over_rounds(sizes, width, tail, n, step, jnp.zeros((n, m), out_dtype))

    return _by_capacity(sizes, first, n, one_round, rounds)


def _grads(lhs, rhs, sizes, dy, first, precision):
    """``(d lhs, d rhs)``: ``d lhs[i] = dy[i] @ rhs[g(i)]^T`` and
    ``d rhs[g] = lhs_g^T dy_g``, from the same slots of ``lhs`` and ``dy``."""
    n, k = lhs.shape

    def matmuls(rows, rhs_dtype):
        x, d = _take_rows(lhs, rows), _take_rows(dy, rows)
        d_x = jnp.einsum("gcm,gkm->gck", d, rhs, precision=precision, preferred_element_type=lhs.dtype)
        d_w = jnp.einsum("gck,gcm->gkm", x, d, precision=precision, preferred_element_type=rhs_dtype)
        return d_x.reshape(-1, k), d_w

    def one_round(width):
        d_x, d_w = matmuls(_round_rows(sizes, 0, width, n), rhs.dtype)
        return _read_back(d_x, sizes, width, n), d_w

    def rounds(width, tail):  # d rhs summed over rounds in fp32
        acc = _accumulation(lhs.dtype, rhs.dtype, dy.dtype)

        def step(state, rows):
            d_x, d_w = matmuls(rows, acc)
            return state[0].at[rows.reshape(-1)].set(d_x, mode="drop"), state[1] + d_w

        zeros = (jnp.zeros((n, k), lhs.dtype), jnp.zeros(rhs.shape, acc))
        d_lhs, d_rhs = _over_rounds(sizes, width, tail, n, step, zeros)
        return d_lhs, d_rhs.astype(rhs.dtype)

    return _by_capacity(sizes, first, n, one_round, rounds)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _batched(lhs, rhs, sizes, first, out_dtype, precision):
    return _product(lhs, rhs, sizes, first, out_dtype, precision)


def _batched_fwd(lhs, rhs, sizes, first, out_dtype, precision):
    return _product(lhs, rhs, sizes, first, out_dtype, precision), (lhs, rhs, sizes)


def _batched_bwd(first, out_dtype, precision, res, dy):
    lhs, rhs, sizes = res
    return (*_grads(lhs, rhs, sizes, dy, first, precision), None)


_batched.defvjp(_batched_fwd, _batched_bwd)


# --- tiled_ragged_dot: slots up to a capped capacity, the rest in tiles ---------------------------

#: the base slots' largest capacity, as a multiple of the mean group size; a
#: group's rows past its slots go to tiles (no cliff: a skewed routing costs
#: its extra tiles, not ``G`` times its largest group)
TILED_MAX_FACTOR = 1.5
#: the cost of one row in a tile against one row in the base slots, in the
#: rule that picks the base capacity: a tile's GEMM reads a gathered copy of
#: its expert's weights, which the base's batched GEMM reads in place (an
#: estimate, from bytes and FLOPs at the DeepSeek-V3-like shape; not measured)
TILE_ROW_COST = 4


def tiled_ragged_dot(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
    precision=None,
    preferred_element_type=None,
    *,
    capacity: int | None = None,
    tile: int = 128,
    chunk: int = 8,
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)``: every group's first
    ``C`` rows in slots of one batched GEMM (the weights in place, as
    :func:`batched_ragged_dot`), the rows past them padded per group to
    ``tile`` rows, each tile multiplied by its own group's weights.

    ``C`` is one of :func:`batched_ragged_dot`'s capacities up to
    ``TILED_MAX_FACTOR`` (1.5) times the mean group size (``capacity``, default
    ``ceil(N / G)``), the one of least estimated cost ``G C + TILE_ROW_COST
    * tile * (tiles past C)`` (``lax.switch``: one branch runs). Balanced
    routing is :func:`batched_ragged_dot`'s batched GEMM; a skewed one adds
    the few tiles of its largest groups instead of slots of the largest
    group for every group. The tiles run ``chunk`` at a time (one batched
    GEMM on the chunk's ``chunk`` gathered weight matrices) in a loop over
    the chunks that have rows. ``capacity=0``: no slots, every row in tiles
    (rows sorted by group, each group padded to a multiple of ``tile``).

    Memory: the slots (at most ``1.5 N + 8 G`` rows of ``lhs`` and of the
    output), one chunk (``chunk * tile`` rows and ``chunk`` weight matrices)
    and ``ceil(N / tile) + G`` tile indices: bounded whatever the routing.

    Backward (its own): ``d lhs`` and ``d rhs`` from the same slots and tiles;
    a group's ``d rhs`` is its slots' part plus each of its tiles' parts, each
    added in ``rhs``'s dtype (in bf16 a few roundings where a group has tiles).

    Args and result: as :func:`batched_ragged_dot`, with ``capacity >= 0``,
    ``tile >= 1`` and ``chunk >= 1``.

    >>> import jax.numpy as jnp
    >>> lhs = jnp.arange(8.0).reshape(4, 2)
    >>> rhs = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
    >>> tiled_ragged_dot(lhs, rhs, jnp.array([1, 2]), tile=1).tolist()
    [[0.0, 1.0], [4.0, 6.0], [8.0, 10.0], [0.0, 0.0]]
    """
    n, _, g, m = check_tiled_ragged_dot_args(lhs, rhs, group_sizes, capacity, tile, chunk,
                                             precision, preferred_element_type)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    if n == 0:
        return jnp.zeros((0, m), out_dtype)
    first = int(capacity) if capacity is not None else max(1, -(-n // g))
    return _tiled(lhs, rhs, jnp.asarray(group_sizes).astype(jnp.int32), (first, int(tile), int(chunk)),
                  out_dtype, precision)


def _tiled_capacities(first: int) -> tuple[int, ...]:
    """The base capacities: :func:`_capacities` up to ``TILED_MAX_FACTOR``
    times ``first``; ``(0,)`` for ``first == 0`` (every row in tiles)."""
    if first == 0:
        return (0,)
    top = -(-math.ceil(first * TILED_MAX_FACTOR) // 8) * 8
    return tuple(c for c in _capacities(first) if c <= top)


def _tile_counts(sizes, base, tile: int):
    """Tiles of each group past its first ``base`` rows: ``[G]``."""
    return (jnp.maximum(sizes - base, 0) + tile - 1) // tile


def _pick_base(sizes, caps, tile: int):
    """``lax.switch`` index of the base capacity of least estimated cost."""
    c = jnp.asarray(caps, jnp.int32)
    tiles = jnp.sum(_tile_counts(sizes[None, :], c[:, None], tile), axis=1, dtype=jnp.int32)
    cost = sizes.shape[0] * c + TILE_ROW_COST * tile * tiles
    return jnp.argmin(cost).astype(jnp.int32)


def _tile_plan(sizes, base, tile: int, chunk: int, num_rows: int):
    """The tiles past the first ``base`` rows of every group: a function of a
    chunk number giving ``(groups [chunk], rows [chunk, tile])`` (``num_rows``,
    out of range, for no row), and the number of chunks with tiles."""
    num_groups = sizes.shape[0]
    max_tiles = -(-num_rows // tile) + num_groups  # >= sum ceil(over_g / tile)
    per = _tile_counts(sizes, base, tile)
    ends = jnp.cumsum(per, dtype=jnp.int32)
    num = ends[-1]
    j = jnp.arange(max_tiles, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(ends, j, side="right"), num_groups - 1).astype(jnp.int32)
    starts = jnp.cumsum(sizes, dtype=jnp.int32) - sizes
    first_row = starts[grp] + base + (j - (ends - per)[grp]) * tile
    last_row = starts[grp] + sizes[grp]

    def chunk_of(c):
        jj = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        k = jnp.minimum(jj, max_tiles - 1)
        rows = first_row[k][:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]
        valid = (jj < num)[:, None] & (rows < last_row[k][:, None])
        return grp[k], jnp.where(valid, rows, num_rows)

    return chunk_of, (num + chunk - 1) // chunk


def _tiled_product(lhs, rhs, sizes, plan, out_dtype, precision):
    first, tile, chunk = plan
    n, m = lhs.shape[0], rhs.shape[2]
    caps = _tiled_capacities(first)

    def base(width):
        if width == 0:
            return jnp.zeros((n, m), out_dtype)
        slots = jnp.einsum("gck,gkm->gcm", _take_rows(lhs, _round_rows(sizes, 0, width, n)), rhs,
                           precision=precision, preferred_element_type=out_dtype).reshape(-1, m)
        return _read_back(slots, sizes, width, n, capped=True)

    branch = _pick_base(sizes, caps, tile)
    out = lax.switch(branch, [functools.partial(base, c) for c in caps])
    chunk_of, num_chunks = _tile_plan(sizes, jnp.asarray(caps, jnp.int32)[branch], tile, chunk, n)

    def step(c, out):
        groups, rows = chunk_of(c)
        y = jnp.einsum("btk,bkm->btm", _take_rows(lhs, rows), jnp.take(rhs, groups, axis=0), precision=precision,
                       preferred_element_type=out_dtype)
        return out.at[rows.reshape(-1)].set(y.reshape(-1, m), mode="drop")

    return lax.fori_loop(0, num_chunks, step, out)


def _tiled_grads(lhs, rhs, sizes, dy, plan, precision):
    first, tile, chunk = plan
    n, k = lhs.shape
    caps = _tiled_capacities(first)
    acc = _accumulation(lhs.dtype, rhs.dtype, dy.dtype)

    def base(width):
        if width == 0:
            return jnp.zeros((n, k), lhs.dtype), jnp.zeros(rhs.shape, rhs.dtype)
        rows = _round_rows(sizes, 0, width, n)
        x, d = _take_rows(lhs, rows), _take_rows(dy, rows)
        d_x = jnp.einsum("gcm,gkm->gck", d, rhs, precision=precision, preferred_element_type=lhs.dtype)
        d_w = jnp.einsum("gck,gcm->gkm", x, d, precision=precision, preferred_element_type=rhs.dtype)
        return _read_back(d_x.reshape(-1, k), sizes, width, n, capped=True), d_w

    branch = _pick_base(sizes, caps, tile)
    d_lhs, d_rhs = lax.switch(branch, [functools.partial(base, c) for c in caps])
    chunk_of, num_chunks = _tile_plan(sizes, jnp.asarray(caps, jnp.int32)[branch], tile, chunk, n)

    def step(c, state):
        d_lhs, d_rhs = state
        groups, rows = chunk_of(c)
        x, d, w = _take_rows(lhs, rows), _take_rows(dy, rows), jnp.take(rhs, groups, axis=0)
        d_x = jnp.einsum("btm,bkm->btk", d, w, precision=precision, preferred_element_type=lhs.dtype)
        d_w = jnp.einsum("btk,btm->bkm", x, d, precision=precision, preferred_element_type=acc)
        return (d_lhs.at[rows.reshape(-1)].set(d_x.reshape(-1, k), mode="drop"),
                d_rhs.at[groups].add(d_w.astype(rhs.dtype)))

    return lax.fori_loop(0, num_chunks, step, (d_lhs, d_rhs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _tiled(lhs, rhs, sizes, plan, out_dtype, precision):
    return _tiled_product(lhs, rhs, sizes, plan, out_dtype, precision)


def _tiled_fwd(lhs, rhs, sizes, plan, out_dtype, precision):
    return _tiled_product(lhs, rhs, sizes, plan, out_dtype, precision), (lhs, rhs, sizes)


def _tiled_bwd(plan, out_dtype, precision, res, dy):
    lhs, rhs, sizes = res
    return (*_tiled_grads(lhs, rhs, sizes, dy, plan, precision), None)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)

__all__ = ["batched_ragged_dot", "tiled_ragged_dot"]
