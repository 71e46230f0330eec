"""``return_indices`` and ``forced_indices`` (routing replay) of
``fused_topk_with_score_function``, on every backend that has them."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from public_helpers import BACKENDS, CONFIGS
from public_helpers import backend_kw as _backend_kw
from public_helpers import call as _call
from public_helpers import tie_free_logits as _tie_free_logits

import gpurouter as gr
from gpurouter import reference as ref
from gpurouter.testing import oracle as oracles

TOPK = "fused_topk_with_score_function"


def _order_oracle(r, mask, k):
    """Selected experts by descending score (NaN as -inf), lower index first on ties."""
    out = []
    for row_r, row_m in zip(np.asarray(r, np.float64), np.asarray(mask), strict=True):
        sel = [j for j in range(len(row_m)) if row_m[j]]
        key = [(-(-np.inf if np.isnan(row_r[j]) else row_r[j]), j) for j in sel]
        out.append([j for _, j in sorted(key)][:k])
    return np.array(out)


@given(st.data())
def test_indices_are_the_map_in_selection_order(data):
    e = data.draw(st.integers(2, 12), label="E")
    k = data.draw(st.integers(1, e), label="K")
    sf = data.draw(st.sampled_from(oracles.SCORE_FUNCTIONS), label="sf")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    x = rng.choice(np.array([-np.inf, np.nan, 0.0, 0.5, 1.0, -1.0, 2.0], np.float32), (5, e))
    x[0] = -np.inf
    bias = rng.normal(0, 0.3, e).astype(np.float32) if sf != "softmax" and data.draw(st.booleans()) else None
    pre = sf == "softmax" and data.draw(st.booleans(), label="pre")
    _, m, idx = ref.fused_topk_with_score_function(jnp.asarray(x), k, use_pre_softmax=pre, score_function=sf,
                                                   expert_bias=None if bias is None else jnp.asarray(bias),
                                                   return_indices=True)
    idx = np.asarray(idx)
    assert idx.dtype == np.int32 and idx.shape == (5, k)
    for t in range(5):  # exactly the map's experts, no repeats
        assert sorted(idx[t].tolist()) == np.flatnonzero(np.asarray(m)[t]).tolist()
    xf = x.astype(np.float64)
    if sf == "softmax":
        r = np.stack([oracles.softmax(row) for row in xf]) if pre else xf
    else:
        r = np.vectorize(lambda v: oracles.activation(v, sf))(xf)
        r = r if bias is None else r + bias.astype(np.float64)[None, :]
    np.testing.assert_array_equal(idx, _order_oracle(r, np.asarray(m), k))


def test_ties_put_the_lower_index_first():
    x = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0]])
    _, _, idx = gr.fused_topk_with_score_function(x, 4, return_indices=True)
    assert idx.tolist() == [[1, 2, 4, 3]]


# Each config in one dtype in the fast suite (float32 and bfloat16 by turns: every backend runs
# both), the other under slow (``make test-slow``); the kernels' replay in bf16 and fp16:
# tests/kernels/topk/test_indices_replay.py.
DTYPE_CASES = [
    pytest.param(dtype, name, id=f"{dtype}-{name}",
                 marks=() if dtype == ("float32", "bfloat16")[i % 2] else pytest.mark.slow)
    for dtype in ("float32", "bfloat16") for i, name in enumerate(CONFIGS)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,name", DTYPE_CASES)
def test_replay_of_returned_indices_is_the_same_call(backend, name, dtype):
    """Probs, map and gradients of a replay equal the normal call's, bit for bit."""
    x = _tie_free_logits((2, 3, 16), dtype, seed=7)
    x = x.at[0, 0].set(-jnp.inf)  # a row of fillers
    kw = _backend_kw(backend)
    probs, m, idx = _call(gr.fused_topk_with_score_function, x, CONFIGS[name], return_indices=True, **kw)
    assert idx.shape == x.shape[:-1] + (CONFIGS[name].get("topk", 4),)
    p2, m2, i2 = _call(gr.fused_topk_with_score_function, x, CONFIGS[name], return_indices=True,
                       forced_indices=idx, **kw)
    np.testing.assert_array_equal(np.asarray(m2), np.asarray(m))
    np.testing.assert_array_equal(np.asarray(p2, np.float32), np.asarray(probs, np.float32))
    np.testing.assert_array_equal(np.asarray(i2), np.asarray(idx))
    w = jnp.arange(16, dtype=jnp.float32)[None, None]

    def loss(x, forced):
        p = _call(gr.fused_topk_with_score_function, x, CONFIGS[name], forced_indices=forced, **kw)[0]
        p = p.astype(jnp.float32)
        return jnp.sum(jnp.where(jnp.isfinite(p), p, 0) * w)

    g = jax.jit(jax.grad(loss), static_argnums=1)(x, None)
    g2 = jax.jit(jax.grad(loss))(x, idx)
    if backend == "jax":
        # XLA compiles the two graphs (selection, or a mask from indices) with
        # different fusions: the same formula, rounded in a different order.
        np.testing.assert_allclose(np.asarray(g2, np.float32), np.asarray(g, np.float32), rtol=1e-5, atol=1e-6)
    else:  # the kernels run the same backward on the same map and saved scores
        np.testing.assert_array_equal(np.asarray(g2, np.float32), np.asarray(g, np.float32))


