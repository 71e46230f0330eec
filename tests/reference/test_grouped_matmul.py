"""``batched_ragged_dot`` and ``tiled_ragged_dot`` against a NumPy float64
oracle, ``jax.lax.ragged_dot`` and each other: values and both gradients,
every branch (each static capacity and the rounds past the largest; slots
and tiles, tiles only), empty groups, skewed groups, rows past the groups,
bounded memory, and under jit / checkpoint / scan."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpurouter import moe as gmoe
from gpurouter.reference.grouped_matmul import _capacities, _tiled_capacities, batched_ragged_dot, tiled_ragged_dot


def _oracle(lhs, rhs, sizes):
    """``out[i] = lhs[i] @ rhs[g(i)]``, 0 past the groups; float64 loops."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    i = 0
    for g, n in enumerate(np.asarray(sizes)):
        for _ in range(int(n)):
            out[i] = lhs[i] @ rhs[g]
            i += 1
    return out


def _oracle_grads(lhs, rhs, sizes, dy):
    """``d lhs[i] = dy[i] @ rhs[g(i)]^T``, ``d rhs[g] = sum_{i in g} lhs[i]^T dy[i]``."""
    lhs, rhs, dy = (np.asarray(a, np.float64) for a in (lhs, rhs, dy))
    d_lhs, d_rhs = np.zeros_like(lhs), np.zeros_like(rhs)
    i = 0
    for g, n in enumerate(np.asarray(sizes)):
        for _ in range(int(n)):
            d_lhs[i] = rhs[g] @ dy[i]
            d_rhs[g] += np.outer(lhs[i], dy[i])
            i += 1
    return d_lhs, d_rhs


def _check(sizes, n, capacity=None, k=5, m=3, seed=0, fn=batched_ragged_dot):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    lhs, rhs = rng.normal(size=(n, k)), rng.normal(size=(len(sizes), k, m))
    dy = rng.normal(size=(n, m))
    with jax.enable_x64(True):
        f = jax.jit(lambda a, b, s: fn(a, b, s, capacity=capacity))
        out, vjp = jax.vjp(lambda a, b: f(a, b, jnp.asarray(sizes)), jnp.asarray(lhs), jnp.asarray(rhs))
        np.testing.assert_allclose(np.asarray(out), _oracle(lhs, rhs, sizes), rtol=1e-12, atol=1e-12)
        d_lhs, d_rhs = vjp(jnp.asarray(dy))
        want_lhs, want_rhs = _oracle_grads(lhs, rhs, sizes, dy)
        np.testing.assert_allclose(np.asarray(d_lhs), want_lhs, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(d_rhs), want_rhs, rtol=1e-12, atol=1e-12)


def test_capacities_are_the_documented_multiples():
    assert _capacities(128) == (16, 24, 32, 48, 64, 96, 128, 136, 144, 152, 160, 168, 176, 184, 192, 224, 256,
                                384, 512)
    assert _capacities(3) == (8, 16)  # 3 .. 6 -> 8; 9, 12 -> 16
    assert _capacities(1) == (8,)


@pytest.mark.parametrize("sizes,n,capacity", [
    ([3, 0, 5, 2], 12, None),      # rows 10, 11 past the groups: 0, no gradient
    ([8, 8, 8, 8], 32, 8),         # the smallest capacity holds every group
    ([20, 4, 0, 0], 24, 8),        # a larger static capacity (24)
    ([40, 0, 1, 0], 41, 8),        # past the largest (32): one tail round
    ([70, 0, 0, 0], 70, 1),        # capacities (8,): 62 tail rows, rounds of 1
    ([0, 0, 0, 0], 6, None),       # no rows at all
    ([5, 7, 0, 2], 256, None),     # most rows past the groups: capacity 8 = 1/8 of the mean 64
])
def test_matches_the_float64_oracle(sizes, n, capacity):
    _check(sizes, n, capacity)


# each example compiles (2.5 s on the CI CPU); the cases above pin the edges (12 examples until 2026-11-28)
@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=5), st.integers(0, 4), st.sampled_from([None, 1, 2, 5]))
def test_any_group_sizes_match_the_oracle(sizes, tail, capacity):
    _check(sizes, sum(sizes) + tail, capacity, k=3, m=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_ragged_dot_in_low_precision(dtype):
    rng = np.random.default_rng(1)
    sizes = jnp.asarray([5, 0, 9, 3], jnp.int32)
    lhs = jnp.asarray(rng.normal(size=(19, 16)), dtype)
    rhs = jnp.asarray(rng.normal(size=(4, 16, 8)), dtype)
    out = batched_ragged_dot(lhs, rhs, sizes)
    want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=tol, atol=tol * 4)
    assert batched_ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32).dtype == jnp.float32


