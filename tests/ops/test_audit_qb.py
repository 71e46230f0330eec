"""An independent audit of issue #37's Quantile Balancing (docs/contract.md
section 12) through the public API, on ``backend="jax"`` and ``"numba"``
(the CUDA simulator in CI: tiny shapes): the route, probs, cutoff and
counts, the bias update, the errors; and on a GPU the warp kernel's paths
(the group rules, compact mode and the route's QB cutoff).

The sources, and where the tests follow the contract instead: ``tests/audit_oracles.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from audit_oracles import (
    BACKENDS,
    INT32_MAX,
    _clean_logits,
    _counts,
    _positions,
    _qb_bias_update,
    _sig,
    _sigmoid_grad,
    _sigmoid_router,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gpurouter as gr
from gpurouter import _backend

# --------------------------------------------------------------------------- QB: route, probs, cutoff, counts

E, K, NB = 12, 3, 10
BIAS = np.asarray(np.linspace(-0.2, 0.25, E)[::-1], np.float32)
BOUNDS = np.array([-0.2, 0.6], np.float32)


def _shape(backend):
    return (8, E)   # one shape for most QB calls: the jax backend compiles each (shape, config) once


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_route_probs_and_counts_bit_for_bit(backend):
    """TE #3395: the route is the plain top-k of s + b, the probs sigmoid's; every (token,
    expert) adds one count to bin floor((alpha_t - s - lower) * B / (upper - lower)), clamped."""
    t, e = _shape(backend)
    x = _clean_logits(t, e, 11, BIAS, K, BOUNDS, NB)
    probs, rmap, hist = gr.fused_topk_with_score_function(
        x, K, score_function="sigmoid", expert_bias=BIAS, scaling_factor=1.5,
        qb_histogram=np.zeros((e, NB), np.int32), qb_bin_bounds=BOUNDS, backend=backend)
    want_p, want_m, _, _ = _sigmoid_router(x, K, BIAS, scaling=1.5)
    want_h = _counts(_positions(x, BIAS, K, BOUNDS, NB), NB)
    np.testing.assert_array_equal(np.asarray(rmap), want_m)
    np.testing.assert_allclose(np.asarray(probs), want_p, rtol=1e-5, atol=1e-6)
    assert hist.dtype == np.int32 and hist.shape == (e, NB)
    np.testing.assert_array_equal(np.asarray(hist), want_h)
    assert (want_h[:, 0] > 0).any() and (want_h[:, -1] > 0).any(), "the draw should reach both end bins"
    np.testing.assert_array_equal(np.asarray(hist).sum(1), np.full(e, t))


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_exact_bin_edges(backend):
    """Dyadic scores (sigmoid(0) = 0.5, sigmoid(30) = 1, sigmoid(-inf) = 0) put rb exactly on
    bin edges: an edge belongs to the bin above it (floor), rb == upper and beyond go to
    B - 1, rb == lower to bin 0, rb below lower to bin 0."""
    # lower -1, upper 1, B 8: bin width 0.25, scale 4 exactly.
    bounds = np.array([-1.0, 1.0], np.float32)
    bias = np.array([0.0, -0.25, 0.5, 0.0, -1.0, 0.75], np.float32)
    x = np.array([[0.0, 0.0, 0.0, 30.0, -np.inf, 0.0],
                  [30.0, -np.inf, 0.0, 0.0, 30.0, -np.inf]], np.float32)
    _, _, hist = gr.fused_topk_with_score_function(
        x, 2, score_function="sigmoid", expert_bias=bias,
        qb_histogram=np.zeros((6, 8), np.int32), qb_bin_bounds=bounds, backend=backend)
    s = _sig(x).astype(np.float32).astype(np.float64)   # 1.0 at x = 30 in float32, not 1 - 9e-14
    r = s + bias
    want = np.zeros((6, 8), np.int64)
    for t in range(2):
        alpha = sorted(r[t], reverse=True)[2]
        for j in range(6):
            rb = alpha - s[t, j]   # exact in binary: every term is a multiple of 1/4
            want[j, int(min(max(np.floor((rb + 1.0) * 4), 0), 7))] += 1
    np.testing.assert_array_equal(np.asarray(hist), want)
    # token 0: s = [.5, .5, .5, 1, 0, .5], r = [.5, .25, 1, 1, -1, 1.25], alpha = 1,
    # rb = [.5, .5, .5, 0, 1, .5] -> (rb + 1) * 4 = [6, 6, 6, 4, 8, 6]: on the edges, 8 (rb ==
    # upper) clamped to 7; token 1: s = [1, 0, .5, .5, 1, 0], r = [1, -.25, 1, .5, 0, .75],
    # alpha = .75, rb = [-.25, .75, .25, .25, -.25, .75] -> bins [3, 7, 5, 5, 3, 7]
    by_hand = np.zeros((6, 8), np.int64)
    for j, (b0, b1) in enumerate(zip([6, 6, 6, 4, 7, 6], [3, 7, 5, 5, 3, 7], strict=True)):
        by_hand[j, b0] += 1
        by_hand[j, b1] += 1
    np.testing.assert_array_equal(want, by_hand)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_end_bins_catch_everything_outside(backend):
    """rb == upper, rb far above and far below the bounds: clamped into the end bins."""
    bounds = np.array([-0.5, 0.5], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 0.0], np.float32)
    # token: s = [1, 1, .5, 0]; alpha = .5 (K = 2); rb = [-.5, -.5, 0, .5]:
    # rb == lower -> bin 0, rb == upper -> bin B - 1 (clamped from B).
    x = np.array([[30.0, 30.0, 0.0, -np.inf]], np.float32)
    _, _, hist = gr.fused_topk_with_score_function(
        x, 2, score_function="sigmoid", expert_bias=bias,
        qb_histogram=np.zeros((4, 4), np.int32), qb_bin_bounds=bounds, backend=backend)
    want = np.zeros((4, 4), np.int64)
    want[0, 0] = want[1, 0] = want[2, 2] = want[3, 3] = 1
    np.testing.assert_array_equal(np.asarray(hist), want)
    # far outside: tight bounds around 10, every rb below lower -> bin 0
    _, _, hist = gr.fused_topk_with_score_function(
        x, 2, score_function="sigmoid", expert_bias=bias,
        qb_histogram=np.zeros((4, 4), np.int32), qb_bin_bounds=np.array([10.0, 11.0], np.float32),
        backend=backend)
    want = np.zeros((4, 4), np.int64)
    want[:, 0] = 1
    np.testing.assert_array_equal(np.asarray(hist), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_cutoff_tie_drops_the_higher_expert_id(backend):
    """TE's test_qb_topk_plus_one_tie_and_bin_clamping: three equal logits with k = 2 route
    experts 0 and 1 (the tie at the cutoff drops the largest id); the cutoff is the tied
    value, so the three tied experts need rb = 0."""
    x = np.array([[0.5, 0.5, 0.5, -3.0]], np.float32)
    bias = np.zeros(4, np.float32)
    probs, rmap, ids, hist = gr.fused_topk_with_score_function(
        x, 2, score_function="sigmoid", expert_bias=bias, return_indices=True,
        qb_histogram=np.zeros((4, 4), np.int32), qb_bin_bounds=np.array([-1.0, 1.0], np.float32),
        backend=backend)
    np.testing.assert_array_equal(np.asarray(rmap), [[True, True, False, False]])
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1]])
    np.testing.assert_allclose(np.asarray(probs), [[0.5, 0.5, 0.0, 0.0]], rtol=1e-6)
    # rb = 0 -> bin floor(1 * 2) = 2 for experts 0-2; expert 3: rb = s(.5) - s(-3) = .575 -> bin 3
    want = np.zeros((4, 4), np.int64)
    want[0, 2] = want[1, 2] = want[2, 2] = want[3, 3] = 1
    np.testing.assert_array_equal(np.asarray(hist), want)
    # a tie in r between experts of different s (the bias makes it): the lower id stays in
    # the route whichever side it is on, and the cutoff is the tied value (rb from each s)
    x = np.array([[0.0, 30.0, 30.0, -np.inf], [30.0, 30.0, 0.0, -np.inf]], np.float32)
    bias = np.array([[0.5, 0.25, 0.0, 0.0], [0.0, 0.25, 0.5, 0.0]], np.float32)
    for row in range(2):   # r = [1, 1.25, 1, 0] in both rows
        probs, ids, hist = gr.fused_topk_with_score_function(
            x[row:row + 1], 2, score_function="sigmoid", expert_bias=bias[row], compact=True,
            qb_histogram=np.zeros((4, 8), np.int32), qb_bin_bounds=np.array([-1.0, 1.0], np.float32),
            backend=backend)
        np.testing.assert_array_equal(np.asarray(ids), [[1, 0]])
        s0 = 0.5 if row == 0 else 1.0
        np.testing.assert_allclose(np.asarray(probs), [[1 / (1 + s0), s0 / (1 + s0)]], rtol=1e-6)
        rb = 1.0 - np.array([0.5, 1.0, 1.0, 0.0]) if row == 0 else 1.0 - np.array([1.0, 1.0, 0.5, 0.0])
        want = np.zeros((4, 8), np.int64)
        want[np.arange(4), np.minimum(np.floor((rb + 1) * 4).astype(int), 7)] = 1
        np.testing.assert_array_equal(np.asarray(hist), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_accumulates_the_input_histogram_and_masks_count_nowhere(backend):
    """The returned histogram is the input's counts plus this call's; masked tokens add no
    counts and are routed as usual (issue #37, beyond TE)."""
    t, e = _shape(backend)
    x = _clean_logits(t, e, 12, BIAS, K, BOUNDS, NB)
    start = np.asarray(np.random.default_rng(0).integers(0, 50, (e, NB)), np.int32)
    valid = np.zeros(t, bool)
    valid[[0, 2, 3, t - 1]] = True
    kw = dict(score_function="sigmoid", expert_bias=BIAS, qb_bin_bounds=BOUNDS, backend=backend)
    probs, rmap, hist = gr.fused_topk_with_score_function(x, K, qb_histogram=start, token_mask=valid, **kw)
    want = start + _counts(_positions(x, BIAS, K, BOUNDS, NB), NB, valid)
    np.testing.assert_array_equal(np.asarray(hist), want)
    np.testing.assert_array_equal(np.asarray(hist).sum(1) - start.sum(1), np.full(e, valid.sum()))
    want_p, want_m, _, _ = _sigmoid_router(x, K, BIAS)
    np.testing.assert_array_equal(np.asarray(rmap), want_m)       # masked rows routed too
    np.testing.assert_allclose(np.asarray(probs), want_p, rtol=1e-5, atol=1e-6)
    # the mask in the tokens' shape [..., T] equals the flat one
    x3 = x.reshape(2, t // 2, e)
    _, _, hist3 = gr.fused_topk_with_score_function(x3, K, qb_histogram=start,
                                                    token_mask=valid.reshape(2, t // 2), **kw)
    np.testing.assert_array_equal(np.asarray(hist3), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_no_valid_tokens_adds_nothing(backend):
    """All tokens masked, or no tokens: the histogram comes back unchanged."""
    start = np.asarray(np.arange(E * NB).reshape(E, NB) % 7, np.int32)
    kw = dict(score_function="sigmoid", expert_bias=BIAS, qb_histogram=start, qb_bin_bounds=BOUNDS,
              backend=backend)
    x = _clean_logits(8, E, 19, BIAS, K, BOUNDS, NB)
    _, rmap, hist = gr.fused_topk_with_score_function(x, K, token_mask=np.zeros(8, bool), **kw)
    np.testing.assert_array_equal(np.asarray(hist), start)
    assert np.asarray(rmap).sum() == 8 * K
    _, _, hist = gr.fused_topk_with_score_function(np.zeros((0, E), np.float32), K, **kw)
    np.testing.assert_array_equal(np.asarray(hist), start)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_result_layouts(backend):
    """The histogram is the last result: (probs, map, [indices,] hist), (weights, ids, hist)."""
    t, e = _shape(backend)
    x = _clean_logits(t, e, 13, BIAS, K, BOUNDS, NB)
    kw = dict(score_function="sigmoid", expert_bias=BIAS, qb_histogram=np.zeros((e, NB), np.int32),
              qb_bin_bounds=BOUNDS, backend=backend)
    want_p, _, want_ids, _ = _sigmoid_router(x, K, BIAS)
    want_h = _counts(_positions(x, BIAS, K, BOUNDS, NB), NB)
    out = gr.fused_topk_with_score_function(x, K, return_indices=True, **kw)
    assert len(out) == 4
    np.testing.assert_array_equal(np.asarray(out[2]), want_ids)
    np.testing.assert_array_equal(np.asarray(out[3]), want_h)
    w, ids, hist = gr.fused_topk_with_score_function(x, K, compact=True, indices_dtype="int16", **kw)
    assert ids.dtype == np.int16 and w.shape == (t, K) and w.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(want_p, want_ids, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(hist), want_h)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_gradients_are_the_sigmoid_backward_only(backend):
    """Gradients: the sigmoid backward to the logits; the bias and the bounds get none."""
    t, e = _shape(backend)
    x = _clean_logits(t, e, 14, BIAS, K, BOUNDS, NB)
    cot = np.asarray(np.random.default_rng(1).normal(size=(t, e)), np.float32)
    hist0 = np.zeros((e, NB), np.int32)

    def f(z, b, bounds):
        p = gr.fused_topk_with_score_function(z, K, score_function="sigmoid", expert_bias=b, scaling_factor=2.0,
                                              qb_histogram=hist0, qb_bin_bounds=bounds, backend=backend)[0]
        return jnp.sum(p * cot)

    gx, gb, gbd = jax.grad(f, argnums=(0, 1, 2))(x, BIAS, BOUNDS)
    _, rmap, _, _ = _sigmoid_router(x, K, BIAS)
    np.testing.assert_allclose(np.asarray(gx), _sigmoid_grad(x, rmap, cot, 2.0), rtol=1e-4, atol=1e-5 * np.sqrt(e))
    np.testing.assert_array_equal(np.asarray(gb), np.zeros(e))
    np.testing.assert_array_equal(np.asarray(gbd), np.zeros(2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", [pytest.param("sum_topk", marks=pytest.mark.slow), "top2_sum",
                                  pytest.param("max", marks=pytest.mark.slow)])
def test_qb_group_limited_cutoff_among_kept_groups(backend, rule):
    """Group-limited QB (issue #37, beyond TE): the route is group-limited and the cutoff is
    the (K+1)-th largest r among the kept groups' experts, for every group-score rule (one
    in the fast suite: the three cost 10 s on the simulator)."""
    t, e = (4 if backend == "numba" else 8), 16
    bias = np.asarray(np.linspace(0.1, -0.1, e), np.float32)
    g = (4, 2, 4, rule)
    x = _clean_logits(t, e, 15, bias, 4, BOUNDS, NB, groups=g)
    probs, rmap, hist = gr.fused_topk_with_score_function(
        x, 4, num_groups=4, group_topk=2, group_score=rule, score_function="sigmoid", expert_bias=bias,
        qb_histogram=np.zeros((e, NB), np.int32), qb_bin_bounds=BOUNDS, backend=backend)
    want_p, want_m, _, _ = _sigmoid_router(x, 4, bias, groups=g)
    np.testing.assert_array_equal(np.asarray(rmap), want_m)
    np.testing.assert_allclose(np.asarray(probs), want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(hist), _counts(_positions(x, bias, 4, BOUNDS, NB, g), NB))
    differs = not np.array_equal(_positions(x, bias, 4, BOUNDS, NB, g), _positions(x, bias, 4, BOUNDS, NB))
    assert differs, "the draws should have a cutoff outside the kept groups"


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_bf16_logits(backend):
    """bf16 logits: s is the sigmoid of the upcast logits; probs in bf16."""
    t, e = 4, 16
    bias = np.asarray(np.linspace(-0.1, 0.1, e), np.float32)
    x = jnp.asarray(_clean_logits(t, e, 18, bias, 2, BOUNDS, NB), jnp.bfloat16)
    x32 = np.asarray(x, np.float32)
    if np.min(np.abs(_positions(x32, bias, 2, BOUNDS, NB) % 1 - 0.5)) > 0.499:
        pytest.fail("the bf16 rounding put a position on an edge: pick another seed")
    probs, rmap, hist = gr.fused_topk_with_score_function(
        x, 2, score_function="sigmoid", expert_bias=bias, qb_histogram=np.zeros((e, NB), np.int32),
        qb_bin_bounds=BOUNDS, backend=backend)
    assert probs.dtype == jnp.bfloat16
    want_p, want_m, _, _ = _sigmoid_router(x32, 2, bias)
    np.testing.assert_array_equal(np.asarray(rmap), want_m)
    np.testing.assert_allclose(np.asarray(probs, np.float32), want_p, rtol=8e-3, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(hist), _counts(_positions(x32, bias, 2, BOUNDS, NB), NB))


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_nan_logits_and_topk_one(backend):
    """NaN counts as -inf in the route and the cutoff; a NaN rb goes to bin 0 (contract
    section 12). K = 1: the prob is the raw sigmoid (no renormalisation)."""
    bounds = np.array([-1.0, 1.0], np.float32)
    bias = np.zeros(4, np.float32)
    x = np.array([[1.0, np.nan, -0.5, 0.25],      # NaN expert: never chosen, its rb NaN -> bin 0
                  [np.nan, np.nan, 2.0, 0.0]], np.float32)   # the cutoff (K + 1 = 2nd) is finite
    probs, rmap, hist = gr.fused_topk_with_score_function(
        x, 1, score_function="sigmoid", expert_bias=bias, qb_histogram=np.zeros((4, 4), np.int32),
        qb_bin_bounds=bounds, backend=backend)
    np.testing.assert_array_equal(np.asarray(rmap), [[1, 0, 0, 0], [0, 0, 1, 0]])
    np.testing.assert_allclose(np.asarray(probs)[[0, 1], [0, 2]], _sig([1.0, 2.0]), rtol=1e-6)
    s = _sig(x)
    want = np.zeros((4, 4), np.int64)
    for t, alpha in ((0, s[0, 3]), (1, s[1, 3])):
        for j in range(4):
            pos = (alpha - s[t, j] + 1.0) * 2
            want[j, 0 if np.isnan(pos) else int(np.clip(np.floor(pos), 0, 3))] += 1
    np.testing.assert_array_equal(np.asarray(hist), want)
    assert want[1, 0] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_counts_saturate_instead_of_wrapping(backend):
    """Counts cannot overflow silently (contract section 12: a bin saturates at 2**31 - 1):
    a full bin stays full, one a count below it fills, and none wraps negative."""
    x = np.array([[0.0, 1.0, -1.0, 2.0]], np.float32)   # the end-bins test's shapes (one compile)
    bias = np.zeros(4, np.float32)
    bounds = np.array([-1.0, 1.0], np.float32)
    start = np.full((4, 4), INT32_MAX, np.int32)
    start[:, 1::2] = INT32_MAX - 1
    _, _, hist = gr.fused_topk_with_score_function(
        x, 2, score_function="sigmoid", expert_bias=bias, qb_histogram=start, qb_bin_bounds=bounds,
        backend=backend)
    h = np.asarray(hist)
    add = _counts(_positions(x, bias, 2, bounds, 4), 4)
    assert (add[:, 0::2] > 0).any() and (add[:, 1::2] > 0).any()
    np.testing.assert_array_equal(h, np.minimum(start.astype(np.int64) + add, INT32_MAX))
    assert (h >= 0).all()


@pytest.mark.parametrize("backend", ["jax", pytest.param("numba", marks=[
    pytest.mark.slow, pytest.mark.cuda,
    pytest.mark.skipif(not _backend.numba_usable(), reason="backend='numba' needs numba-cuda and a GPU or "
                       "NUMBA_ENABLE_CUDASIM=1")])])
def test_qb_axis_name_sums_this_calls_counts_once(backend):
    """axis_name=: inside shard_map over data shards, the call's counts (not the input
    histogram) are summed once; every shard returns the same global histogram."""
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 JAX devices (tests/conftest.py asks for 8 host devices)")
    mesh = jax.make_mesh((4,), ("data",), devices=devices[:4])
    t, e = 16, E
    x = _clean_logits(t, e, 16, BIAS, K, BOUNDS, NB)
    start = np.asarray(np.random.default_rng(2).integers(0, 9, (e, NB)), np.int32)
    valid = np.arange(t) % 3 != 1

    def shard(z, m):
        _, _, h = gr.fused_topk_with_score_function(z, K, score_function="sigmoid", expert_bias=BIAS,
                                                    qb_histogram=start, qb_bin_bounds=BOUNDS, token_mask=m,
                                                    axis_name="data", backend=backend)
        return h[None]

    sm = jax.shard_map(shard, mesh=mesh, in_specs=(P("data", None), P("data")), out_specs=P("data"))
    with jax.set_mesh(mesh):
        hs = np.asarray(jax.jit(sm)(jax.device_put(x, NamedSharding(mesh, P("data", None))),
                                    jax.device_put(valid, NamedSharding(mesh, P("data")))))
    want = start + _counts(_positions(x, BIAS, K, BOUNDS, NB), NB, valid)
    for h in hs:
        np.testing.assert_array_equal(h, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qb_traced_bad_bounds_give_the_documented_bins(backend):
    """A traced bad bound never raises: NaN bounds put every count in bin 0, inverted ones
    give the formula's bins, clamped; every valid token adds one count per expert row."""
    bias = BIAS[:6]
    inv = np.array([0.75, -1.25], np.float32)   # upper < lower: a negative scale
    x = _clean_logits(4, 6, 17, bias, 2, inv, 5)

    @jax.jit
    def call(bounds):
        return gr.fused_topk_with_score_function(x, 2, score_function="sigmoid", expert_bias=bias,
                                                 qb_histogram=jnp.zeros((6, 5), jnp.int32),
                                                 qb_bin_bounds=bounds, backend=backend)[2]

    h_nan = np.asarray(call(jnp.array([np.nan, 1.0], jnp.float32)))
    want = np.zeros((6, 5), np.int64)
    want[:, 0] = 4
    np.testing.assert_array_equal(h_nan, want)
    np.testing.assert_array_equal(np.asarray(call(jnp.asarray(inv))), _counts(_positions(x, bias, 2, inv, 5), 5))


# --------------------------------------------------------------------------- QB: the bias update

_qb_update_jit = jax.jit(gr.qb_update_expert_bias, static_argnums=2)   # one compile a shape (eager: one a primitive)


def test_qb_update_matches_megatron_6637_example():
    """Megatron's test_qb_histogram_recovery: [[0,2,2,0],[2,2,0,0]], bounds [-1, 1], topk 1
    -> bias [0.25, -0.25], bounds [-1.25, 1.25]."""
    bias, bounds = _qb_update_jit(jnp.array([[0, 2, 2, 0], [2, 2, 0, 0]], jnp.int32),
                                  jnp.array([-1.0, 1.0], jnp.float32), 1)
    np.testing.assert_allclose(np.asarray(bias), [0.25, -0.25], rtol=0, atol=1e-7)
    np.testing.assert_allclose(np.asarray(bounds), [-1.25, 1.25], rtol=0, atol=1e-7)
    assert bias.dtype == np.float32 and bounds.dtype == np.float32


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_qb_update_quantile_interpolated_centred(seed):
    """Per expert the k/E quantile, linear inside its bin, then minus the mean; next bounds
    [min - 1, max + 1]; also under jit."""
    rng = np.random.default_rng(seed)
    e, b, k = 8, 13, 3
    hist = np.asarray(rng.integers(0, 40, (e, b)) * (rng.random((e, b)) < 0.6), np.int32)
    hist[:, 0] += 1     # no empty row
    bounds = np.array([-0.8, 1.3], np.float32)
    want_b, want_bd = _qb_bias_update(hist, bounds, k)
    for fn in (gr.qb_update_expert_bias, _qb_update_jit):
        bias, bd = fn(jnp.asarray(hist), jnp.asarray(bounds), k)
        np.testing.assert_allclose(np.asarray(bias), want_b, rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.asarray(bd), want_bd, rtol=0, atol=2e-6)
    assert abs(float(np.mean(np.asarray(bias, np.float64)))) < 1e-6


@pytest.mark.slow   # 5 s on a CPU; the formula itself is checked by the two tests above
def test_qb_update_bias_is_the_quantile_of_the_needed_bias():
    """The point of the update: b_e is the k/E quantile of expert e's "bias needed to win",
    rb = alpha_t - s[t, e], up to the one centring shift shared by every expert. Within two
    bin widths of NumPy's quantile."""
    rng = np.random.default_rng(5)
    t, e, k, b = 2000, 8, 2, 200
    x = np.asarray(rng.normal(size=(t, e)) + np.linspace(-1, 1, e), np.float32)   # imbalanced
    bias0 = np.zeros(e, np.float32)
    bounds = np.array([-2.0, 2.0], np.float32)
    _, _, hist = gr.fused_topk_with_score_function(x, k, score_function="sigmoid", expert_bias=bias0,
                                                   qb_histogram=np.zeros((e, b), np.int32),
                                                   qb_bin_bounds=bounds, backend="jax")
    bias, _ = gr.qb_update_expert_bias(hist, bounds, k)
    rb = _sigmoid_router(x, k, bias0)[3][:, None] - _sig(x)
    quant = np.array([np.quantile(rb[:, j], k / e) for j in range(e)])
    shift = np.asarray(bias, np.float64) - quant
    np.testing.assert_allclose(shift, shift.mean(), atol=2 * 4.0 / b)
    assert np.ptp(quant) > 0.2, "the draw should be imbalanced"


def test_qb_update_empty_histogram():
    """An empty histogram and no current bias: a zero bias and bounds [-1, 1] (contract section 12)."""
    bias, bounds = _qb_update_jit(jnp.zeros((5, 7), jnp.int32), jnp.array([-3.0, 2.0]), 2)
    np.testing.assert_array_equal(np.asarray(bias), np.zeros(5))
    np.testing.assert_array_equal(np.asarray(bounds), [-1.0, 1.0])


def test_qb_update_empty_histogram_keeps_the_given_bias_and_bounds():
    """Megatron's test_qb_empty_histogram_preserves_bias_and_bounds: with the current bias
    given, an empty histogram changes nothing (eager and under jit); a non-empty one
    replaces the bias whatever it was."""
    bias0 = jnp.array([0.25, -0.25], jnp.float32)
    bounds0 = jnp.array([-2.0, 3.0], jnp.float32)
    for fn in (gr.qb_update_expert_bias, _qb_update_jit):
        bias, bounds = fn(jnp.zeros((2, 4), jnp.int32), bounds0, 1, bias0)
        np.testing.assert_array_equal(np.asarray(bias), np.asarray(bias0))
        np.testing.assert_array_equal(np.asarray(bounds), np.asarray(bounds0))
        assert bias.dtype == np.float32 and bounds.dtype == np.float32
        hist = jnp.array([[0, 2, 2, 0], [2, 2, 0, 0]], jnp.int32)
        got = fn(hist, jnp.array([-1.0, 1.0]), 1, jnp.array([5.0, -7.0], jnp.bfloat16))
        want = fn(hist, jnp.array([-1.0, 1.0]), 1)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_qb_update_errors_name_the_argument():
    h = jnp.zeros((4, 5), jnp.int32)
    with pytest.raises(ValueError, match="topk"):
        gr.qb_update_expert_bias(h, jnp.array([-1.0, 1.0]), 4)
    with pytest.raises(ValueError, match="topk"):
        gr.qb_update_expert_bias(h, jnp.array([-1.0, 1.0]), 0)
    with pytest.raises(TypeError, match="histogram"):
        gr.qb_update_expert_bias(h.astype(jnp.float32), jnp.array([-1.0, 1.0]), 1)
    with pytest.raises(ValueError, match="expert_bias"):
        gr.qb_update_expert_bias(h, jnp.array([-1.0, 1.0]), 1, jnp.zeros(5))
    with pytest.raises(TypeError, match="expert_bias"):
        gr.qb_update_expert_bias(h, jnp.array([-1.0, 1.0]), 1, jnp.zeros(4, jnp.int32))


# --------------------------------------------------------------------------- QB: errors

def _qb_call(**over):
    kw = dict(score_function="sigmoid", expert_bias=np.zeros(6, np.float32),
              qb_histogram=np.zeros((6, 4), np.int32), qb_bin_bounds=np.array([-1.0, 1.0], np.float32),
              backend="jax")
    kw.update(over)
    topk = kw.pop("topk", 2)
    return gr.fused_topk_with_score_function(np.zeros((3, 6), np.float32), topk, **kw)


@pytest.mark.parametrize("over, exc, name", [
    (dict(expert_bias=None), ValueError, "expert_bias"),
    (dict(score_function="softmax", expert_bias=None), ValueError, "score_function|expert_bias"),
    (dict(topk=6), ValueError, "topk"),
    (dict(qb_bin_bounds=np.array([np.nan, 1.0], np.float32)), ValueError, "qb_bin_bounds"),
    (dict(qb_bin_bounds=np.array([-1.0, np.inf], np.float32)), ValueError, "qb_bin_bounds"),
    (dict(qb_bin_bounds=np.array([1.0, -1.0], np.float32)), ValueError, "qb_bin_bounds"),
    (dict(qb_bin_bounds=np.array([1.0, 1.0], np.float32)), ValueError, "qb_bin_bounds"),
    (dict(qb_bin_bounds=None), ValueError, "qb_bin_bounds"),
    (dict(qb_histogram=None), ValueError, "qb_histogram"),
    (dict(qb_histogram=np.zeros((6, 4), np.int64)), TypeError, "qb_histogram"),
    (dict(qb_histogram=np.zeros((5, 4), np.int32)), ValueError, "qb_histogram"),
    (dict(token_mask=np.ones(3, np.int32)), TypeError, "token_mask"),
    (dict(token_mask=np.ones(4, bool)), ValueError, "token_mask"),
])
def test_qb_errors_name_the_argument(over, exc, name):
    with pytest.raises(exc, match=name) as info:
        _qb_call(**over)
    assert "fused_topk_with_score_function" in str(info.value)


@pytest.mark.parametrize("over, exc, name", [
    (dict(compute_aux_scores=True, expert_bias=None), ValueError, "qb_histogram|compute_aux_scores"),
    (dict(forced_indices=np.array([[0, 1]] * 3)), ValueError, "qb_histogram|forced_indices"),
    (dict(num_groups=3, group_topk=1), ValueError, "group_topk"),   # 1 group of 2 experts < K + 1
])
def test_qb_mode_errors(over, exc, name):
    with pytest.raises(exc, match=name):
        _qb_call(**over)


def test_token_mask_and_axis_name_need_qb_on_the_router():
    """On the router op the mask only keeps tokens out of QB's counts (the route takes every
    token): without QB it would do nothing, a ValueError (contract section 6's rule)."""
    x = np.zeros((3, 6), np.float32)
    with pytest.raises(ValueError, match="token_mask"):
        gr.fused_topk_with_score_function(x, 2, token_mask=np.ones(3, bool), backend="jax")
    with pytest.raises(ValueError, match="axis_name"):
        gr.fused_topk_with_score_function(x, 2, axis_name="data", backend="jax")


def test_qb_one_call_cannot_overflow_a_bin():
    """More than 2**31 - 1 tokens in one call could overflow a bin: a ValueError at trace time."""
    big = jax.ShapeDtypeStruct((2**31, 2), jnp.bfloat16)
    with pytest.raises(ValueError, match="num_tokens"):
        jax.eval_shape(lambda z: gr.fused_topk_with_score_function(
            z, 1, score_function="sigmoid", expert_bias=jnp.zeros(2, jnp.float32),
            qb_histogram=jnp.zeros((2, 4), jnp.int32), qb_bin_bounds=jnp.array([-1.0, 1.0]), backend="jax"), big)


# --------------------------------------------------------------------------- the GPU-only kernel paths

@pytest.mark.gpu
@pytest.mark.cuda
@pytest.mark.parametrize("rule", ["sum_topk", "top2_sum", "max"])
def test_gpu_warp_kernel_paths_against_the_oracles(rule):
    """On a GPU, E = 128 takes the warp-per-token kernel (docs/ops/topk.md): its group rules,
    its compact mode and its QB cutoff (the routing kernel writes alpha), which the simulator
    never runs. Against this file's float64 oracles, counts bit for bit."""
    t, e, k = 64, 128, 8
    bias = np.asarray(np.linspace(0.05, -0.05, e), np.float32)
    g = (8, 4, k, rule)
    x = _clean_logits(t, e, 40, bias, k, BOUNDS, NB, groups=g, scale=1.0, margin=2e-5, gap=1e-6)
    valid = np.arange(t) % 5 != 2
    kw = dict(num_groups=8, group_topk=4, group_score=rule, score_function="sigmoid", expert_bias=bias,
              qb_histogram=np.zeros((e, NB), np.int32), qb_bin_bounds=BOUNDS, token_mask=valid, backend="numba")
    want_p, want_m, want_ids, _ = _sigmoid_router(x, k, bias, groups=g)
    want_h = _counts(_positions(x, bias, k, BOUNDS, NB, g), NB, valid)
    probs, rmap, hist = gr.fused_topk_with_score_function(x, k, **kw)
    np.testing.assert_array_equal(np.asarray(rmap), want_m)
    np.testing.assert_allclose(np.asarray(probs), want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(hist), want_h)
    w, ids, hist_c = gr.fused_topk_with_score_function(x, k, compact=True, indices_dtype="int16", **kw)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(want_p, want_ids, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(hist_c), want_h)
