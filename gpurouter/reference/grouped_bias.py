"""Pure-jnp reference of the grouped bias ops (docs/ops/moe_ops.md), public
through :mod:`gpurouter.reference.moe_ops`.

- :func:`compute_grouped_dbias_dscales` and :func:`compute_grouped_dbias`:
  TE PR #2864's grouped bias gradients (``dbias [G, H]``, ``dscales [N]``);
- :func:`grouped_scaled_bias_add`: ``y + bias[g(i)] * scales[i]``, whose
  backward is the op above;
- the fixed-order segment sums they are built on (``_segment_sum``, also the
  per-token sums of :mod:`gpurouter.reference.permute`).

**Determinism.** Every floating-point reduction here has a fixed order, so
each op is bit-identical from run to run on every platform (TE's Triton
kernels add with float atomics). A float sum over a *dynamic* set of rows
(a group of ``offsets``, the K copies of a token) is never a float
scatter-add (``jax.ops.segment_sum`` and ``.at[].add`` lower to XLA scatters,
not guaranteed deterministic on a GPU) and never a cumulative-sum difference
(``C[end] - C[start]`` cancels catastrophically for a small group far down a
long cumsum, and one ``inf`` in a group would turn every later group into
``inf - inf = NaN``). It is a *segmented* inclusive scan
(:func:`jax.lax.associative_scan` with a reset flag at each segment start),
read at each segment's last row: a fixed binary tree of fp32 additions
inside each segment only, ``O(N H)`` work, no ``[G, N]`` one-hot matrix (a
dense ``[G, N] @ [N, H]`` costs ``G`` times more and, on a GPU, would need
``precision=HIGHEST`` to avoid TF32). Integer index maps (those of
:mod:`gpurouter.reference.permute`) may use scatters (integer sums are exact
in any order; the scatters that move floats write each element at most once).

**Padding.** Rows that no group or token owns (``offsets`` tails, alignment
padding, rows past the routed count) are excluded with ``jnp.where``, never
with a multiply by a 0/1 mask, so a NaN or ``inf`` left there (an
uninitialised receive buffer) reaches no output and no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._checks import (
    check_grouped_dbias_args,
    check_grouped_dbias_dscales_args,
    check_scaled_bias_add_args,
)

F32 = jnp.float32
I32 = jnp.int32


# ----------------------------------------------------------------------------
# Fixed-order segment sums over contiguous row ranges
# ----------------------------------------------------------------------------


def _segments(offsets: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row ``i``: ``(segment s(i) in [0, S), owned, starts)`` for ``offsets [S + 1]``.

    Row ``i`` belongs to segment ``s`` iff ``offsets[s] <= i < offsets[s + 1]``;
    rows before ``offsets[0]`` or at/after ``offsets[S]`` are not owned.
    ``starts[i]`` marks the first row of each run of equal segment ids.
    """
    o = jnp.clip(offsets.astype(I32), 0, num_rows)
    i = jnp.arange(num_rows, dtype=I32)
    # k(i) = #{j : o[j] <= i}: 0 before the first segment, S + 1 past the last;
    # empty segments (o[s] == o[s + 1]) are skipped by construction.
    k = jnp.searchsorted(o, i, side="right").astype(I32)
    owned = (k >= 1) & (k <= offsets.shape[0] - 1)
    starts = jnp.concatenate([jnp.ones((min(num_rows, 1),), bool), k[1:] != k[:-1]])
    return jnp.clip(k - 1, 0, offsets.shape[0] - 2), owned, starts


def _segment_sum(v: jax.Array, offsets: jax.Array) -> jax.Array:
    """``out[s] = sum_{offsets[s] <= i < offsets[s+1]} v[i]``, fp32, fixed order.

    Args:
      v: ``[N, H]`` float32; rows outside every segment may hold anything
        (NaN included): they are replaced by 0 before any addition.
      offsets: ``[S + 1]`` non-decreasing integers (may be traced).

    Returns:
      ``[S, H]`` float32; an empty segment gives exactly 0.
    """
    n, h = v.shape
    s = offsets.shape[0] - 1
    if n == 0:
        return jnp.zeros((s, h), F32)
    _, owned, starts = _segments(offsets, n)
    v = jnp.where(owned[:, None], v, 0.0)

    def combine(a, b):
        # Segmented sum: b's partial restarts at a segment start inside b.
        (va, fa), (vb, fb) = a, b
        return jnp.where(fb[:, None], vb, va + vb), fa | fb

    scanned, _ = jax.lax.associative_scan(combine, (v, starts))
    o = jnp.clip(offsets.astype(I32), 0, n)
    last = jnp.clip(o[1:] - 1, 0, n - 1)
    return jnp.where((o[1:] > o[:-1])[:, None], scanned[last], 0.0)


