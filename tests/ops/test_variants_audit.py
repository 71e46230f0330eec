"""An independent audit of issue #37's router variants (docs/contract.md
sections 9-12) through the public API, on ``backend="jax"`` and
``backend="numba"`` (the CUDA simulator in CI: tiny shapes).

Written from the semantics as TE #3395 (QB), the Kimi K3 report section
2.3.3 with Megatron #6637 (the bias update), DeepSeek-V3/V2 (the group-score
rules), Megatron #3096 (padding masks) and TE #3129 (dense indices) state
them, against oracles of this file's own: NumPy float64 (exact integers for
the counts). Nothing here reuses the repo's oracles or tests. Where the
contract settles something those sources leave open, the test follows the
contract and says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gpurouter as gr
from gpurouter import _backend

NUMBA = pytest.param("numba", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not _backend.numba_usable(),
                       reason="backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")])
BACKENDS = ["jax", NUMBA]
EPS = 1e-20
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- oracles (float64 / exact)

def _sig(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _order(values):
    """Indices by value, larger first, the lower index on ties; NaN as -inf."""
    v = np.where(np.isnan(values), -np.inf, np.asarray(values, np.float64))
    return sorted(range(v.shape[0]), key=lambda i: (-v[i], i))


def _kept_groups(r, num_groups, group_topk, topk, rule):
    """The eligible-expert mask of one token: groups scored by ``rule``."""
    gs = r.shape[0] // num_groups
    take = {"sum_topk": topk // group_topk, "top2_sum": 2, "max": 1}[rule]
    scores = [sum(sorted(r[g * gs:(g + 1) * gs], reverse=True)[:take]) for g in range(num_groups)]
    keep = np.zeros(r.shape[0], bool)
    for g in _order(np.array(scores))[:group_topk]:
        keep[g * gs:(g + 1) * gs] = True
    return keep


def _route(r, topk, groups=None):
    """(selected ids in selection order, the (K+1)-th eligible value or None)."""
    eligible = np.ones(r.shape[0], bool) if groups is None else _kept_groups(r, *groups)
    ranked = [i for i in _order(np.where(eligible, r, -np.inf)) if eligible[i]]
    return ranked[:topk], (r[ranked[topk]] if len(ranked) > topk else None)


def _sigmoid_router(x, topk, bias, scaling=1.0, groups=None):
    """probs [T, E], map [T, E], ids [T, K], cutoff [T] of a sigmoid router (contract sec. 2, 12)."""
    s = _sig(x)
    r = s + np.asarray(bias, np.float64)
    t, e = x.shape
    probs, rmap = np.zeros((t, e)), np.zeros((t, e), bool)
    ids, cut = np.zeros((t, topk), np.int64), np.zeros(t)
    for i in range(t):
        sel, alpha = _route(r[i], topk, groups)
        w = s[i, sel] / (s[i, sel].sum() + EPS) if topk > 1 else s[i, sel]
        probs[i, sel], rmap[i, sel], ids[i], cut[i] = scaling * w, True, sel, alpha
    return probs, rmap, ids, cut


def _positions(x, bias, topk, bounds, num_bins, groups=None):
    """QB bin positions before the floor, float64: (alpha_t - s[t, e] - lower) * B / (upper - lower)."""
    s = _sig(x)
    cut = _sigmoid_router(x, topk, bias, groups=groups)[3]
    lower, upper = (float(v) for v in bounds)
    return (cut[:, None] - s - lower) * num_bins / (upper - lower)


def _counts(pos, num_bins, valid=None):
    """Exact int64 histogram [E, B] of the floor'ed, clamped positions of the valid tokens."""
    t, e = pos.shape
    valid = np.ones(t, bool) if valid is None else valid
    bins = np.clip(np.floor(np.nan_to_num(pos, nan=0.0, posinf=num_bins, neginf=-1)), 0, num_bins - 1)
    hist = np.zeros((e, num_bins), np.int64)
    for i in range(t):
        if valid[i]:
            for j in range(e):
                hist[j, int(bins[i, j])] += 1
    return hist


