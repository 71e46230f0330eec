"""An independent audit of issue #37's group-score rules and compact outputs
(docs/contract.md sections 9 and 11) through the public API, on
``backend="jax"`` and ``"numba"`` (the CUDA simulator in CI: tiny shapes),
(The warp kernel's GPU-only paths are tested in ``test_audit_qb.py``.)

The sources, and where the tests follow the contract instead: ``tests/audit_oracles.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from audit_oracles import (
    BACKENDS,
    _order,
    _route,
    _sig,
    _sigmoid_grad,
    _sigmoid_router,
)

import gpurouter as gr

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