# ----------------------------------------------------------------------------
# Grouped dbias / dscales (TE PR #2864)
# ----------------------------------------------------------------------------


@jax.jit
def _dbias_dscales(dy, scales, bias, offsets, dbias, dscales):
    # jit: one compiled program per shape when called eagerly (the segmented
    # scan is dozens of small ops); inlined under an enclosing jit.
    n = dy.shape[0]
    dy32 = dy.astype(F32)
    offsets = jnp.asarray(offsets)
    if scales is None:
        db = _segment_sum(dy32, offsets)
        return db if dbias is None else db + dbias, None
    s32 = scales.astype(F32)
    db = _segment_sum(dy32 * s32[:, None], offsets)
    if n:
        g, owned, _ = _segments(offsets, n)
        ds = jnp.sum(dy32 * bias.astype(F32)[g], axis=1)
        ds = jnp.where(owned, ds, 0.0)
    else:
        ds = jnp.zeros((0,), F32)
    if dbias is not None:
        db = db + dbias
    if dscales is not None:
        ds = ds + dscales
    return db, ds


def compute_grouped_dbias_dscales(
    dy: jax.typing.ArrayLike,
    scales: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike,
    offsets: jax.typing.ArrayLike,
    dbias: jax.typing.ArrayLike | None = None,
    dscales: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gradients of ``y[i] += scales[i] * bias[g(i)]`` (TE PR #2864), deterministic.

    Row ``i`` belongs to group ``g`` iff ``offsets[g] <= i < offsets[g + 1]``.

    1. ``dbias[g] = sum_{i in g} dy[i] * scales[i]`` (fp32);
    2. ``dscales[i] = sum_h dy[i, h] * bias[g(i), h]`` (fp32);
    3. rows before ``offsets[0]`` or at/after ``offsets[G]`` contribute
       nothing and get ``dscales[i] = 0`` (even where ``dy`` is NaN there); an
       empty group gets ``dbias[g] = 0``;
    4. a given ``dbias`` / ``dscales`` is added to (TE accumulates into them,
       so that the caller fuses upstream gradients); the sum is returned.

    Args:
      dy: ``[N, H]`` float32, bfloat16 or float16 (float64 allowed).
      scales: ``[N]`` float, the per-row scale (a routing prob).
      bias: ``[G, H]`` float, ``G >= 1``.
      offsets: ``[G + 1]`` integers, non-decreasing (checked where concrete;
        may be traced under ``jit``), ``[0, s0, s0 + s1, ..., N]`` in TE.
      dbias: optional ``[G, H]`` float32 to accumulate into.
      dscales: optional ``[N]`` float32 to accumulate into.

    Returns:
      ``(dbias [G, H] float32, dscales [N] float32)``.

    Raises:
      ValueError, TypeError: bad shapes or dtypes, decreasing concrete offsets.

    Notes:
      Bit-identical from run to run (TE's Triton kernel uses float atomics
      and is refused under ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``):
      ``dbias`` is a fixed-order segmented scan (module docstring: why not
      ``segment_sum``, a cumsum difference or a one-hot matmul); ``dscales``
      is a plain row reduction over ``H``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter.reference.moe_ops import compute_grouped_dbias_dscales
      >>> db, ds = compute_grouped_dbias_dscales(jnp.ones((3, 2)), jnp.array([1.0, 2.0, 3.0]),
      ...                                       jnp.array([[1.0, 1.0], [2.0, 0.0]]), jnp.array([0, 1, 3]))
      >>> db.tolist(), ds.tolist()
      ([[1.0, 1.0], [5.0, 5.0]], [2.0, 2.0, 2.0])
    """
    check_grouped_dbias_dscales_args(dy, scales, bias, offsets, dbias, dscales)
    return _dbias_dscales(jnp.asarray(dy), jnp.asarray(scales), jnp.asarray(bias), offsets,
                          dbias, dscales)


def compute_grouped_dbias(
    dy: jax.typing.ArrayLike,
    offsets: jax.typing.ArrayLike,
    num_groups: int,
    dbias: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """``dbias[g] = sum_{offsets[g] <= i < offsets[g+1]} dy[i]``, fp32, deterministic.

    :func:`compute_grouped_dbias_dscales` without scales: the gradient of an
    unscaled per-group bias. Rows outside ``[offsets[0], offsets[G])`` are
    ignored (unlike ``segment_sum`` over ``jnp.repeat(..., total_repeat_length=N)``
    ids, which puts a tail into the last group); an empty group gets 0.

    Args:
      dy: ``[N, H]`` float.
      offsets: ``[num_groups + 1]`` integers, non-decreasing.
      num_groups: static ``G >= 1``.
      dbias: optional ``[G, H]`` float32, added to.

    Returns:
      ``dbias [G, H]`` float32.

    Raises:
      ValueError, TypeError: bad shapes, dtypes or ``num_groups``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter.reference.moe_ops import compute_grouped_dbias
      >>> compute_grouped_dbias(jnp.ones((4, 1)), jnp.array([0, 0, 3]), 2).tolist()
      [[0.0], [3.0]]
    """
    check_grouped_dbias_args(dy, offsets, num_groups, dbias)
    return _dbias_dscales(jnp.asarray(dy), None, None, offsets, dbias, None)[0]


# ----------------------------------------------------------------------------
# Grouped scaled bias add
# ----------------------------------------------------------------------------


def _group_offsets(group_sizes: jax.Array) -> jax.Array:
    sizes = jnp.asarray(group_sizes).astype(I32)
    return jnp.concatenate([jnp.zeros((1,), I32), jnp.cumsum(sizes, dtype=I32)])


@jax.custom_vjp
def _scaled_bias_add(y, bias, scales, offsets):
    n = y.shape[0]
    if n == 0:
        return y
    g, owned, _ = _segments(offsets, n)
    added = (y.astype(F32) + bias.astype(F32)[g] * scales.astype(F32)[:, None]).astype(y.dtype)
    # Rows no group owns are returned bit for bit (NaN stays NaN, no fp32 round trip).
    return jnp.where(owned[:, None], added, y)


def _scaled_bias_add_fwd(y, bias, scales, offsets):
    return _scaled_bias_add(y, bias, scales, offsets), (bias, scales, offsets)


def _scaled_bias_add_bwd(res, dy):
    bias, scales, offsets = res
    db, ds = _dbias_dscales(dy, scales, bias, offsets, None, None)
    return dy, db.astype(bias.dtype), ds.astype(scales.dtype), None


_scaled_bias_add.defvjp(_scaled_bias_add_fwd, _scaled_bias_add_bwd)


def grouped_scaled_bias_add(
    y: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike,
    scales: jax.typing.ArrayLike,
    group_sizes: jax.typing.ArrayLike,
) -> jax.Array:
    """``out[i] = y[i] + bias[g(i)] * scales[i]``: a per-group bias scaled per row.

    TE's ``nvte_grouped_scaled_bias_add`` / ``GroupedLinear(scale_bias=True)``
    (PR #2864): with the routing prob applied before FC2 (early weighting),
    the FC2 bias must be scaled by the same prob for ``sum_k p_k (h_k W + b)``.

    1. ``offsets = [0, cumsum(group_sizes)]``; row ``i`` is in group ``g``
       iff ``offsets[g] <= i < offsets[g + 1]``;
    2. ``out[i] = y[i] + bias[g(i)] * scales[i]`` in fp32, cast once to
       ``y.dtype``;
    3. rows at/after ``sum(group_sizes)`` are returned unchanged, bit for bit.

    Backward (``jax.custom_vjp``): ``d_y = dy``; ``(d_bias, d_scales)`` from
    :func:`compute_grouped_dbias_dscales` (fixed order, fp32), cast to the
    dtypes of ``bias`` and ``scales``; ``group_sizes`` gets none.

    Args:
      y: ``[N, H]`` float.
      bias: ``[G, H]`` float, ``G >= 1``.
      scales: ``[N]`` float.
      group_sizes: ``[G]`` integers >= 0 (checked where concrete; may be
        traced); their sum may be < N (an over-allocated tail).

    Returns:
      ``[N, H]`` in ``y.dtype``.

    Raises:
      ValueError, TypeError: bad shapes, dtypes or negative concrete sizes.

    Examples:
      >>> import jax.numpy as jnp
      >>> from gpurouter.reference.moe_ops import grouped_scaled_bias_add
      >>> grouped_scaled_bias_add(jnp.zeros((3, 1)), jnp.array([[1.0], [10.0]]),
      ...                         jnp.array([1.0, 2.0, 3.0]), jnp.array([1, 1])).tolist()
      [[1.0], [20.0], [0.0]]
    """
    check_scaled_bias_add_args(y, bias, scales, group_sizes)
    return _scaled_bias_add_jit(jnp.asarray(y), jnp.asarray(bias), jnp.asarray(scales),
                                jnp.asarray(group_sizes))


@jax.jit
def _scaled_bias_add_jit(y, bias, scales, group_sizes):
    return _scaled_bias_add(y, bias, scales, _group_offsets(group_sizes))


__all__ = [
    "compute_grouped_dbias",
    "compute_grouped_dbias_dscales",
    "grouped_scaled_bias_add",
]
