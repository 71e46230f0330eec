"""The edges of docs/contract.md sections 2 and 3 (issue 40's W1-W5), on every
backend, each against the float64 NumPy oracle (gpurouter/testing/oracle.py): the z-loss
at any logit magnitude and at overflow, replay indices with repeats and
out-of-range entries, NaN logits off the routing map, subnormal scores and
logits. Tiny shapes: the numba cases run on the CUDA simulator in CI and on
the GPU with ``-m gpu`` deselected or not (they are ``cuda`` tests)."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from public_helpers import BACKENDS
from public_helpers import backend_kw as _backend_kw

import gpurouter as gr
from gpurouter.reference.topk import sqrtsoftplus
from gpurouter.testing import oracle as oracles
from gpurouter.testing.tolerances import assert_close

TOPK_BACKENDS = BACKENDS[:2]  # jax and numba (the auto transport): the edges are not per transport


# ----------------------------------------------------------------------------
# W1, W2: the z-loss backward at any logit magnitude; overflow to inf
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
@pytest.mark.parametrize("scale", [1e2, 1e4, 1e8, 1e30])
def test_z_loss_grad_accurate_at_any_magnitude(backend, scale):
    rng = np.random.default_rng(int(math.log10(scale)))
    # logits within a few units of `scale` (multiples of its fp32 spacing), so
    # that the softmax is spread and every term matters
    ulp = float(np.spacing(np.float32(scale)))
    x = (np.float64(scale) + max(ulp, 1.0) * rng.integers(-2, 3, (3, 16))).astype(np.float32)
    x[1] = scale  # a row of ties: softmax exactly 1/E
    x[2, :8] = -np.inf  # half masked
    xj = jnp.asarray(x)
    grad = jax.grad(lambda z: gr.router_z_loss(z, 1e-3, **_backend_kw(backend)))(xj)
    want = oracles.z_loss_grad(x, 1e-3)
    # the contract's tolerance, its atol scaled by the gradient's size (which grows with lse)
    atol = 1e-5 * math.sqrt(16) * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(grad, np.float64), want, rtol=1e-4, atol=atol)
    if scale == 1e8:  # the case: 2 coeff / T * lse / E with T = 3
        assert float(grad[1, 0]) == pytest.approx(2e-3 / 3 * 1e8 / 16, rel=1e-5)


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
def test_z_loss_of_bf16_max_logits_is_inf_with_a_finite_gradient(backend):
    big = float(jnp.finfo(jnp.bfloat16).max)  # 3.3895e38
    x = jnp.full((2, 16), big, jnp.bfloat16)
    loss, grad = jax.value_and_grad(lambda z: gr.router_z_loss(z, 1e-3, **_backend_kw(backend)))(x)
    assert math.isinf(float(loss)) and float(loss) > 0  # lse^2 overflows fp32, as jnp gives
    g = np.asarray(grad, np.float64)
    assert np.isfinite(g).all()
    want = oracles.z_loss_grad(np.asarray(x, np.float32), 1e-3)
    assert want[0, 0] == pytest.approx(2.1e34, rel=0.01)
    np.testing.assert_allclose(g, want, rtol=1e-2)  # the bf16 gradient's tolerance


# ----------------------------------------------------------------------------
# W3: replay indices are the map's experts (-1 for an entry selecting nothing)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
def test_replay_indices_under_jit_are_the_maps_experts(backend, sf):
    x = jnp.asarray(np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8))
    forced = jnp.asarray([[1, 1, 9, 3], [7, -2, 0, 7]], jnp.int32)
    probs, rmap, idx = jax.jit(lambda a, f: gr.fused_topk_with_score_function(
        a, 4, score_function=sf, forced_indices=f, return_indices=True, **_backend_kw(backend)))(x, forced)
    np.testing.assert_array_equal(np.asarray(idx), [[1, -1, -1, 3], [7, -1, 0, -1]])
    want_map = np.zeros((2, 8), bool)
    want_map[0, [1, 3]] = want_map[1, [0, 7]] = True
    np.testing.assert_array_equal(np.asarray(rmap), want_map)
    # the indices mark exactly the map: every valid one on it, one per expert
    idx = np.asarray(idx)
    for t in range(2):
        valid = idx[t][idx[t] >= 0]
        assert sorted(valid.tolist()) == np.flatnonzero(want_map[t]).tolist()
    # the probs of the replay are those of the oracle's weights on that map
    for t in range(2):
        sel = np.flatnonzero(want_map[t]).tolist()
        w = oracles.weights_given_map(np.asarray(x[t], np.float64), sel, 4, False, sf, 1.0)
        assert_close(np.asarray(probs[t]), w, "probs", "float32")


# ----------------------------------------------------------------------------
# W4: NaN logits off the map get gradient 0 on every backend
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
@pytest.mark.parametrize("sf", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_nan_logit_off_the_map_gets_zero_gradient(backend, sf):
    x = np.array([[np.nan, 1, 2, 3], [0.5, np.nan, -1, 2]], np.float32)
    w = np.array([[0.3, -1.0, 0.7, 2.0], [1.5, 0.2, -0.4, 0.9]], np.float32)

    def loss(a):
        p, _ = gr.fused_topk_with_score_function(a, 2, score_function=sf, **_backend_kw(backend))
        return jnp.sum(p * w)

    grad = np.asarray(jax.grad(loss)(jnp.asarray(x)), np.float64)
    assert grad[0, 0] == 0.0 and grad[1, 1] == 0.0
    # the oracle on the same rows (NaN selects as -inf, so it is off the map)
    finite = np.where(np.isnan(x), -1e30, x)
    _, m, saved = oracles.topk_fwd(finite, 2, score_function=sf)
    want = oracles.topk_bwd(m, saved, w, 2, score_function=sf)
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-5 * 2)


# ----------------------------------------------------------------------------
# W5: subnormals; sqrtsoftplus below -87.3 as exp(x / 2)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", TOPK_BACKENDS)
def test_sqrtsoftplus_of_very_negative_logits(backend):
    x = np.array([[-95, -100, -90, -88, -80, -120, -150, -170]], np.float32)
    probs, rmap, idx = gr.fused_topk_with_score_function(
        jnp.asarray(x), 4, score_function="sqrtsoftplus", return_indices=True, **_backend_kw(backend))
    np.testing.assert_array_equal(np.asarray(idx), [[4, 3, 2, 0]])
    want, want_map, _ = oracles.topk_fwd(x, 4, score_function="sqrtsoftplus")
    np.testing.assert_array_equal(np.asarray(rmap), want_map)
    assert_close(np.asarray(probs), want, "probs", "float32")
    # the scores themselves: sqrt(softplus(-95)) = 2.3e-21, a normal fp32 number
    s = np.asarray(sqrtsoftplus(jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(s, [[oracles.sqrtsoftplus(v) for v in x[0]]], rtol=2e-6)
    assert s[0, 0] == pytest.approx(2.3e-21, rel=0.02)


_SIMULATOR_FLUSHES = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
    reason="the simulator runs the kernels' fp32 arithmetic in Python on XLA:CPU's callback thread, "
    "whose FTZ/DAZ flags flush subnormals; the kernels called directly are tested below")


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=[*BACKENDS[1].marks, _SIMULATOR_FLUSHES])])
def test_subnormal_logits_order_by_value(backend):
    x = np.array([[1e-40, 2e-40, 3e-40, 0.0, -0.0, -1e-40]], np.float32)
    assert x[0, 2] > x[0, 1] > 0  # NumPy keeps the subnormals
    _, rmap, idx = gr.fused_topk_with_score_function(
        jnp.asarray(x), 3, return_indices=True, **_backend_kw(backend))
    np.testing.assert_array_equal(np.asarray(idx), [[2, 1, 0]])
    _, want_map, _ = oracles.topk_fwd(x, 3)
    np.testing.assert_array_equal(np.asarray(rmap), want_map)


@pytest.mark.cuda
def test_subnormal_logits_order_by_value_in_the_kernels():
    from gpurouter.kernels.topk.plans import topk_with_score_function_fwd

    x = np.array([[1e-40, 2e-40, 3e-40, 0.0, -0.0, -1e-40]], np.float32)
    _, rmap, _, idx = topk_with_score_function_fwd(x, 3, return_indices=True)
    np.testing.assert_array_equal(np.asarray(idx), [[2, 1, 0]])
    np.testing.assert_array_equal(np.asarray(rmap), oracles.topk_fwd(x, 3)[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_experts", [6, 8])  # the streaming backward (E % 4 != 0), the quad one
@pytest.mark.parametrize("compute_aux_scores", [False, True])
def test_all_zero_scores_get_a_zero_gradient(backend, num_experts, compute_aux_scores, request):
    """Contract section 3: where every selected sigmoid score is 0 (a row of -inf, or of
    logits whose sigmoid underflows), the derivative is 0 on every backend, not 0 / 0.

    Known failure (found 2026-11-29, not yet mended: a kernel change needs a seeds
    remake on the GPU): the streaming backward (``kernels/topk/bwd_stream.py``) divides
    by ``(S + eps)**2``, which the simulator's arithmetic (XLA:CPU's callback thread,
    FTZ) flushes to 0, so numba gives NaN at E = 6 there."""
    if backend == "numba" and num_experts % 4 and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        # strict: once the kernel is mended this passes, and the marker must go
        request.applymarker(pytest.mark.xfail(strict=True, reason="bwd_stream's (S + eps)**2 flushes to 0 on "
                                              "the simulator: NaN (docstring)"))
    for value in (-np.inf, -200.0):
        x = jnp.full((1, num_experts), value, jnp.float32)

        def probs(v):
            return gr.fused_topk_with_score_function(v, 2, score_function="sigmoid",
                                                     compute_aux_scores=compute_aux_scores,
                                                     **_backend_kw(backend))[0]

        dx = jax.vjp(probs, x)[1](jnp.zeros((1, num_experts), jnp.float32))[0]
        np.testing.assert_array_equal(np.asarray(dx), np.zeros((1, num_experts), np.float32))
