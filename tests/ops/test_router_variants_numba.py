"""``backend="numba"`` with the router variants (docs/contract.md sections
9-12), composed around the kernels (gpurouter/_ops/topk.py, aux_loss.py,
losses.py): each result against the jax backend. Tiny shapes: on the CUDA
simulator in CI, on the GPU with ``-m gpu`` runs of this file too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import variant_oracles as vo

import gpurouter as gr
from gpurouter import _backend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _backend.numba_usable(),
                       reason="backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1"),
]


def _tie_free(t, e, seed):
    rng = np.random.default_rng(seed)
    return np.asarray(np.stack([rng.permutation(e) for _ in range(t)]) * (4.0 / e) - 2.0, np.float32)


BIAS = np.asarray(np.linspace(-0.05, 0.05, 8), np.float32)


@pytest.mark.parametrize("rule", ["top2_sum", "max"])
def test_group_score_composes_selection_and_kernel_replay(rule):
    x = _tie_free(4, 8, 0)
    kw = dict(num_groups=4, group_topk=2, score_function="sigmoid", expert_bias=BIAS, group_score=rule,
              return_indices=True)
    got = gr.fused_topk_with_score_function(x, 2, backend="numba", **kw)
    want = gr.fused_topk_with_score_function(x, 2, backend="jax", **kw)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    cot = jnp.arange(8.0, dtype=jnp.float32)[None, :]
    grads = [jax.grad(lambda z, b=b: jnp.sum(gr.fused_topk_with_score_function(
        z, 2, backend=b, **{k: v for k, v in kw.items() if k != "return_indices"})[0] * cot))(x)
        for b in ("numba", "jax")]
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-4, atol=1e-5)


def test_compact_int16_and_qb_histogram_on_numba():
    x = _tie_free(4, 8, 1)
    bounds = np.array([-1.0, 1.0], np.float32)
    kw = dict(score_function="sigmoid", expert_bias=BIAS, compact=True, indices_dtype="int16",
              qb_histogram=np.zeros((8, 6), np.int32), qb_bin_bounds=bounds,
              token_mask=np.array([True, False, True, True]))
    w, ids, hist = gr.fused_topk_with_score_function(x, 3, backend="numba", **kw)
    w_j, ids_j, hist_j = gr.fused_topk_with_score_function(x, 3, backend="jax", **kw)
    assert ids.dtype == np.int16
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_j))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_j), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(hist), np.asarray(hist_j))
    np.testing.assert_array_equal(np.asarray(hist), vo.qb_counts(x, BIAS, 3, 6, bounds,
                                                                 mask=[True, False, True, True]))


def test_masked_and_traced_losses_on_numba():
    rng = np.random.default_rng(2)
    p = np.asarray(rng.random((4, 8)), np.float32)
    tpe = np.asarray(rng.integers(0, 5, 8), np.int32)
    x = np.asarray(rng.normal(size=(4, 8)), np.float32)
    mask = np.array([True, False, True, True])
    got = [jax.jit(lambda q, z, b=b: (gr.fused_moe_aux_loss(q, tpe, 2, 0.1, token_mask=mask, backend=b),
                                      gr.router_z_loss(z, 0.01, token_mask=mask, backend=b)))(p, x)
           for b in ("numba", "jax")]
    for a, b in zip(got[0], got[1], strict=True):
        np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    grads = [jax.grad(lambda z, b=b: gr.router_z_loss(z, 0.01, token_mask=mask, backend=b))(x)
             for b in ("numba", "jax")]
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-4, atol=1e-7)
    assert not np.asarray(grads[0])[~mask].any()
    traced = jax.jit(lambda q, t: gr.fused_moe_aux_loss(q, tpe, 2, 0.1, total_num_tokens=t, backend="numba"))
    plain = gr.fused_moe_aux_loss(p, tpe, 2, 0.1, total_num_tokens=7, backend="jax")
    np.testing.assert_allclose(float(traced(p, jnp.int32(7))), float(plain), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["sum_topk", "top2_sum", "max"])
def test_variants_at_a_deepseek_v3_shape_on_the_gpu(rule):
    """DeepSeek-V3's router (E = 256, K = 8, G = 8, Kg = 4) with QB, compact
    int16 output and a token mask, T = 4096: numba against jax (GPU only:
    far too big for the simulator)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(4096, 256)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(256,)) * 0.01, jnp.float32)
    mask = jnp.asarray(rng.random(4096) > 0.1)
    kw = dict(num_groups=8, group_topk=4, score_function="sigmoid", expert_bias=b, scaling_factor=2.5,
              group_score=rule, compact=True, indices_dtype="int16", token_mask=mask,
              qb_histogram=jnp.zeros((256, 1000), jnp.int32), qb_bin_bounds=jnp.array([-0.5, 0.5]))
    got = jax.jit(lambda z: gr.fused_topk_with_score_function(z, 8, backend="numba", **kw))(x)
    want = jax.jit(lambda z: gr.fused_topk_with_score_function(z, 8, backend="jax", **kw))(x)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    assert int(np.asarray(got[2]).sum()) == 256 * int(mask.sum())