def test_replay_ignores_bias_and_groups():
    x = _tie_free_logits((4, 16), jnp.float32, seed=8)
    forced = jnp.array([[0, 5, 9, 15]] * 4, jnp.int32)
    plain = gr.fused_topk_with_score_function(x, 4, score_function="sigmoid", forced_indices=forced)
    biased = gr.fused_topk_with_score_function(x, 4, num_groups=4, group_topk=2, score_function="sigmoid",
                                               expert_bias=jnp.linspace(-5, 5, 16), forced_indices=forced)
    np.testing.assert_array_equal(np.asarray(biased[0]), np.asarray(plain[0]))
    assert np.asarray(plain[1])[:, [0, 5, 9, 15]].all() and int(plain[1].sum()) == 16


def test_traced_out_of_range_and_repeated_indices_have_a_defined_result():
    x = _tie_free_logits((2, 8), jnp.float32, seed=9)
    forced = jnp.array([[1, 1, 3], [8, -1, 2]], jnp.int32)
    probs, m = jax.jit(lambda x, f: gr.fused_topk_with_score_function(
        x, 3, score_function="sigmoid", forced_indices=f))(x, forced)
    assert np.asarray(m).sum(1).tolist() == [2, 1]  # a repeat selects once; out of range nothing
    assert np.asarray(m)[0, [1, 3]].all() and np.asarray(m)[1, 2]
    s = jax.nn.sigmoid(x)
    np.testing.assert_allclose(float(probs[1, 2]), 1.0, rtol=1e-6)  # normalised over its one expert
    np.testing.assert_allclose(float(probs[0, 1]), float(s[0, 1] / (s[0, 1] + s[0, 3])), rtol=1e-6)


@pytest.mark.parametrize("forced,exc,msg", [
    (np.array([[0, 0], [1, 2]]), ValueError, f"{TOPK}: forced_indices row 0 ([0, 0]) must hold topk (2) distinct"),
    (np.array([[0, 1], [1, 8]]), ValueError,
     f"{TOPK}: forced_indices row 1 ([1, 8]) must lie in [0, num_experts) = [0, 8)."),
    (np.array([[0, 1], [1, -1]]), ValueError, f"{TOPK}: forced_indices row 1 ([1, -1]) must lie in"),
    (np.zeros((2, 3), np.int32), ValueError,
     f"{TOPK}: forced_indices shape (2, 3) must be logits.shape[:-1] + (topk,) = (2, 2)."),
    (np.zeros((2, 2), np.float32), TypeError, f"{TOPK}: forced_indices must be integers, got float32."),
    ([[0, 1], [1, 2]], TypeError, f"{TOPK}: forced_indices must be an array"),
])
def test_forced_indices_errors(forced, exc, msg):
    for fn in (gr.fused_topk_with_score_function, ref.fused_topk_with_score_function):
        with pytest.raises(exc, match="^" + re.escape(msg)):
            fn(jnp.zeros((2, 8)), 2, forced_indices=forced)
    with pytest.raises(ValueError, match=re.escape("forced_indices must be None with compute_aux_scores=True")):
        gr.fused_topk_with_score_function(jnp.zeros((2, 8)), 2, compute_aux_scores=True,
                                          forced_indices=np.zeros((2, 2), np.int32))


def test_zero_tokens_with_indices():
    p, m, idx = gr.fused_topk_with_score_function(jnp.zeros((0, 8)), 2, return_indices=True)
    assert idx.shape == (0, 2) and idx.dtype == jnp.int32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
def test_indices_of_every_backend_match_the_reference(backend, sf):
    x = _tie_free_logits((2, 5, 12), jnp.float32, seed=10)
    x = x.at[0, 0].set(-jnp.inf).at[0, 1, 3:].set(jnp.nan)  # filler rows
    kw = dict(score_function=sf, return_indices=True, routing_map_format="bitmap_u8")
    _, bits, idx = jax.jit(lambda x: gr.fused_topk_with_score_function(x, 3, **kw, **_backend_kw(backend)))(x)
    _, want_bits, want = ref.fused_topk_with_score_function(x, 3, **kw)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(want_bits))
    _, _, aidx = gr.fused_topk_with_score_function(x, 3, score_function=sf, compute_aux_scores=True,
                                                  return_indices=True, **_backend_kw(backend))
    _, _, want_a = ref.fused_topk_with_score_function(x, 3, score_function=sf, compute_aux_scores=True,
                                                      return_indices=True)
    np.testing.assert_array_equal(np.asarray(aidx), np.asarray(want_a))
