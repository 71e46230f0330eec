"""``pallas_ragged_dot`` in Pallas' interpreter (``interpret=True``) at tiny shapes: the
values and both gradients of ``jax.lax.ragged_dot``, with 16-row tiles so that
an empty group, a group over several tiles, groups and ``N``, ``K``, ``M`` off
the tiles and rows past ``sum(group_sizes)`` all occur; its tile schedule; its
argument errors; and ``gpurouter.moe(..., grouped_matmul=pallas_ragged_dot)``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpurouter import moe as gmoe
from gpurouter.grouped_gemm import pallas_ragged_dot
from gpurouter.grouped_gemm.pallas import tile_schedule

TILES = dict(block_m=16, block_n=16, block_k=16, interpret=True)  # the interpreter on any machine
N, K, G, M = 70, 40, 4, 24
SIZES = (20, 0, 33, 10)  # an empty group, one over 3 tiles, 7 rows past the sum


def _operands(dtype, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(N, K)), dtype)
    rhs = jnp.asarray(rng.normal(size=(G, K, M)) / np.sqrt(K), dtype)
    dy = jnp.asarray(rng.normal(size=(N, M)), dtype)
    return lhs, rhs, jnp.asarray(SIZES, jnp.int32), dy


def _fwd_bwd(fn, lhs, rhs, sizes, dy):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    return (out, *vjp(dy))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_values_and_grads_equal_ragged_dot(dtype, tol):
    lhs, rhs, sizes, dy = _operands(dtype)
    with jax.default_matmul_precision("float32"):  # not TF32 on a GPU (the gpu_suite runs this file too)
        got = _fwd_bwd(functools.partial(pallas_ragged_dot, **TILES), lhs, rhs, sizes, dy)
        # the oracle in float32 on the same (rounded) operands
        f32 = [x.astype(jnp.float32) for x in (lhs, rhs, dy)]
        want = _fwd_bwd(jax.lax.ragged_dot, f32[0], f32[1], sizes, f32[2])
    for what, a, b in zip(("out", "d_lhs", "d_rhs"), got, want, strict=True):
        assert a.dtype == dtype, what
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.max(np.abs(b)), err_msg=what)
    out, _, d_rhs = (np.asarray(x, np.float32) for x in got)
    assert np.all(out[sum(SIZES):] == 0)  # rows past the groups
    assert np.all(d_rhs[1] == 0)  # the empty group


def test_preferred_element_type():
    lhs, rhs, sizes, _ = _operands(jnp.bfloat16, seed=1)
    with jax.default_matmul_precision("float32"):
        out = pallas_ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32, **TILES)
        want = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [(20, 0, 33, 10), (0, 0, 0, 0), (64, 0, 0, 0), (16, 16, 16, 16), (1, 2, 3, 70)])
def test_tile_schedule_covers_every_row_once(sizes):
    """Every row of the padded ``[0, 64)`` is stored by exactly one visit, by
    its own group (``G`` past the sum, clipped to ``N``)."""
    rows = 64
    tile, group, lo, hi = (np.asarray(x) for x in tile_schedule(jnp.asarray(sizes, jnp.int32), rows, 16))
    assert tile.shape == (rows // 16 + len(sizes),)
    owner = np.repeat(np.arange(len(sizes) + 1), list(sizes) + [0])[:rows]
    owner = np.concatenate([owner, np.full(rows - len(owner), len(sizes))])
    stored = np.zeros(rows, int)
    for t, g, a, b in zip(tile, group, lo, hi, strict=True):
        r = np.arange(t * 16, t * 16 + 16)
        hit = r[(r >= a) & (r < b)]
        assert np.all(owner[hit] == g)
        stored[hit] += 1
    assert np.all(stored == 1)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(block_m=24), ValueError, "pallas_ragged_dot: block_m (24) must be a power of two >= 16"),
    (dict(block_k=8), ValueError, "pallas_ragged_dot: block_k (8) must be a power of two >= 16"),
    (dict(num_warps=0), ValueError, "pallas_ragged_dot: num_warps (0) must be >= 1"),
    (dict(group_offset=jnp.zeros((1,), jnp.int32)), ValueError, "pallas_ragged_dot: group_offset must be None"),
    (dict(interpret=1), TypeError, "pallas_ragged_dot: interpret (1) must be None or a bool"),
])
def test_errors_name_the_op_and_argument(kw, exc, msg):
    lhs, rhs, sizes, _ = _operands(jnp.float32)
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)")):
        pallas_ragged_dot(lhs, rhs, sizes, **kw)


@pytest.mark.slow(reason="about 35 s: the block's three GEMMs and their backward in Pallas' interpreter")
def test_moe_block_with_pallas_equals_batched():
    """``gpurouter.moe(..., grouped_matmul=pallas_ragged_dot)``: the block's
    output and gradients as with ``batched_ragged_dot``."""
    t, h, e, k, m = 12, 16, 4, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    p = dict(x=jax.random.normal(ks[0], (t, h)), gate_kernel=jax.random.normal(ks[1], (h, e)),
             wi_0=jax.random.normal(ks[2], (e, h, m)) * 0.4, wi_1=jax.random.normal(ks[3], (e, h, m)) * 0.4,
             wo=jax.random.normal(ks[4], (e, m, h)) * 0.4)

    def loss(p, gmm):
        out, _ = gmoe.moe(p["x"], p["gate_kernel"], p["wi_0"], p["wi_1"], p["wo"], num_experts=e,
                          num_experts_per_tok=k, grouped_matmul=gmm, backend="jax")
        return jnp.sum(out ** 2), out

    with jax.default_matmul_precision("float32"):
        (_, got), g_got = jax.value_and_grad(loss, has_aux=True)(p, functools.partial(pallas_ragged_dot, **TILES))
        (_, want), g_want = jax.value_and_grad(loss, has_aux=True)(p, gmoe.batched_ragged_dot)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    for name in p:
        np.testing.assert_allclose(np.asarray(g_got[name]), np.asarray(g_want[name]), rtol=1e-4, atol=1e-4,
                                   err_msg=name)
