"""``batched_ragged_dot`` against a NumPy float64 oracle and ``jax.lax.ragged_dot``:
values and both gradients, every branch (each static capacity and the
rounds past the largest), empty groups, rows past the groups, and under
jit / checkpoint / scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpurouter import moe as gmoe
from gpurouter.reference.grouped_matmul import _capacities, batched_ragged_dot


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


def _check(sizes, n, capacity=None, k=5, m=3, seed=0):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    lhs, rhs = rng.normal(size=(n, k)), rng.normal(size=(len(sizes), k, m))
    dy = rng.normal(size=(n, m))
    with jax.enable_x64(True):
        f = jax.jit(lambda a, b, s: batched_ragged_dot(a, b, s, capacity=capacity))
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


@settings(max_examples=25, deadline=None)
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
