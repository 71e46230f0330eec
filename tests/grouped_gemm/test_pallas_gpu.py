"""``pallas_ragged_dot`` compiled by Triton on a GPU at the MoE issue's two
full shapes (issue #38): the values and both gradients of
``batched_ragged_dot`` in bf16, balanced and skewed routing (the largest
expert at 4x the mean load). tools/probes/pallas_gemm_sweep.py and
grouped_gemm_probe.py time them (a test checks values)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemm_gpu_helpers import SHAPES
from gemm_gpu_helpers import assert_matches as _assert_matches
from gemm_gpu_helpers import fwd_bwd as _fwd_bwd
from gemm_gpu_helpers import operands as _operands
from gemm_gpu_helpers import sizes as _sizes

from gpurouter.grouped_gemm import pallas_ragged_dot
from gpurouter.reference.grouped_matmul import batched_ragged_dot

# jax 0.11 deprecates Pallas' Triton backend (a DeprecationWarning; pyproject makes warnings errors)
pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")]


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_pallas_equals_batched_at_the_full_shapes(name, routing):
    (t, e, k), lhs, rhs, dy = _operands(name)
    sizes = _sizes(t, e, k, routing == "skewed")
    args = (lhs, rhs, sizes, dy)
    got = _fwd_bwd(pallas_ragged_dot)(*args)
    want = _fwd_bwd(batched_ragged_dot)(*args)
    _assert_matches(got, want, f"{name} {routing}")


@pytest.mark.parametrize("tiles", [dict(block_m=16, block_n=16, block_k=16), {}], ids=["16-tiles", "default-tiles"])
def test_pallas_edges_compiled(tiles):
    """Triton's kernels at the interpreter tests' edges: an empty group, a
    group over several tiles, N, K, M off the tiles (padded), rows past the
    groups (zeros), in bf16 against ``jax.lax.ragged_dot`` in fp32."""
    rng = np.random.default_rng(0)
    n, kk, g, m = 70, 40, 4, 24
    sizes = jnp.asarray([20, 0, 33, 10], jnp.int32)
    lhs = jnp.asarray(rng.normal(size=(n, kk)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(g, kk, m)) / np.sqrt(kk), jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(n, m)), jnp.bfloat16)
    got = _fwd_bwd(functools.partial(pallas_ragged_dot, interpret=False, **tiles))(lhs, rhs, sizes, dy)
    with jax.default_matmul_precision("float32"):
        want = _fwd_bwd(jax.lax.ragged_dot)(*(x.astype(jnp.float32) for x in (lhs, rhs)), sizes,
                                            dy.astype(jnp.float32))
    for what, a, b in zip(("out", "d_lhs", "d_rhs"), got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.max(np.abs(b)), err_msg=what)
    assert np.all(np.asarray(got[0], np.float32)[63:] == 0)
    assert np.all(np.asarray(got[2], np.float32)[1] == 0)