def _clean_logits(t, e, seed, bias, topk, bounds, num_bins, groups=None, scale=1.5, margin=1e-3, gap=1e-4):
    """Logits whose QB bin positions are >= ``margin`` bins from every edge, and whose expert
    (and group) scores are tie-free by ``gap``: float32 vs float64 rounding cannot move a
    count or a choice."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        x = np.asarray(rng.normal(size=(t, e)) * scale, np.float32)
        pos = _positions(x, bias, topk, bounds, num_bins, groups)
        frac = pos - np.floor(pos)
        r = _sig(x) + np.asarray(bias, np.float64)
        ok = np.min(np.minimum(frac, 1 - frac)) > margin and np.min(np.diff(np.sort(r, axis=1), axis=1)) > gap
        if ok and groups is not None:
            take = {"sum_topk": groups[2] // groups[1], "top2_sum": 2, "max": 1}[groups[3]]
            gs = -np.sort(-r.reshape(t, groups[0], -1), axis=2)[:, :, :take].sum(2)
            ok = np.min(np.diff(np.sort(gs, axis=1), axis=1)) > gap
        if ok:
            return x
    raise AssertionError("no clean draw")


def _sigmoid_grad(x, rmap, cot, scaling=1.0):
    """d sum(probs * cot) / dx of the sigmoid router, K > 1 (contract section 3), float64."""
    a, m = _sig(x), rmap.astype(np.float64)
    g = cot * scaling
    ssum = (m * a).sum(1, keepdims=True)
    d = (m * g * a).sum(1, keepdims=True)
    return m * (g - d / (ssum + EPS)) / (ssum + EPS) * a * (1 - a)


def _qb_bias_update(hist, bounds, topk):
    """Kimi K3 / Megatron #6637 in float64: the k/E quantile linear in its bin, mean-centred."""
    e, b = hist.shape
    lower, upper = (float(v) for v in bounds)
    w = (upper - lower) / b
    x = np.zeros(e)
    for j in range(e):
        n = hist[j].sum()
        target = n * topk / e
        if n == 0:
            x[j] = lower
            continue
        cum = 0
        for i in range(b):
            if cum + hist[j, i] >= target and hist[j, i] > 0:
                x[j] = lower + (i + (target - cum) / hist[j, i]) * w
                break
            cum += hist[j, i]
    bias = x - x.mean()
    return bias, np.array([bias.min() - 1, bias.max() + 1])


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
    """An empty histogram: a zero bias and bounds [-1, 1] (contract section 12)."""
    bias, bounds = _qb_update_jit(jnp.zeros((5, 7), jnp.int32), jnp.array([-3.0, 2.0]), 2)
    np.testing.assert_array_equal(np.asarray(bias), np.zeros(5))
    np.testing.assert_array_equal(np.asarray(bounds), [-1.0, 1.0])


def test_qb_update_errors_name_the_argument():
    h = jnp.zeros((4, 5), jnp.int32)
    with pytest.raises(ValueError, match="topk"):
        gr.qb_update_expert_bias(h, jnp.array([-1.0, 1.0]), 4)
    with pytest.raises(ValueError, match="topk"):
        gr.qb_update_expert_bias(h, jnp.array([-1.0, 1.0]), 0)
    with pytest.raises(TypeError, match="histogram"):
        gr.qb_update_expert_bias(h.astype(jnp.float32), jnp.array([-1.0, 1.0]), 1)


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


# --------------------------------------------------------------------------- group-score rules

