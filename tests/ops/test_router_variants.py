"""The router variants of docs/contract.md sections 9-12 (group-score rules,
compact outputs, Quantile Balancing, token masks, traced token counts):
the reference and the public op on the jax backend, against the NumPy
oracles of tests/variant_oracles.py. The numba backend's composition is in
tests/ops/test_router_variants_numba.py."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import variant_oracles as vo
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gpurouter as gr
from gpurouter import reference as ref

TOPK = "fused_topk_with_score_function"
INT32_MAX = 2**31 - 1


def _logits(t, e, seed=0, scale=2.0):
    return np.asarray(np.random.default_rng(seed).normal(size=(t, e)) * scale, np.float32)


def _bias(e, seed=1):
    return np.asarray(np.random.default_rng(seed).normal(size=(e,)) * 0.1, np.float32)


# ----------------------------------------------------------------------------
# Section 9: group-score rules
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["sum_topk", "top2_sum", "max"])
@pytest.mark.parametrize("topk,num_groups,group_topk", [(6, 4, 2), (4, 4, 4), (4, 8, 2)])
def test_group_score_rules_match_the_oracle(rule, topk, num_groups, group_topk):
    x, b = _logits(7, 16, seed=topk + num_groups), _bias(16)
    probs, rmap, idx = ref.fused_topk_with_score_function(
        x, topk, num_groups=num_groups, group_topk=group_topk, score_function="sigmoid",
        expert_bias=b, group_score=rule, return_indices=True)
    want_probs, want_ids = vo.route(x, topk, "sigmoid", b, num_groups, group_topk, rule)
    np.testing.assert_array_equal(np.asarray(idx), want_ids)
    np.testing.assert_array_equal(np.asarray(rmap), want_probs > 0)
    np.testing.assert_allclose(np.asarray(probs), want_probs, rtol=1e-5, atol=1e-6)


def test_the_rules_differ_where_they_should():
    # group 0 = [3, 2.9, -5, -5], group 1 = [3.5, -5, -5, -5]; Kg = 1, K = 3
    x = np.array([[3, 2.9, -5, -5, 3.5, -5, -5, -5]], np.float32)

    def kept(rule):
        m = ref.fused_topk_with_score_function(x, 3, num_groups=2, group_topk=1, group_score=rule)[1]
        return np.asarray(m)[0, :4].any(), np.asarray(m)[0, 4:].any()

    assert kept("sum_topk") == (True, False)  # 3 + 2.9 - 5 > 3.5 - 5 - 5
    assert kept("top2_sum") == (True, False)  # 5.9 > -1.5
    assert kept("max") == (False, True)       # 3.5 > 3


@pytest.mark.parametrize("rule", ["top2_sum", "max"])
def test_rules_agree_where_the_contract_says(rule):
    x = _logits(9, 16, seed=5)
    k = 4 if rule == "top2_sum" else 2  # K / Kg = 2, or 1
    default = ref.fused_topk_with_score_function(x, k, num_groups=4, group_topk=2)
    other = ref.fused_topk_with_score_function(x, k, num_groups=4, group_topk=2, group_score=rule)
    for a, b in zip(default, other, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rule", ["sum_topk", "top2_sum", "max"])
def test_equal_group_scores_keep_the_lower_group(rule):
    x = np.array([[1, 0, 1, 0, 1, 0]], np.float32)  # three equal groups
    m = ref.fused_topk_with_score_function(x, 2, num_groups=3, group_topk=1, group_score=rule)[1]
    assert np.asarray(m).tolist() == [[True, True, False, False, False, False]]


@settings(max_examples=10)
@given(st.data())
def test_group_rules_on_tied_integer_logits(data):
    """Property: with many ties (small integers, softmax post: r = x exactly)
    every rule's route is the oracle's, order included."""
    rule = data.draw(st.sampled_from(["sum_topk", "top2_sum", "max"]))
    num_groups, group_topk = data.draw(st.sampled_from([(4, 2), (4, 1), (3, 2)]))
    e = 12
    topk = data.draw(st.integers(1, 2)) * group_topk
    x = np.asarray(data.draw(st.lists(st.lists(st.integers(-2, 2), min_size=e, max_size=e),
                                      min_size=4, max_size=4)), np.float32)
    _, _, idx = ref.fused_topk_with_score_function(
        x, topk, num_groups=num_groups, group_topk=group_topk, group_score=rule, return_indices=True)
    want = [vo.ordered_selection(list(row), topk, num_groups, group_topk, rule) for row in x]
    assert np.asarray(idx).tolist() == want


# ----------------------------------------------------------------------------
# Section 11: compact outputs, index dtypes
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int32", "int16", np.int16, jnp.int32])
@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_compact_is_the_dense_result_gathered(sf, dtype):
    x = _logits(6, 12, seed=3).reshape(2, 3, 12)
    kw = dict(num_groups=4, group_topk=2, score_function=sf, scaling_factor=1.5)
    if sf != "softmax":
        kw["expert_bias"] = _bias(12)
    probs, _, idx = ref.fused_topk_with_score_function(x, 4, return_indices=True, **kw)
    w, ids = gr.fused_topk_with_score_function(x, 4, compact=True, indices_dtype=dtype, backend="jax", **kw)
    assert ids.dtype == np.dtype(dtype) and ids.shape == w.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(w), np.take_along_axis(np.asarray(probs), np.asarray(idx), -1))


def test_compact_ids_follow_the_oracle_order_and_gradients_flow():
    x, b = _logits(5, 8, seed=4), _bias(8)
    w, ids = ref.fused_topk_with_score_function(x, 3, score_function="sigmoid", expert_bias=b, compact=True)
    want_probs, want_ids = vo.route(x, 3, "sigmoid", b)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(want_probs, want_ids, -1), rtol=1e-5, atol=1e-6)
    cot = np.asarray(np.random.default_rng(0).normal(size=(5, 3)), np.float32)

    def compact_loss(z):
        return jnp.sum(gr.fused_topk_with_score_function(
            z, 3, score_function="sigmoid", expert_bias=b, compact=True, backend="jax")[0] * cot)

    dense_cot = np.zeros((5, 8), np.float32)
    np.put_along_axis(dense_cot, want_ids, cot, -1)

    def dense_loss(z):
        return jnp.sum(ref.fused_topk_with_score_function(z, 3, score_function="sigmoid", expert_bias=b)[0]
                       * dense_cot)

    np.testing.assert_allclose(np.asarray(jax.grad(compact_loss)(x)), np.asarray(jax.grad(dense_loss)(x)),
                               rtol=1e-6, atol=1e-7)


def test_forced_indices_take_int16_and_compact_keeps_their_order():
    x = _logits(4, 8, seed=6)
    forced = np.array([[7, 1], [0, 3], [2, 6], [5, 4]], np.int16)
    w, ids = gr.fused_topk_with_score_function(x, 2, forced_indices=forced, compact=True,
                                               indices_dtype="int16", backend="jax")
    probs = ref.fused_topk_with_score_function(x, 2, forced_indices=forced.astype(np.int32))[0]
    assert ids.dtype == np.int16 and np.asarray(ids).tolist() == forced.tolist()
    np.testing.assert_array_equal(np.asarray(w), np.take_along_axis(np.asarray(probs), forced.astype(int), -1))


# ----------------------------------------------------------------------------
# Section 12: Quantile Balancing
# ----------------------------------------------------------------------------


def _qb(x, b, topk, hist, bounds, **kw):
    return gr.fused_topk_with_score_function(x, topk, score_function="sigmoid", expert_bias=b,
                                             qb_histogram=hist, qb_bin_bounds=bounds, backend="jax", **kw)


@pytest.mark.parametrize("groups", [None, (4, 2, "sum_topk"), (4, 2, "top2_sum"), (2, 1, "max")])
def test_qb_counts_bit_for_bit_and_the_route_is_the_plain_topk(groups):
    x, b = _logits(11, 16, seed=7, scale=1.0), _bias(16)
    bounds = np.array([-0.6, 0.9], np.float32)
    kw = {} if groups is None else dict(num_groups=groups[0], group_topk=groups[1], group_score=groups[2])
    hist0 = np.asarray(np.random.default_rng(2).integers(0, 50, size=(16, 10)), np.int32)
    k = 3 if groups is None else 4
    probs, rmap, hist = _qb(x, b, k, hist0, bounds, **kw)
    g = (-1, -1, "sum_topk") if groups is None else groups
    want = vo.qb_counts(x, b, k, 10, bounds, *g)
    np.testing.assert_array_equal(np.asarray(hist), hist0 + want)
    assert (want.sum(axis=1) == 11).all()  # one count per token in every expert row
    plain = ref.fused_topk_with_score_function(x, k, score_function="sigmoid", expert_bias=b, **kw)
    np.testing.assert_array_equal(np.asarray(probs), np.asarray(plain[0]))
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(plain[1]))


def test_qb_cutoff_tie_drops_the_higher_expert():
    # three equal logits, k = 2 (TE's test_qb_topk_plus_one_tie_and_bin_clamping):
    # route 0 and 1; the cutoff is their common score, so rb = 0 for the three
    x = np.array([[1.0, 1.0, 1.0, -30.0]], np.float32)
    b = np.zeros(4, np.float32)
    w, ids, hist = _qb(x, b, 2, np.zeros((4, 4), np.int32), np.array([-1.0, 1.0], np.float32), compact=True)
    assert np.asarray(ids).tolist() == [[0, 1]]
    # rb = 0 -> bin floor((0 + 1) * 4 / 2) = 2; expert 3: rb = s(1) - s(-30) ~ 0.73 -> bin 3
    assert np.asarray(hist).tolist() == [[0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


def test_qb_histogram_mode_is_accepted_and_changes_nothing():
    """TE's ``qb_histogram_mode`` (a TE call runs unchanged): either mode gives the
    results of no mode, bit for bit; a bad value, or the mode without QB, names it."""
    x, b = _logits(6, 8, seed=3, scale=1.0), _bias(8)
    hist0, bounds = np.zeros((8, 5), np.int32), np.array([-0.5, 0.5], np.float32)
    want = _qb(x, b, 2, hist0, bounds)
    for mode in ("two_kernel", "fused_atomic"):
        got = _qb(x, b, 2, hist0, bounds, qb_histogram_mode=mode)
        for g, w in zip(got, want, strict=True):
            assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
    with pytest.raises(ValueError, match=r"qb_histogram_mode \('atomic'\) must be one of 'two_kernel', 'fused_atomic'"):
        _qb(x, b, 2, hist0, bounds, qb_histogram_mode="atomic")
    with pytest.raises(ValueError, match="qb_histogram_mode needs qb_histogram"):
        gr.fused_topk_with_score_function(x, 2, score_function="sigmoid", expert_bias=b,
                                          qb_histogram_mode="two_kernel", backend="jax")


def test_qb_bins_clamp_into_the_end_bins_and_nan_goes_to_bin_0():
    x = np.array([[10.0, -10.0, 0.0, np.nan]], np.float32)
    b = np.array([0.0, 0.0, 0.0, 0.0], np.float32)
    # r = [~1, ~0, .5, NaN(-inf)]; k = 1: the cutoff is 0.5
    hist = _qb(x, b, 1, np.zeros((4, 3), np.int32), np.array([-0.1, 0.1], np.float32))[2]
    # rb: 0.5 - 1 -> below: bin 0; 0.5 - 0 -> above: bin 2; 0 -> bin 1; NaN -> bin 0
    assert np.asarray(hist).tolist() == [[1, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]


def test_qb_token_mask_keeps_masked_tokens_out_of_the_counts_only():
    x, b = _logits(9, 8, seed=8, scale=1.0), _bias(8)
    mask = np.array([1, 0, 1, 1, 0, 0, 1, 1, 1], bool)
    bounds = np.array([-1.0, 1.0], np.float32)
    probs, rmap, hist = _qb(x.reshape(3, 3, 8), b, 2, np.zeros((8, 6), np.int32), bounds,
                            token_mask=mask.reshape(3, 3))
    np.testing.assert_array_equal(np.asarray(hist), vo.qb_counts(x, b, 2, 6, bounds, mask=mask))
    plain = _qb(x, b, 2, np.zeros((8, 6), np.int32), bounds)
    np.testing.assert_array_equal(np.asarray(probs).reshape(9, 8), np.asarray(plain[0]))
    flat = _qb(x.reshape(3, 3, 8), b, 2, np.zeros((8, 6), np.int32), bounds, token_mask=mask)[2]
    np.testing.assert_array_equal(np.asarray(flat), np.asarray(hist))


def test_qb_counts_saturate_instead_of_wrapping():
    x, b = _logits(5, 4, seed=9, scale=1.0), _bias(4)
    full = np.full((4, 2), INT32_MAX - 2, np.int32)
    hist = np.asarray(_qb(x, b, 1, full, np.array([-1.0, 1.0], np.float32))[2])
    want = np.minimum(full.astype(np.int64) + vo.qb_counts(x, b, 1, 2, [-1.0, 1.0]), INT32_MAX)
    np.testing.assert_array_equal(hist, want)
    assert (hist >= 0).all() and (hist == INT32_MAX).any()


def test_qb_gradient_is_the_sigmoid_backward_and_jit_works():
    x, b = _logits(6, 8, seed=10), _bias(8)
    bounds = jnp.array([-1.0, 1.0])

    @jax.jit
    def loss(z, hist, lo_hi):
        probs, _, new = _qb(z, b, 2, hist, lo_hi)
        return jnp.sum(probs * jnp.arange(8.0)[None, :]), new

    (val, new), grad = jax.value_and_grad(loss, has_aux=True)(x, jnp.zeros((8, 5), jnp.int32), bounds)
    want = jax.grad(lambda z: jnp.sum(ref.fused_topk_with_score_function(
        z, 2, score_function="sigmoid", expert_bias=b)[0] * jnp.arange(8.0)[None, :]))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(new), vo.qb_counts(x, b, 2, 5, [-1.0, 1.0]))


def test_qb_traced_bad_bounds_still_add_one_count_per_token():
    x, b = _logits(4, 6, seed=11), _bias(6)
    for bounds in ([1.0, -1.0], [np.nan, 1.0], [0.0, np.inf]):
        hist = jax.jit(lambda lo_hi: _qb(x, b, 2, jnp.zeros((6, 3), jnp.int32), lo_hi)[2])(
            jnp.asarray(bounds, jnp.float32))
        assert np.asarray(hist).sum(axis=1).tolist() == [4] * 6


def test_qb_axis_name_sums_the_counts_once():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 JAX devices (tests/conftest.py asks for 8 host devices)")
    mesh = jax.make_mesh((4,), ("data",), devices=devices[:4])
    x, b = _logits(8, 8, seed=12, scale=1.0), _bias(8)
    mask = np.array([1, 1, 0, 1, 1, 1, 1, 0], bool)
    hist0 = np.full((8, 4), 3, np.int32)
    bounds = np.array([-1.0, 1.0], np.float32)

    def shard(z, m, h):
        return _qb(z, b, 2, h, bounds, token_mask=m, axis_name="data")[2]

    sm = jax.shard_map(shard, mesh=mesh, in_specs=(P("data", None), P("data"), P()), out_specs=P(),
                       check_vma=False)
    with jax.set_mesh(mesh):
        put = [jax.device_put(a, NamedSharding(mesh, spec))
               for a, spec in ((x, P("data", None)), (mask, P("data")), (hist0, P()))]
        hist = jax.jit(sm)(*put)
    np.testing.assert_array_equal(np.asarray(hist), hist0 + vo.qb_counts(x, b, 2, 4, bounds, mask=mask))


def test_qb_update_expert_bias_matches_the_oracle():
    rng = np.random.default_rng(13)
    hist = np.asarray(rng.integers(0, 20, size=(6, 9)), np.int32)
    hist[2] = 0
    hist[2, 4] = hist[0].sum()  # every row the same total, one row in a single bin
    bounds = np.array([-0.5, 1.3], np.float32)
    for topk in (1, 2, 5):
        bias, new_bounds = gr.qb_update_expert_bias(hist, bounds, topk)
        want_bias, want_bounds = vo.qb_update(hist, bounds, topk)
        assert bias.dtype == new_bounds.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(bias), want_bias, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new_bounds), want_bounds, rtol=1e-5, atol=1e-6)
        assert abs(float(jnp.mean(bias))) < 1e-6


@pytest.mark.parametrize("jit", [False, True])
def test_qb_update_when_the_quantile_ends_a_bin_exactly(jit):
    """``q N_e`` a whole number that a row's cumulative count reaches exactly, empty
    bins after it: ``i`` is that bin (contract section 12: the first bin with
    ``c_i >= q N_e``), not the next non-empty one. Until 2026-11-29 the target was
    ``N_e topk / E`` in float32, which XLA computes with fp32(1 / E): 21 / 7 gave
    3.0000002, and E = 7, K = 1, N = 21 put expert 0's quantile at 5.0, not 1.0.
    E = 3, 6, 7 and 12 with every K < E (eager; under jit E = 7 and 12: a compile
    each), the smallest whole target and a larger one."""
    update = jax.jit(gr.qb_update_expert_bias, static_argnums=2) if jit else gr.qb_update_expert_bias
    bounds = np.array([0.0, 10.0], np.float32)
    for e in ((7, 12) if jit else (3, 6, 7, 12)):
        for k in range(1, e):
            for mult in (1, 7):
                n = e // math.gcd(e, k) * mult
                target = k * n // e  # whole: q N_e
                hist = np.zeros((e, 10), np.int32)
                hist[0, 0], hist[0, 5] = target, n - target  # expert 0: c_0 = q N_e, then 4 empty bins
                hist[1:, 9] = n
                bias, _ = update(hist, bounds, k)
                want, _ = vo.qb_update(hist, bounds, k)
                np.testing.assert_allclose(np.asarray(bias), want, rtol=1e-5, atol=1e-5, err_msg=f"E={e} K={k}")


def test_qb_bounds_of_any_float_dtype():
    """``qb_bin_bounds`` / ``bin_bounds``: float ``[2]`` of any float dtype, bfloat16
    too (computed in float32): the same histogram and update as float32 bounds."""
    x, b = _logits(6, 8, seed=21, scale=1.0), _bias(8)
    hist0 = np.zeros((8, 4), np.int32)
    want = _qb(x, b, 2, hist0, np.array([-1.0, 1.0], np.float32))[2]
    for dtype in (jnp.float16, jnp.bfloat16):
        bounds = jnp.array([-1.0, 1.0], dtype)
        np.testing.assert_array_equal(np.asarray(_qb(x, b, 2, hist0, bounds)[2]), np.asarray(want))
        got = gr.qb_update_expert_bias(want, bounds, 2)
        ref32 = gr.qb_update_expert_bias(want, np.array([-1.0, 1.0], np.float32), 2)
        for g, r in zip(got, ref32, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_qb_update_of_an_empty_histogram_is_zero():
    bias, bounds = jax.jit(gr.qb_update_expert_bias, static_argnums=2)(
        jnp.zeros((4, 8), jnp.int32), jnp.array([-3.0, 2.0]), 1)
    assert np.asarray(bias).tolist() == [0.0] * 4 and np.asarray(bounds).tolist() == [-1.0, 1.0]


_QB_UPDATE = jax.jit(ref.qb_update_expert_bias, static_argnums=2)


@settings(max_examples=15)
@given(st.data())
def test_qb_update_on_random_histograms(data):
    """Property: any histogram (rows of one total, empty bins included) gives
    the oracle's bias and bounds, and the bias is centred."""
    e, nbins = 5, 8
    topk = data.draw(st.integers(1, e - 1))
    rows = [data.draw(st.lists(st.integers(0, 9), min_size=nbins, max_size=nbins)) for _ in range(e)]
    total = max(sum(r) for r in rows)
    for r in rows:  # every row the same total, as a QB call makes them
        r[-1] += total - sum(r)
    hist = np.asarray(rows, np.int32)
    lo = data.draw(st.floats(-2, 1, width=32))
    bounds = np.array([lo, lo + data.draw(st.floats(0.25, 3, width=32))], np.float32)
    bias, new_bounds = _QB_UPDATE(hist, bounds, topk)
    want_bias, want_bounds = vo.qb_update(hist, bounds, topk)
    np.testing.assert_allclose(np.asarray(bias), want_bias, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_bounds), want_bounds, rtol=1e-5, atol=1e-5)


def test_qb_under_a_token_sharded_jit_counts_every_shard_once():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 JAX devices (tests/conftest.py asks for 8 host devices)")
    mesh = jax.make_mesh((4,), ("data",), devices=devices[:4])
    x, b = _logits(8, 8, seed=14, scale=1.0), _bias(8)
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1], bool)
    bounds = np.array([-1.0, 1.0], np.float32)
    kw = dict(token_mask=mask, compact=True)
    want = _qb(x, b, 2, np.zeros((8, 4), np.int32), bounds, **kw)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        got = jax.jit(lambda z: _qb(z, b, 2, np.zeros((8, 4), np.int32), bounds, **kw))(xs)
    for a, c in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(got[2]), vo.qb_counts(x, b, 2, 4, bounds, mask=mask))