def test_under_checkpoint_and_scan():
    rng = np.random.default_rng(2)
    sizes = jnp.asarray([2, 6, 0, 4], jnp.int32)
    lhs, rhs = jnp.asarray(rng.normal(size=(12, 4)), jnp.float32), jnp.asarray(rng.normal(size=(4, 4, 3)), jnp.float32)

    def loss(a, b):
        return jnp.sum(jnp.sin(batched_ragged_dot(a, b, sizes)))

    g = jax.grad(loss, (0, 1))(lhs, rhs)
    g_remat = jax.grad(jax.checkpoint(loss), (0, 1))(lhs, rhs)
    _, g_scan = jax.lax.scan(lambda c, a: (c, jax.grad(loss, (0, 1))(a, rhs)), 0, jnp.stack([lhs, lhs]))
    for a, b, c in zip(g, g_remat, g_scan, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(c[1]), np.asarray(a), rtol=1e-6)


@pytest.mark.parametrize("args,exc,msg", [
    (((12, 5), (4, 6, 3), [3, 0, 5, 2]), ValueError, r"rhs shape \(4, 6, 3\) must be \(num_groups, contracting"),
    (((12,), (4, 5, 3), [3, 0, 5, 2]), ValueError, r"lhs shape \(12,\) must have rank 2"),
    (((12, 5), (4, 5, 3), [3, 0, 5]), ValueError, r"group_sizes shape \(3,\) must be \(num_groups,\) = \(4,\)"),
    (((12, 5), (4, 5, 3), [3, 0, 5, 9]), ValueError,
     r"group_sizes \(\[3, 0, 5, 9\]\) must be >= 0 and sum to at most lhs.shape\[0\] \(12\)"),
    (((12, 5), (4, 5, 3), [3, -1, 5, 2]), ValueError, r"group_sizes \(\[3, -1, 5, 2\]\) must be >= 0"),
    (((12, 5), (4, 5, 3), [3.0, 0, 5, 2]), TypeError, "group_sizes must be integers, got float32"),
])
def test_errors_name_the_argument(args, exc, msg):
    lhs_shape, rhs_shape, sizes = args
    sizes = jnp.asarray(sizes, jnp.float32 if isinstance(sizes[0], float) else jnp.int32)
    with pytest.raises(exc, match="batched_ragged_dot: " + msg):
        batched_ragged_dot(jnp.zeros(lhs_shape), jnp.zeros(rhs_shape), sizes)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match=r"batched_ragged_dot: capacity \(0\) must be >= 1"):
        batched_ragged_dot(jnp.zeros((4, 2)), jnp.zeros((2, 2, 2)), jnp.asarray([2, 2]), capacity=0)


def test_is_the_moe_modules():
    assert gmoe.batched_ragged_dot is batched_ragged_dot


# --- tiled_ragged_dot ------------------------------------------------------------------------------


def _tiled(tile, chunk):
    return functools.partial(tiled_ragged_dot, tile=tile, chunk=chunk)


def test_tiled_capacities_stop_at_one_and_a_half_means():
    assert _tiled_capacities(128) == (16, 24, 32, 48, 64, 96, 128, 136, 144, 152, 160, 168, 176, 184, 192)
    assert _tiled_capacities(0) == (0,)


@pytest.mark.parametrize("sizes,n,capacity,tile,chunk", [
    ([3, 0, 5, 2], 13, None, 2, 2),         # rows past the groups: 0, no gradient
    ([3, 0, 5, 2], 13, 0, 2, 2),            # tiles only: 1 + 3 + 1 tiles, 3 chunks
    ([3, 0, 5, 2], 13, 0, 128, 8),          # tiles larger than every group
    ([32, 3, 0, 5, 8, 0, 6, 10], 64, None, 4, 2),  # one group at 4x the mean: slots + its tiles
    ([0, 0, 0, 0], 7, None, 2, 2),          # no rows at all
    ([0, 0, 17, 0], 17, None, 3, 1),        # every row in one group, 17 = no multiple of the tile
    ([5, 7, 0, 2], 256, None, 8, 4),        # most rows past the groups
])
def test_tiled_matches_the_float64_oracle(sizes, n, capacity, tile, chunk):
    _check(sizes, n, capacity, fn=_tiled(tile, chunk))


# each example compiles a switch and two loops: ~3 s on a busy CPU; the cases above pin the edges
# (10 examples until 2026-11-28)
@settings(max_examples=5, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=5), st.integers(0, 4), st.sampled_from([None, 0, 1, 5]),
       st.integers(1, 5), st.integers(1, 3))
def test_tiled_any_group_sizes_match_the_oracle(sizes, tail, capacity, tile, chunk):
    _check(sizes, sum(sizes) + tail, capacity, k=3, m=2, fn=_tiled(tile, chunk))