def _grouped_logits(seed, t=6, e=16, scale=1.0, bias=0.0):
    """Sigmoid scores whose group scores (under every rule) and expert scores are tie-free by
    1e-4 so that float32 and float64 rank them alike."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        x = np.asarray(rng.normal(size=(t, e)) * scale, np.float32)
        ok = True
        for rule_take in (1, 2, 3):
            gs = np.sort((_sig(x) + bias).reshape(t, 4, e // 4), axis=2)[:, :, ::-1][:, :, :rule_take].sum(2)
            ok &= np.min(np.diff(np.sort(gs, axis=1), axis=1)) > 1e-4
        ok &= np.min(np.diff(np.sort(_sig(x) + bias, axis=1), axis=1)) > 1e-4
        if ok:
            return x
    raise AssertionError("no clean draw")


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_score_rules_select_by_their_own_group_scores(backend):
    """"sum_topk" (default: the top K/Kg summed), "top2_sum", "max": the kept groups are the
    top Kg by that score; the rules give different routes on these rows (K/Kg = 3)."""
    t = 4 if backend == "numba" else 8
    bias = np.asarray(np.linspace(-0.1, 0.12, 16), np.float32)
    x = _grouped_logits(22, t=8, bias=bias)[:t]   # the rules differ pairwise on the first 4 rows
    maps = {}
    for rule in ("sum_topk", "top2_sum", "max"):
        kw = {} if rule == "sum_topk" else {"group_score": rule}
        probs, rmap, ids = gr.fused_topk_with_score_function(
            x, 6, num_groups=4, group_topk=2, score_function="sigmoid", expert_bias=bias,
            return_indices=True, backend=backend, **kw)
        want_p, want_m, want_ids, _ = _sigmoid_router(x, 6, bias, groups=(4, 2, 6, rule))
        np.testing.assert_array_equal(np.asarray(rmap), want_m, err_msg=rule)
        np.testing.assert_array_equal(np.asarray(ids), want_ids, err_msg=rule)
        np.testing.assert_allclose(np.asarray(probs), want_p, rtol=1e-5, atol=1e-6, err_msg=rule)
        maps[rule] = want_m
    assert not np.array_equal(maps["sum_topk"], maps["top2_sum"])
    assert not np.array_equal(maps["top2_sum"], maps["max"])
    assert not np.array_equal(maps["sum_topk"], maps["max"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_score_rules_on_softmax_pre_and_post(backend):
    """The rules score groups from what the mode selects on: softmax probabilities (pre) or
    raw logits (post)."""
    x = _grouped_logits(22, t=8, scale=2.0)[:4 if backend == "numba" else 8]
    for pre in (True, False):
        for rule in (("max",) if backend == "numba" else ("top2_sum", "max")):   # numba: 2 s a rule
            probs, rmap = gr.fused_topk_with_score_function(
                x, 4, use_pre_softmax=pre, num_groups=4, group_topk=2, group_score=rule, backend=backend)
            x64 = x.astype(np.float64)
            p_all = np.exp(x64 - x64.max(1, keepdims=True))
            p_all /= p_all.sum(1, keepdims=True)
            for i in range(x.shape[0]):
                sel, _ = _route(p_all[i] if pre else x64[i], 4, (4, 2, 4, rule))
                want = np.zeros(16)
                if pre:
                    want[sel] = p_all[i, sel]
                else:
                    q = np.exp(x64[i, sel] - x64[i, sel].max())
                    want[sel] = q / q.sum()
                np.testing.assert_array_equal(np.asarray(rmap)[i], want > 0, err_msg=f"{pre} {rule} {i}")
                np.testing.assert_allclose(np.asarray(probs)[i], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["sum_topk", "top2_sum", "max"])
def test_group_ties_go_to_the_lower_group_index(backend, rule):
    """Equal group scores: the lower group index is kept (the experts' rule, for groups)."""
    # 4 groups of 4; groups 1 and 3 are identical and best, group 2 a hair worse than them
    row = np.array([-2.0, -2.5, -3.0, -3.5,  1.0, 0.5, 0.25, 0.0,
                    0.9, 0.4, 0.2, -0.1,  1.0, 0.5, 0.25, 0.0], np.float32)
    x = row[None]
    bias = np.zeros(16, np.float32)
    _, rmap = gr.fused_topk_with_score_function(x, 2, num_groups=4, group_topk=1, group_score=rule,
                                                score_function="sigmoid", expert_bias=bias, backend=backend)
    want = np.zeros(16, bool)
    want[[4, 5]] = True
    np.testing.assert_array_equal(np.asarray(rmap)[0], want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_ties_of_different_composition(backend):
    """Equal group sums made of different values (exact dyadic scores through the bias): the
    lower group wins for the summing rules; "max" then tells them apart."""
    x = np.zeros((1, 8), np.float32)                       # s = 0.5 everywhere
    bias = np.array([0.0, -0.25, 0.25, 0.0, 0.0, -0.5, 0.125, 0.125], np.float32)
    # r = [.5, .25 | .75, .5 | .5, 0 | .625, .625]; group sums 0.75, 1.25, 0.5, 1.25; max .75 vs .625
    for rule, want in (("sum_topk", [2, 3]), ("top2_sum", [2, 3]), ("max", [2, 3])):
        ids = gr.fused_topk_with_score_function(x, 2, num_groups=4, group_topk=1, group_score=rule,
                                                score_function="sigmoid", expert_bias=bias, compact=True,
                                                backend=backend)[1]
        np.testing.assert_array_equal(np.asarray(ids), [want], err_msg=rule)
    bias_b = bias[[0, 1, 6, 7, 4, 5, 2, 3]]                 # the two tied groups swapped
    for rule, want in (("sum_topk", [2, 3]), ("top2_sum", [2, 3]), ("max", [6, 7])):
        ids = gr.fused_topk_with_score_function(x, 2, num_groups=4, group_topk=1, group_score=rule,
                                                score_function="sigmoid", expert_bias=bias_b, compact=True,
                                                backend=backend)[1]
        np.testing.assert_array_equal(np.asarray(ids), [want], err_msg=rule)


@pytest.mark.parametrize("over, name", [
    (dict(group_score="mean"), "group_score"),
    (dict(group_score="max", group_topk=-1), "group_score"),
    (dict(group_score="top2_sum", num_groups=8, group_topk=2, topk=2), "group_score"),
    (dict(group_score="max", compute_aux_scores=True, group_topk=-1, score_function="softmax"), "group_score"),
])
def test_group_score_errors_name_the_argument(over, name):
    kw = dict(num_groups=4, group_topk=2, score_function="sigmoid")
    kw.update(over)
    topk = kw.pop("topk", 4)
    with pytest.raises(ValueError, match=name):
        gr.fused_topk_with_score_function(np.zeros((2, 8), np.float32), topk, backend="jax", **kw)


# --------------------------------------------------------------------------- masks on the losses

R, C = 6, 8
MASK = np.array([True, False, True, True, False, True])


def _aux_probs(seed=0):
    rng = np.random.default_rng(seed)
    p = rng.random((R, C))
    return np.asarray(p / p.sum(1, keepdims=True), np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_loss_token_mask(backend):
    """Masked rows count nowhere; T defaults to the valid count; masked rows get zero
    gradient even when they hold NaN or inf."""
    p = _aux_probs()
    p[1] = np.nan
    p[4, 0] = np.inf
    n = np.array([3, 1, 0, 2, 4, 2, 0, 4], np.int32)
    k, coeff = 2, 0.1
    loss, grad = jax.value_and_grad(lambda q: gr.fused_moe_aux_loss(q, n, k, coeff, token_mask=MASK,
                                                                    backend=backend))(p)
    tv = MASK.sum()
    cf = C * coeff / (k * tv * tv)
    want = cf * (p[MASK].astype(np.float64).sum(0) * n).sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    want_g = np.where(MASK[:, None], cf * n[None, :], 0.0)
    np.testing.assert_allclose(np.asarray(grad), want_g, rtol=1e-5)
    assert np.isfinite(np.asarray(grad)).all()
    # an explicit total_num_tokens overrides the valid count, concrete or traced
    got = gr.fused_moe_aux_loss(p, n, k, coeff, token_mask=MASK, total_num_tokens=10, backend=backend)
    np.testing.assert_allclose(float(got), want * tv * tv / 100, rtol=1e-5)
    got = jax.jit(lambda q, tt: gr.fused_moe_aux_loss(q, n, k, coeff, token_mask=MASK, total_num_tokens=tt,
                                                      backend=backend))(p, jnp.int32(10))
    np.testing.assert_allclose(float(got), want * tv * tv / 100, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_scores_tokens_per_expert_path_with_a_mask(backend):
    """The aux scores' routing map counted with tokens_per_expert(token_mask=), into the aux
    loss with the same mask: the loss of the valid tokens alone.

    The issue names "the aux scores' tokens_per_expert path" without saying where the mask
    goes; the contract (sections 6 and 10) puts it on the counting and the loss, and a mask on
    the router op itself without QB is a ValueError (it would do nothing there). This test
    follows the contract."""
    rng = np.random.default_rng(3)
    x = np.asarray(rng.normal(size=(R, C)), np.float32)
    scores, amap = gr.fused_topk_with_score_function(x, 2, score_function="sigmoid", compute_aux_scores=True,
                                                     backend=backend)
    n = gr.tokens_per_expert(amap, token_mask=MASK)
    assert n.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(n), np.asarray(amap)[MASK].sum(0))
    loss = gr.fused_moe_aux_loss(scores, n, 2, 1e-2, token_mask=MASK, backend=backend)
    v = _sig(x[MASK])
    v /= v.sum(1, keepdims=True)
    cnt = np.zeros(C)
    for row in v:
        cnt[_order(row)[:2]] += 1
    tv = MASK.sum()
    np.testing.assert_allclose(float(loss), C * 1e-2 / (2 * tv * tv) * (v.sum(0) * cnt).sum(), rtol=1e-5)


def test_tokens_per_expert_mask_shapes_and_formats():
    """Masked rows add nothing; the mask in the tokens' shape or flat; a bitmap too."""
    rng = np.random.default_rng(4)
    m = rng.random((2, 3, 10)) < 0.3
    mask = np.array([[True, False, True], [False, True, True]])
    want = m[mask].sum(0)
    np.testing.assert_array_equal(np.asarray(gr.tokens_per_expert(m, token_mask=mask)), want)
    np.testing.assert_array_equal(np.asarray(gr.tokens_per_expert(m, token_mask=mask.reshape(-1))), want)
    bits = gr.pack_routing_map(m)
    np.testing.assert_array_equal(np.asarray(gr.tokens_per_expert(bits, 10, token_mask=mask)), want)
    with pytest.raises(TypeError, match="token_mask"):
        gr.tokens_per_expert(m, token_mask=mask.astype(np.int32))
    with pytest.raises(ValueError, match="token_mask"):
        gr.tokens_per_expert(m, token_mask=np.ones(5, bool))


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_z_loss_token_mask(backend):
    """coeff * sum over valid tokens of lse^2 / T_valid; masked rows (NaN included) 0 gradient."""
    rng = np.random.default_rng(6)
    x = np.asarray(rng.normal(size=(R, C)) * 3, np.float32)
    x[4] = np.nan
    coeff = 0.01
    loss, g = jax.value_and_grad(lambda z: gr.router_z_loss(z, coeff, token_mask=MASK, backend=backend))(x)
    x64 = np.where(MASK[:, None], x, 0.0).astype(np.float64)   # the masked NaN row plays no part
    mx = x64.max(1, keepdims=True)
    lse = (mx + np.log(np.exp(x64 - mx).sum(1, keepdims=True)))[:, 0]
    tv = MASK.sum()
    np.testing.assert_allclose(float(loss), coeff * (lse[MASK] ** 2).sum() / tv, rtol=1e-5)
    sm = np.exp(x64 - lse[:, None])
    want_g = np.where(MASK[:, None], 2 * coeff / tv * lse[:, None] * sm, 0.0)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-4, atol=1e-7)
    # the mask in the tokens' shape [..., T]
    loss3 = gr.router_z_loss(x.reshape(2, 3, C), coeff, token_mask=MASK.reshape(2, 3), backend=backend)
    np.testing.assert_allclose(float(loss3), float(loss), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_masked_gives_zero_losses_and_gradients(backend):
    none = np.zeros(R, bool)
    p, x = _aux_probs(), np.ones((R, C), np.float32)
    n = np.ones(C, np.int32)
    la, ga = jax.value_and_grad(lambda q: gr.fused_moe_aux_loss(q, n, 2, 1.0, token_mask=none, backend=backend))(p)
    lz, gz = jax.value_and_grad(lambda z: gr.router_z_loss(z, 1.0, token_mask=none, backend=backend))(x)
    assert float(la) == 0.0 and float(lz) == 0.0
    assert not np.asarray(ga).any() and not np.asarray(gz).any()


def test_update_expert_bias_token_mask_counts_valid_rows():
    """With a mask the second argument is the routing map; the counts are its valid rows'
    (bias + rate * sign(mean(n) - n))."""
    rng = np.random.default_rng(7)
    m = rng.random((R, C)) < 0.4
    bias = np.asarray(rng.normal(size=C) * 0.1, np.float32)
    got = gr.update_expert_bias(bias, m, 1e-3, token_mask=MASK)
    n = m[MASK].sum(0).astype(np.float64)
    want = bias + 1e-3 * np.sign(n.mean() - n)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-7)
    got_bits = gr.update_expert_bias(bias, gr.pack_routing_map(m), 1e-3, token_mask=MASK)
    np.testing.assert_array_equal(np.asarray(got_bits), np.asarray(got))
    with pytest.raises(ValueError, match="token_mask"):   # with a mask: the map, not counts
        gr.update_expert_bias(bias, jnp.asarray(m.sum(0), jnp.int32), 1e-3, token_mask=MASK)
    # without a mask it takes counts, as before
    np.testing.assert_array_equal(np.asarray(gr.update_expert_bias(bias, jnp.asarray(m[MASK].sum(0), jnp.int32),
                                                                   1e-3)), np.asarray(got))


@pytest.mark.parametrize("fn", ["aux", "z"])
def test_loss_mask_errors_name_the_argument(fn):
    p = _aux_probs()
    n = np.ones(C, np.int32)
    call = ((lambda mk: gr.fused_moe_aux_loss(p, n, 2, 1.0, token_mask=mk, backend="jax")) if fn == "aux"
            else (lambda mk: gr.router_z_loss(p, 1.0, token_mask=mk, backend="jax")))
    with pytest.raises(TypeError, match="token_mask"):
        call(MASK.astype(np.float32))
    with pytest.raises(ValueError, match="token_mask"):
        call(MASK[:4])


def test_loss_masks_under_axis_name_use_the_global_valid_count():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 JAX devices (tests/conftest.py asks for 8 host devices)")
    mesh = jax.make_mesh((2,), ("data",), devices=devices[:2])
    p = _aux_probs(8)
    n_local = np.asarray(np.random.default_rng(8).integers(0, 5, (2, C)), np.int32)
    x = np.asarray(np.random.default_rng(9).normal(size=(R, C)), np.float32)

    def shard(q, c, z, mk):
        aux = gr.fused_moe_aux_loss(q, c[0], 2, 0.1, axis_name="data", token_mask=mk, backend="jax")
        zl = gr.router_z_loss(z, 0.01, axis_name="data", token_mask=mk, backend="jax")
        return jax.lax.psum(aux, "data"), jax.lax.psum(zl, "data")

    sm = jax.shard_map(shard, mesh=mesh, in_specs=(P("data", None), P("data", None), P("data", None), P("data")),
                       out_specs=(P(), P()))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in (
            (p, P("data", None)), (n_local, P("data", None)), (x, P("data", None)), (MASK, P("data")))]
        aux, zl = jax.jit(sm)(*args)
    tv = MASK.sum()
    n = n_local.sum(0)
    np.testing.assert_allclose(float(aux), C * 0.1 / (2 * tv * tv) * (p[MASK].astype(np.float64).sum(0) * n).sum(),
                               rtol=1e-5)
    x64 = x[MASK].astype(np.float64)
    lse = np.log(np.exp(x64).sum(1))
    np.testing.assert_allclose(float(zl), 0.01 * (lse ** 2).sum() / tv, rtol=1e-5)


# --------------------------------------------------------------------------- traced total_num_tokens

@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_total_num_tokens_no_retrace(backend):
    """total_num_tokens may be a traced scalar (int or float): the formula's value for each,
    one trace for every value."""
    p = _aux_probs(1)
    n = np.array([3, 1, 0, 2, 4, 2, 0, 4], np.int32)
    x = np.asarray(np.random.default_rng(10).normal(size=(R, C)), np.float32)
    traces = []

    @jax.jit
    def step(total):
        traces.append(1)
        return (gr.fused_moe_aux_loss(p, n, 2, 0.1, total_num_tokens=total, backend=backend),
                gr.router_z_loss(x, 0.01, total_num_tokens=total, backend=backend))

    lse = np.log(np.exp(x.astype(np.float64)).sum(1))
    for tot in (6, 11, 40):
        aux, zl = step(jnp.int32(tot))
        np.testing.assert_allclose(float(aux), C * 0.1 / (2 * tot * tot) * (p.sum(0) * n).sum(), rtol=1e-5)
        np.testing.assert_allclose(float(zl), 0.01 * (lse ** 2).sum() / tot, rtol=1e-5)
    assert len(traces) == 1
    # a float scalar too; and a traced T <= 0 is used as it is (the formula's value)
    aux, zl = jax.jit(lambda tt: (gr.fused_moe_aux_loss(p, n, 2, 0.1, total_num_tokens=tt, backend=backend),
                                  gr.router_z_loss(x, 0.01, total_num_tokens=tt, backend=backend)))(
        jnp.float32(-4.0))
    np.testing.assert_allclose(float(aux), C * 0.1 / (2 * 16) * (p.sum(0) * n).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(zl), -0.01 * (lse ** 2).sum() / 4, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concrete_device_scalar_total_num_tokens(backend):
    """A 0-d int or float array (TE's graph-safe aux loss takes a device scalar) outside jit:
    the same value as under jit and as the Python int; a float one used as a value."""
    p = _aux_probs(1)
    n = np.array([3, 1, 0, 2, 4, 2, 0, 4], np.int32)
    x = np.asarray(np.random.default_rng(10).normal(size=(R, C)), np.float32)
    lse = np.log(np.exp(x.astype(np.float64)).sum(1))
    for tot in (jnp.int32(12), jnp.float32(12.0), np.float32(12.0), jnp.float32(12.5)):
        t = float(tot)
        aux = gr.fused_moe_aux_loss(p, n, 2, 0.1, total_num_tokens=tot, backend=backend)
        zl = gr.router_z_loss(x, 0.01, total_num_tokens=tot, backend=backend)
        np.testing.assert_allclose(float(aux), C * 0.1 / (2 * t * t) * (p.sum(0) * n).sum(), rtol=1e-5)
        np.testing.assert_allclose(float(zl), 0.01 * (lse ** 2).sum() / t, rtol=1e-5)
    for bad in (jnp.float32(0.0), jnp.float32(-2.0), jnp.float32(np.nan), jnp.float32(np.inf)):
        with pytest.raises(ValueError, match="total_num_tokens"):
            gr.fused_moe_aux_loss(p, n, 2, 0.1, total_num_tokens=bad, backend=backend)
        with pytest.raises(ValueError, match="total_num_tokens"):
            gr.router_z_loss(x, 0.01, total_num_tokens=bad, backend=backend)


def test_total_num_tokens_errors():
    p = _aux_probs()
    n = np.ones(C, np.int32)
    with pytest.raises(ValueError, match="total_num_tokens"):
        gr.fused_moe_aux_loss(p, n, 2, 1.0, total_num_tokens=0, backend="jax")
    with pytest.raises(ValueError, match="total_num_tokens"):
        gr.router_z_loss(p, 1.0, total_num_tokens=-3, backend="jax")
    with pytest.raises((TypeError, ValueError), match="total_num_tokens"):
        gr.fused_moe_aux_loss(p, n, 2, 1.0, total_num_tokens=jnp.array([4, 4]), backend="jax")
    with pytest.raises(ValueError, match="total_num_tokens"):
        jax.jit(lambda tt: gr.fused_moe_aux_loss(p, n, 2, 1.0, total_num_tokens=tt, backend="jax"))(
            jnp.array([4, 4]))
    with pytest.raises(TypeError, match="total_num_tokens"):
        jax.jit(lambda tt: gr.router_z_loss(p, 1.0, total_num_tokens=tt, backend="jax"))(jnp.array(True))


# --------------------------------------------------------------------------- compact outputs, index dtypes

def _tie_free(t, e, seed):
    rng = np.random.default_rng(seed)
    return np.asarray(np.stack([rng.permutation(e) for _ in range(t)]) * (4.0 / e) - 2.0, np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_weights_in_selection_order(backend):
    """compact=True: weights [..., K] in selection order (larger r first) and ids [..., K]
    (int32 default); weights[j] = probs[ids[j]] of the dense call, bit for bit."""
    x = _tie_free(6, 8, 30).reshape(2, 3, 8)
    bias = np.asarray(np.linspace(0.3, -0.3, 8), np.float32)
    kw = dict(score_function="sigmoid", expert_bias=bias, backend=backend)
    w, ids = gr.fused_topk_with_score_function(x, 3, compact=True, **kw)
    assert w.shape == (2, 3, 3) and ids.shape == (2, 3, 3) and ids.dtype == np.int32 and w.dtype == np.float32
    flat = x.reshape(6, 8)
    want_p, _, want_ids, _ = _sigmoid_router(flat, 3, bias)
    np.testing.assert_array_equal(np.asarray(ids).reshape(6, 3), want_ids)
    np.testing.assert_allclose(np.asarray(w).reshape(6, 3), np.take_along_axis(want_p, want_ids, 1),
                               rtol=1e-5, atol=1e-6)
    probs, _ = gr.fused_topk_with_score_function(x, 3, **kw)
    np.testing.assert_array_equal(np.asarray(w), np.take_along_axis(np.asarray(probs), np.asarray(ids), -1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_weights_bf16_and_groups_match_the_dense_probs(backend):
    """weights in the dtype of logits, bit for bit the dense probs at the compact ids
    (bf16, softmax pre, grouped)."""
    x = jnp.asarray(_tie_free(4, 16, 33), jnp.bfloat16)
    kw = dict(use_pre_softmax=True, num_groups=4, group_topk=2, backend=backend)
    w, ids = gr.fused_topk_with_score_function(x, 4, compact=True, **kw)
    probs, _ = gr.fused_topk_with_score_function(x, 4, **kw)
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w, np.float32),
                                  np.take_along_axis(np.asarray(probs, np.float32), np.asarray(ids), -1))
    x64 = np.asarray(x, np.float64)
    p_all = np.exp(x64 - x64.max(1, keepdims=True))
    p_all /= p_all.sum(1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), [_route(r, 4, (4, 2, 4, "sum_topk"))[0] for r in p_all])


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_selection_order_ties_lower_index_first(backend):
    """Equal selection scores: the lower index comes first in the ids."""
    x = np.array([[0.0, 1.0, 1.0, -1.0, 1.0, 0.0]], np.float32)
    w, ids = gr.fused_topk_with_score_function(x, 4, compact=True, score_function="sigmoid", backend=backend)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 2, 4, 0]])
    s = _sig(x[0, [1, 2, 4, 0]])
    np.testing.assert_allclose(np.asarray(w)[0], s / s.sum(), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["sigmoid", pytest.param("softmax", marks=pytest.mark.slow)])
