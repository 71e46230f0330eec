"""``mosaic_ragged_dot`` on jax's Mosaic-GPU kernels (a Hopper GPU): the
values and both gradients of a float64 oracle at the edges (an empty group,
rows past the groups, N off 128, groups over several tiles), of
``batched_ragged_dot`` at the MoE issue's two full shapes (balanced and
skewed routing). tools/probes/mosaic_gemm_sweep.py times them.
(No MoE-block test here: a jitted block with nine of these kernels hung in
XLA's compile on the H200, docs/moe.md "Mosaic GPU"; the block's wiring is
tested off the GPU, tests/grouped_gemm/test_mosaic.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gemm_gpu_helpers import SHAPES
from gemm_gpu_helpers import assert_matches as _assert_matches
from gemm_gpu_helpers import fwd_bwd as _fwd_bwd
from gemm_gpu_helpers import operands as _operands
from gemm_gpu_helpers import sizes as _sizes

from gpurouter.grouped_gemm import mosaic_ragged_dot
from gpurouter.grouped_gemm.mosaic import mosaic_supported
from gpurouter.reference.grouped_matmul import batched_ragged_dot

pytestmark = pytest.mark.gpu


def _need_kernels(lhs, rhs):
    why = mosaic_supported(lhs, rhs)
    if why is not None:
        pytest.skip(f"mosaic_ragged_dot runs the jnp composition here: {why}")


@pytest.mark.parametrize("n,k,m,sizes", [(200, 128, 192, (40, 0, 97, 50)),  # N off 128, 13 rows past the sum
                                         (1024, 256, 512, (300, 1, 0, 500, 223)),
                                         (640, 64, 64, (0, 0, 640))])
def test_edges_against_the_float64_oracle(n, k, m, sizes):
    rng = np.random.default_rng(0)
    g = len(sizes)
    lhs = jnp.asarray(rng.normal(size=(n, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(g, k, m)) / np.sqrt(k), jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(n, m)), jnp.bfloat16)
    _need_kernels(lhs, rhs)
    got = _fwd_bwd(mosaic_ragged_dot)(lhs, rhs, jnp.asarray(sizes, jnp.int32), dy)
    a, b, d = (np.asarray(x, np.float64) for x in (lhs, rhs, dy))
    want = [np.zeros((n, m)), np.zeros((n, k)), np.zeros((g, k, m))]
    s = 0
    for i, c in enumerate(sizes):
        r = slice(s, s + c)
        want[0][r], want[1][r], want[2][i] = a[r] @ b[i], d[r] @ b[i].T, a[r].T @ d[r]
        s += c
    for what, x, y in zip(("out", "d_lhs", "d_rhs"), got, want, strict=True):
        assert x.dtype == jnp.bfloat16, what
        x = np.asarray(x, np.float64)
        assert np.all(np.isfinite(x)), what
        assert np.max(np.abs(x - y)) <= 1e-2 * max(1.0, np.max(np.abs(y))), what
    assert not np.asarray(got[0][sum(sizes):], np.float32).any()
    assert not np.asarray(got[1][sum(sizes):], np.float32).any()


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_mosaic_equals_batched_at_the_full_shapes(name, routing):
    (t, e, k), lhs, rhs, dy = _operands(name)
    _need_kernels(lhs, rhs)
    sizes = _sizes(t, e, k, routing == "skewed")
    args = (lhs, rhs, sizes, dy)
    got = _fwd_bwd(mosaic_ragged_dot)(*args)
    want = _fwd_bwd(batched_ragged_dot)(*args)
    _assert_matches(got, want, f"{name} {routing}")