def _skewed_sizes(num_groups: int, mean: int, rng) -> np.ndarray:
    """Random sizes summing to ``num_groups * mean``, the first group at 4x
    the mean and the last one empty."""
    rest = num_groups * mean - 4 * mean
    cuts = np.sort(rng.integers(0, rest + 1, num_groups - 3))
    sizes = np.diff(np.concatenate([[0], cuts, [rest]]))
    return np.concatenate([[4 * mean], sizes, [0]]).astype(np.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tile", [4, 16])
def test_tiled_equals_ragged_dot_and_batched_on_skewed_routing(dtype, tile):
    """The largest group at 4x the mean, empty groups, 3 rows past the groups
    (N = 8 * 12 + 3: no multiple of anything): the same values and gradients
    as ``jax.lax.ragged_dot`` and ``batched_ragged_dot``."""
    rng = np.random.default_rng(7)
    sizes = jnp.asarray(_skewed_sizes(8, 12, rng))
    assert sizes.shape == (8,) and int(sizes[0]) == 4 * int(sizes.sum()) // 8 == int(sizes.max())
    assert int(sizes[-1]) == 0
    n = int(sizes.sum()) + 3
    lhs = jnp.asarray(rng.normal(size=(n, 16)), dtype)
    rhs = jnp.asarray(rng.normal(size=(8, 16, 8)), dtype)
    dy = jnp.asarray(rng.normal(size=(n, 8)), dtype)
    results = {}
    with jax.default_matmul_precision("float32"):
        for name, fn in (("ragged_dot", jax.lax.ragged_dot), ("batched", batched_ragged_dot),
                         ("tiled", _tiled(tile, 2))):
            out, vjp = jax.vjp(lambda a, b, fn=fn: jax.jit(fn)(a, b, sizes), lhs, rhs)
            results[name] = (out, *vjp(dy))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for other in ("ragged_dot", "batched"):
        for got, want in zip(results["tiled"], results[other], strict=True):
            assert got.dtype == want.dtype == dtype
            scale = float(np.max(np.abs(np.asarray(want, np.float32))))
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                                       atol=tol * scale)
    assert not np.any(np.asarray(results["tiled"][0][-3:], np.float32))  # rows past the groups


def test_tiled_memory_is_bounded_where_batched_grows():
    """XLA's temporaries (every branch's, as compiled): the tiled GEMM's, forward
    and backward, stay under 3x the rows' bytes; the batched GEMM's, which
    compiles slots for a group at 4x the mean, do not."""
    n, k, m, g = 512, 64, 32, 16
    specs = (jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((g, k, m), jnp.float32),
             jax.ShapeDtypeStruct((g,), jnp.int32))
    rows_bytes = n * (k + m) * 4

    def temps(fn):
        fwd = jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes
        bwd = jax.jit(jax.grad(lambda a, b, s: jnp.sum(fn(a, b, s)), argnums=(0, 1)))
        return fwd, bwd.lower(*specs).compile().memory_analysis().temp_size_in_bytes

    tiled, batched = temps(_tiled(8, 4)), temps(batched_ragged_dot)
    assert max(tiled) <= 3 * rows_bytes, (tiled, rows_bytes)
    assert max(batched) > 3 * rows_bytes, (batched, rows_bytes)  # the bound is one batched breaks


def test_tiled_under_checkpoint_and_scan():
    rng = np.random.default_rng(2)
    sizes = jnp.asarray([2, 9, 0, 1], jnp.int32)
    lhs, rhs = jnp.asarray(rng.normal(size=(12, 4)), jnp.float32), jnp.asarray(rng.normal(size=(4, 4, 3)), jnp.float32)

    def loss(a, b):
        return jnp.sum(jnp.sin(tiled_ragged_dot(a, b, sizes, tile=2, chunk=2)))

    g = jax.grad(loss, (0, 1))(lhs, rhs)
    g_remat = jax.grad(jax.checkpoint(loss), (0, 1))(lhs, rhs)
    _, g_scan = jax.lax.scan(lambda c, a: (c, jax.grad(loss, (0, 1))(a, rhs)), 0, jnp.stack([lhs, lhs]))
    for a, b, c in zip(g, g_remat, g_scan, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(c[1]), np.asarray(a), rtol=1e-6)


@pytest.mark.parametrize("kw,msg", [
    (dict(capacity=-1), r"capacity \(-1\) must be >= 0 \(0: every row in tiles\) or None"),
    (dict(tile=0), r"tile \(0\) must be >= 1"),
    (dict(chunk=0), r"chunk \(0\) must be >= 1"),
])
def test_tiled_errors_name_the_argument(kw, msg):
    with pytest.raises(ValueError, match="tiled_ragged_dot: " + msg):
        tiled_ragged_dot(jnp.zeros((4, 2)), jnp.zeros((2, 2, 2)), jnp.asarray([2, 2]), **kw)
    with pytest.raises(ValueError, match=r"tiled_ragged_dot: rhs shape \(2, 3, 2\)"):
        tiled_ragged_dot(jnp.zeros((4, 2)), jnp.zeros((2, 3, 2)), jnp.asarray([2, 2]))


def test_tiled_is_the_moe_modules():
    assert gmoe.tiled_ragged_dot is tiled_ragged_dot