def test_compact_gradients_flow_through_the_weights(backend, score):
    x = _tie_free(4, 8, 31)
    cot = np.asarray(np.random.default_rng(11).normal(size=(4, 2)), np.float32)
    for sf in (score,):
        g = jax.grad(lambda z, sf=sf: jnp.sum(gr.fused_topk_with_score_function(
            z, 2, score_function=sf, compact=True, backend=backend)[0] * cot))(x)
        x64 = x.astype(np.float64)
        want = np.zeros_like(x64)
        for i in range(4):
            sel = _order(x64[i])[:2]
            if sf == "softmax":   # softmax post: q over the selected
                q = np.exp(x64[i, sel] - x64[i, sel].max())
                q /= q.sum()
                want[i, sel] = q * (cot[i] - (cot[i] * q).sum())
            else:
                dense = np.zeros(8)
                dense[sel] = cot[i]
                m = np.zeros((1, 8), bool)
                m[0, sel] = True
                want[i] = _sigmoid_grad(x[i:i + 1], m, dense[None])[0]
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-5 * np.sqrt(8), err_msg=sf)


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_dtypes_and_forced_indices(backend):
    """indices_dtype int16 sets every index output; forced_indices takes int16 and int32 alike,
    and compact returns the forced ids in their order."""
    x = _tie_free(3, 8, 32)
    kw = dict(score_function="sigmoid", backend=backend)
    p, m, ids = gr.fused_topk_with_score_function(x, 2, return_indices=True, indices_dtype="int16", **kw)
    assert ids.dtype == np.int16
    np.testing.assert_array_equal(np.asarray(ids), [_order(r)[:2] for r in x.astype(np.float64)])
    forced = np.array([[5, 1], [0, 7], [3, 2]])
    outs = [gr.fused_topk_with_score_function(x, 2, forced_indices=forced.astype(dt), compact=True,
                                              indices_dtype=idt, **kw)
            for dt, idt in ((np.int16, "int16"), (np.int32, jnp.int32))]   # a string, a JAX dtype
    for (w, got_ids), dt in zip(outs, (np.int16, np.int32), strict=True):
        assert got_ids.dtype == dt
        np.testing.assert_array_equal(np.asarray(got_ids), forced)
        s = _sig(np.take_along_axis(x, forced, 1))
        np.testing.assert_allclose(np.asarray(w), s / s.sum(1, keepdims=True), rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(w), np.asarray(outs[0][0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_replay_under_jit_marks_dropped_entries(backend):
    """A traced replay with a repeated or out-of-range entry: that id is -1 and its weight 0
    (contract sections 2 and 11); the others are the normal call's weights of what was kept."""
    x = _tie_free(2, 8, 34)
    forced = np.array([[5, 5, 1], [2, 9, 6]], np.int32)
    w, ids = jax.jit(lambda z, f: gr.fused_topk_with_score_function(
        z, 3, score_function="sigmoid", forced_indices=f, compact=True, indices_dtype="int16",
        backend=backend))(x, forced)
    np.testing.assert_array_equal(np.asarray(ids), [[5, -1, 1], [2, -1, 6]])
    assert ids.dtype == np.int16
    for t, kept in ((0, [5, 1]), (1, [2, 6])):
        s = _sig(x[t, kept])
        np.testing.assert_allclose(np.asarray(w)[t], [s[0] / s.sum(), 0.0, s[1] / s.sum()], rtol=1e-6)


@pytest.mark.parametrize("over, exc, name", [
    (dict(compact=True, compute_aux_scores=True), ValueError, "compact"),
    (dict(compact=True, return_indices=True), ValueError, "return_indices"),
    (dict(compact=True, routing_map_format="bitmap_u8"), ValueError, "routing_map_format"),
    (dict(compact=True, indices_dtype="int8"), TypeError, "indices_dtype"),
    (dict(compact=True, indices_dtype="int64"), TypeError, "indices_dtype"),
    (dict(compact="yes"), TypeError, "compact"),
])
def test_compact_errors_name_the_argument(over, exc, name):
    with pytest.raises(exc, match=name):
        gr.fused_topk_with_score_function(np.zeros((2, 8), np.float32), 2, score_function="sigmoid",
                                          backend="jax", **over)


def test_int16_needs_e_that_fits():
    """int16 ids need E <= 32768 (the largest id, E - 1, fits in int16): a ValueError beyond."""
    x = jnp.zeros((1, 32769), jnp.float32)
    with pytest.raises(ValueError, match="indices_dtype"):
        jax.eval_shape(lambda z: gr.fused_topk_with_score_function(z, 1, compact=True, indices_dtype="int16",
                                                                   backend="jax"), x)
    out = jax.eval_shape(lambda z: gr.fused_topk_with_score_function(
        z, 1, compact=True, indices_dtype="int16", backend="jax"), jnp.zeros((1, 32768), jnp.float32))
    assert out[1].dtype == np.int16


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
