"""``mosaic_ragged_dot`` off a Hopper GPU: the jnp composition it falls back
to gives ``jax.lax.ragged_dot``'s values and gradients (against a float64
NumPy oracle), ``mosaic_supported`` says why it fell back, the tile tables
pick tiles that divide the operands, and bad arguments name the argument.
The kernels themselves: tests/grouped_gemm/test_mosaic_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpurouter import moe as gmoe
from gpurouter.grouped_gemm import mosaic_ragged_dot
from gpurouter.grouped_gemm.mosaic import forward_tiles, mosaic_supported, weight_grad_tiles

N, K, G, M = 70, 64, 4, 128
SIZES = (20, 0, 33, 10)  # an empty group, 7 rows past the sum


def _oracle(lhs, rhs, sizes, dy):
    """float64 out, d lhs, d rhs of ragged_dot."""
    lhs, rhs, dy = (np.asarray(a, np.float64) for a in (lhs, rhs, dy))
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    d_lhs = np.zeros_like(lhs)
    d_rhs = np.zeros_like(rhs)
    start = 0
    for g, s in enumerate(sizes):
        rows = slice(start, start + s)
        out[rows] = lhs[rows] @ rhs[g]
        d_lhs[rows] = dy[rows] @ rhs[g].T
        d_rhs[g] = lhs[rows].T @ dy[rows]
        start += s
    return out, d_lhs, d_rhs


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_values_and_grads_off_the_kernels(dtype, tol):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(N, K)), dtype)
    rhs = jnp.asarray(rng.normal(size=(G, K, M)) / np.sqrt(K), dtype)
    dy = jnp.asarray(rng.normal(size=(N, M)), dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    # fp32 against a 1e-5 bound needs fp32 products: on a GPU XLA's default precision multiplies
    # fp32 in TF32 (10-bit mantissas), so the fallback's dots run at "highest" here
    with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
        out, vjp = jax.vjp(lambda a, b: mosaic_ragged_dot(a, b, sizes), lhs, rhs)
        got = (out, *vjp(dy))
    for what, a, b in zip(("out", "d_lhs", "d_rhs"), got, _oracle(lhs, rhs, SIZES, dy), strict=True):
        assert a.dtype == dtype, what
        a = np.asarray(a, np.float64)
        assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b))), what
    assert not np.asarray(out[sum(SIZES):]).any()


def test_supported_says_why_not_here():
    lhs = jnp.zeros((N, K), jnp.bfloat16)
    rhs = jnp.zeros((G, K, M), jnp.bfloat16)
    if jax.default_backend() != "gpu":
        assert "not a GPU" in mosaic_supported(lhs, rhs)
    # reasons that hold on any device once the device is a Hopper GPU
    import gpurouter.grouped_gemm.mosaic as mod
    real = mod._hopper
    try:
        mod._hopper = lambda: None  # as on a Hopper GPU
        assert mosaic_supported(lhs, rhs) == mod._kernels()[1]  # None where jax's kernels import
        assert "float32" in mosaic_supported(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
        assert "preferred_element_type" in mosaic_supported(lhs, rhs, jnp.float32)
        assert "multiples of 64" in mosaic_supported(jnp.zeros((N, 40), jnp.bfloat16),
                                                     jnp.zeros((G, 40, M), jnp.bfloat16))
    finally:
        mod._hopper = real


@pytest.mark.parametrize("rows,groups,k,n", [(65536, 128, 2048, 768), (65536, 128, 768, 2048),
                                             (32768, 256, 7168, 2048), (32768, 256, 2048, 7168),
                                             (100, 3, 64, 64), (4096, 8, 192, 320)])
def test_tiles_divide_the_operands(rows, groups, k, n):
    t = forward_tiles(rows, groups, k, n)
    assert t is not None
    assert k % t.block_k == 0 and n % t.block_n == 0 and (n // t.block_n) % t.grid_block_n == 0
    w = weight_grad_tiles(k, n)
    assert k % w.block_m == 0 and n % w.block_n == 0 and (n // w.block_n) % w.grid_block_n == 0
    # the sweep's picks at the two full shapes
    if (rows, groups, k, n) == (65536, 128, 2048, 768):
        assert (t.block_m, t.block_n) == (128, 192)
    if (rows, groups, k, n) == (32768, 256, 7168, 2048):
        assert (t.block_m, t.block_n) == (64, 256)


def test_tiles_none_off_64():
    assert forward_tiles(128, 2, 40, 64) is None
    assert weight_grad_tiles(64, 40) is None


def test_argument_errors_name_the_argument():
    lhs = jnp.zeros((N, K), jnp.bfloat16)
    with pytest.raises(ValueError, match="mosaic_ragged_dot: rhs shape"):
        mosaic_ragged_dot(lhs, jnp.zeros((G, K + 1, M), jnp.bfloat16), jnp.asarray(SIZES))
    with pytest.raises(ValueError, match="group_offset"):
        mosaic_ragged_dot(lhs, jnp.zeros((G, K, M), jnp.bfloat16), jnp.asarray(SIZES), group_offset=jnp.int32(1))


def test_moe_block_takes_it():
    rng = np.random.default_rng(1)
    t, h, e, k, m = 16, 64, 4, 2, 64
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    gate = jnp.asarray(rng.normal(size=(h, e)) / 8, jnp.float32)
    w0, w1 = (jnp.asarray(rng.normal(size=(e, h, m)) / 8, jnp.float32) for _ in range(2))
    wo = jnp.asarray(rng.normal(size=(e, m, h)) / 8, jnp.float32)
    args = (x, gate, w0, w1, wo)
    got, _ = gmoe.moe(*args, num_experts=e, num_experts_per_tok=k, backend="jax", grouped_matmul=mosaic_ragged_dot)
    want, _ = gmoe.moe(*args, num_experts=e, num_experts_per_tok=k, backend="jax",
                       grouped_matmul=gmoe.batched_ragged_dot)  # not the default: "auto" is the slots on a GPU
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
