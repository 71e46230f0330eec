"""The jnp reference of the top-k router and of the aux scores against the NumPy oracle.

Forward and backward (the low-level fwd/bwd pairs, and jax.vjp of the public
reference against the hand-written backward), hypothesis properties on
arbitrary rows (ties, -inf, NaN, +-0.0), explicit edge cases and production
configs, and jax.test_util.check_grads in float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from gpurouter import reference as ref
from gpurouter.testing import oracle as oracles
from gpurouter.testing.strategies import (
    RouterConfig,
    arbitrary_logits,
    as_jnp,
    biases,
    min_selection_gap,
    random_cotangent,
    router_configs,
    tie_free_logits,
    tie_free_rows_np,
)
from gpurouter.testing.tolerances import assert_close, assert_dtype, assert_topk_equivalent, spacing


def _bias(bias):
    return None if bias is None else jnp.asarray(bias, jnp.float32)


def _key(cfg: RouterConfig, **extra) -> tuple:
    return tuple(sorted({**cfg.kwargs(), **extra}.items()))


@functools.lru_cache(maxsize=512)
def _public_jit(key: tuple):
    kw = dict(key)
    return jax.jit(lambda x, b: ref.fused_topk_with_score_function(x, expert_bias=b, **kw))


def _public(x, cfg: RouterConfig, bias=None, **extra):
    """The public reference, jitted once per config (jit == eager is tested below)."""
    return _public_jit(_key(cfg, **extra))(x, _bias(bias))


@functools.lru_cache(maxsize=512)
def _bundle(key: tuple, with_bias: bool):
    """fwd, public, hand-written bwd and jax.vjp of the public op, in one jit."""
    kw = dict(key)
    bwd_kw = {k: kw[k] for k in ("topk", "use_pre_softmax", "scaling_factor", "score_function")}

    def run(x, b, g):
        probs, rmap, saved = ref.topk_with_score_function_fwd(x, expert_bias=b, **kw)
        p_probs, p_map = ref.fused_topk_with_score_function(x, expert_bias=b, **kw)
        dx = ref.topk_with_score_function_bwd(rmap, saved, g, **bwd_kw)
        if with_bias:
            _, pullback = jax.vjp(lambda a, bb: ref.fused_topk_with_score_function(
                a, expert_bias=bb, **kw)[0], x, b)
            vjp_dx, vjp_db = pullback(g)
        else:
            _, pullback = jax.vjp(lambda a: ref.fused_topk_with_score_function(a, **kw)[0], x)
            (vjp_dx,), vjp_db = pullback(g), None
        return probs, rmap, saved, p_probs, p_map, dx, vjp_dx, vjp_db

    return jax.jit(run)


def check_against_oracle(cfg: RouterConfig, x: np.ndarray, bias=None, seed: int = 0):
    """Forward (map exact, probs, saved) and backward of the reference vs the oracle.

    Also: the public reference returns the low-level forward, jax.vjp of the
    public reference equals the hand-written backward, and expert_bias gets a
    zero cotangent.
    """
    xj = as_jnp(x, cfg.dtype)
    g = random_cotangent(seed, cfg.shape, cfg.dtype)
    gj = as_jnp(g, cfg.dtype)
    probs, rmap, saved, p_probs, p_map, dx, vjp_dx, vjp_db = _bundle(
        _key(cfg), bias is not None)(xj, _bias(bias), gj)
    e_probs, e_map, e_saved = oracles.topk_fwd(x, expert_bias=bias, **cfg.kwargs())
    assert_dtype(probs, cfg.dtype, "probs")
    assert_dtype(rmap, np.bool_, "routing_map")
    assert_dtype(saved, np.float32, "saved_scores")  # always fp32 (TE PR #2752)
    np.testing.assert_array_equal(np.asarray(rmap), e_map, err_msg=f"routing_map {cfg}")
    assert_close(probs, e_probs, "probs", cfg.dtype, err_msg=f"probs {cfg}")
    assert_close(saved, e_saved, "probs", "float32", err_msg=f"saved {cfg}")
    np.testing.assert_array_equal(np.asarray(p_map), np.asarray(rmap))
    np.testing.assert_array_equal(np.asarray(p_probs, np.float32), np.asarray(probs, np.float32))

    e_dx = oracles.topk_bwd(e_map, e_saved, g, **cfg.bwd_kwargs())
    assert_dtype(dx, cfg.dtype, "grad_logits")
    assert_close(dx, e_dx, "grads", cfg.dtype, E=cfg.num_experts, err_msg=f"bwd {cfg}")
    assert_dtype(vjp_dx, cfg.dtype, "vjp grad_logits")
    assert_close(vjp_dx, dx, "grads", cfg.dtype, E=cfg.num_experts, err_msg=f"vjp {cfg}")
    if bias is not None:
        np.testing.assert_array_equal(np.asarray(vjp_db), np.zeros(cfg.num_experts, np.float32))


# ----------------------------------------------------------------------------
# Reference vs oracle (tie-free inputs, hypothesis)
# ----------------------------------------------------------------------------


@given(st.data())
def test_topk_matches_oracle(data):
    cfg = data.draw(router_configs(), label="cfg")
    bias = data.draw(biases(cfg), label="bias")
    x = data.draw(tie_free_logits(cfg, bias), label="logits")
    check_against_oracle(cfg, x, bias, seed=data.draw(st.integers(0, 2**16), label="seed"))


@given(st.data())
def test_aux_scores_match_oracle(data):
    cfg = data.draw(router_configs(grouped=False, bias=False), label="cfg")
    x = data.draw(tie_free_logits(cfg), label="logits")
    sf = cfg.score_function
    e_scores, e_map, e_saved = oracles.aux_scores_fwd(x, cfg.topk, sf)
    assume(min_selection_gap(e_scores, cfg) > 0)
    xj = as_jnp(x, cfg.dtype)
    g = random_cotangent(data.draw(st.integers(0, 2**16), label="seed"), cfg.shape)
    scores, rmap, saved, p_scores, p_map, dx, vjp_dx = _aux_bundle(cfg.topk, sf)(
        xj, jnp.asarray(g))
    assert_dtype(scores, np.float32, "aux scores")
    assert_dtype(saved, np.float32, "saved")
    np.testing.assert_array_equal(np.asarray(rmap), e_map)
    assert_close(scores, e_scores, "probs", "float32")
    assert_close(saved, e_saved, "probs", "float32")
    # compute_aux_scores=True returns the same.
    assert_dtype(p_scores, np.float32, "public aux scores")
    np.testing.assert_array_equal(np.asarray(p_scores), np.asarray(scores))
    np.testing.assert_array_equal(np.asarray(p_map), np.asarray(rmap))

    assert_dtype(dx, cfg.dtype, "aux grad_logits")
    assert_close(dx, oracles.aux_scores_bwd(e_saved, g, sf), "grads", cfg.dtype,
                 E=cfg.num_experts)
    assert_dtype(vjp_dx, cfg.dtype, "aux vjp")
    assert_close(vjp_dx, dx, "grads", cfg.dtype, E=cfg.num_experts)


@functools.lru_cache(maxsize=256)
def _aux_bundle(topk: int, sf: str):
    def run(x, g):
        scores, rmap, saved = ref.score_for_aux_loss_fwd(x, topk, sf)
        p_scores, p_map = ref.fused_topk_with_score_function(
            x, topk, score_function=sf, compute_aux_scores=True)
        dx = ref.score_for_aux_loss_bwd(saved, g, sf, out_dtype=x.dtype)
        _, pullback = jax.vjp(lambda a: ref.fused_topk_with_score_function(
            a, topk, score_function=sf, compute_aux_scores=True)[0], x)
        (vjp_dx,) = pullback(g)
        return scores, rmap, saved, p_scores, p_map, dx, vjp_dx

    return jax.jit(run)


# ----------------------------------------------------------------------------
# Properties on arbitrary rows (ties, -inf, NaN, +-0.0)
# ----------------------------------------------------------------------------


@given(st.data())
def test_exactly_k_distinct_and_zero_off_map(data):
    cfg = data.draw(router_configs(), label="cfg")
    bias = data.draw(biases(cfg), label="bias")
    x = data.draw(arbitrary_logits(cfg), label="logits")
    _, aux_map = ref.fused_topk_with_score_function(as_jnp(x, cfg.dtype), cfg.topk, score_function=cfg.score_function,
                                                    compute_aux_scores=True)
    np.testing.assert_array_equal(np.asarray(aux_map).sum(-1), np.full(cfg.num_tokens, cfg.topk))
    probs, rmap = _public(as_jnp(x, cfg.dtype), cfg, bias)
    rmap, probs = np.asarray(rmap), np.asarray(probs, np.float32)
    np.testing.assert_array_equal(rmap.sum(-1), np.full(cfg.num_tokens, cfg.topk))
    np.testing.assert_array_equal(probs[~rmap], 0.0)
    assert not np.signbit(probs[~rmap]).any()  # exactly +0, not -0
    if cfg.grouped:  # experts of dropped groups are never selected
        size = cfg.num_experts // cfg.num_groups
        per_row_groups = rmap.reshape(cfg.num_tokens, cfg.num_groups, size).any(-1).sum(-1)
        assert (per_row_groups <= cfg.group_topk).all()


@given(st.data())
def test_tie_rules_match_oracle_exactly(data):
    # Softmax post selects on the raw logits (no rounding), and with K/Kg == 1 a
    # group score is a max (no rounding): the map must equal the oracle's bit
    # for bit, ties, -inf, NaN and +-0.0 included.
    cfg = data.draw(router_configs(score_functions=("softmax",)), label="cfg")
    assume(not cfg.use_pre_softmax and (not cfg.grouped or cfg.topk == cfg.group_topk))
    x = data.draw(arbitrary_logits(cfg), label="logits")
    _, rmap = _public(as_jnp(x, cfg.dtype), cfg)
    _, e_map, _ = oracles.topk_fwd(x, **cfg.kwargs())
    np.testing.assert_array_equal(np.asarray(rmap), e_map)


@given(st.data())
def test_any_input_matches_oracle_up_to_ties(data):
    cfg = data.draw(router_configs(grouped=False), label="cfg")
    bias = data.draw(biases(cfg), label="bias")
    x = data.draw(arbitrary_logits(cfg), label="logits")
    _, rmap = _public(as_jnp(x, cfg.dtype), cfg, bias)
    _, e_map, _ = oracles.topk_fwd(x, expert_bias=bias, **cfg.kwargs())
    # Selection scores as the reference sees them (fp32), for the tie check.
    xj = jnp.asarray(x, jnp.float32)
    if cfg.score_function == "softmax":
        r = jax.nn.softmax(xj, axis=-1) if cfg.use_pre_softmax else xj
    else:
        r = (jax.nn.sigmoid(xj) if cfg.score_function == "sigmoid"
             else ref.topk.sqrtsoftplus(xj))
        r = r if bias is None else r + jnp.asarray(bias)[None, :]
    r = np.asarray(r)
    # The oracle works in float64; where its scores round to equal float32
    # values, either side of the tie is right.
    assert_topk_equivalent(rmap, e_map, r, cfg.topk)


def _finfo_eps(dtype: str) -> float:
    return float(spacing(np.float32(1.0), dtype))


@given(st.data())
def test_normalised_rows_sum_to_scaling_factor(data):
    cfg = data.draw(router_configs(), label="cfg")
    assume(cfg.score_function != "softmax" or not cfg.use_pre_softmax)
    assume(cfg.score_function == "softmax" or cfg.topk > 1)
    bias = data.draw(biases(cfg), label="bias")
    x = data.draw(arbitrary_logits(cfg, allow_nan=False), label="logits")
    probs, rmap = _public(as_jnp(x, cfg.dtype), cfg, bias)
    probs, rmap = np.asarray(probs, np.float64), np.asarray(rmap)
    sums = probs.sum(-1)
    for t in range(cfg.num_tokens):
        sel = x[t][rmap[t]]
        if cfg.score_function == "softmax":
            if not np.isfinite(sel).any():
                continue  # an all -inf selection: NaN, like jax.nn.softmax
        elif not np.isfinite(sel).all():
            continue  # sigmoid(-inf) = 0 contributes nothing; may sum to 0
        tol = cfg.scaling_factor * (cfg.topk + 1) * _finfo_eps(cfg.dtype) + 1e-6
        assert abs(sums[t] - cfg.scaling_factor) <= tol, (t, sums[t], cfg)


@given(st.data())
def test_bias_never_changes_probs_given_map(data):
    cfg = data.draw(router_configs(score_functions=("sigmoid", "sqrtsoftplus"), bias=True,
                                   dtypes=("float32",)), label="cfg")
    bias = data.draw(biases(cfg), label="bias")
    x = data.draw(arbitrary_logits(cfg), label="logits")
    probs, rmap = _public(as_jnp(x, cfg.dtype), cfg, bias)
    rmap = np.asarray(rmap)
    expected = np.stack([
        oracles.weights_given_map(x[t], np.flatnonzero(rmap[t]), cfg.topk, False,
                                  cfg.score_function, cfg.scaling_factor)
        for t in range(cfg.num_tokens)])
    assert_close(probs, expected, "probs", cfg.dtype)


@settings(max_examples=max(3, settings.default.max_examples // 3))  # 3 shapes compiled each
@given(st.data())
def test_leading_dims_fold_into_tokens(data):
    cfg = data.draw(router_configs(), label="cfg")
    bias = data.draw(biases(cfg), label="bias")
    x = data.draw(arbitrary_logits(cfg), label="logits")
    lead = data.draw(st.sampled_from([d for d in range(1, cfg.num_tokens + 1)
                                      if cfg.num_tokens % d == 0]), label="lead")
    xj = as_jnp(x, cfg.dtype)
    probs, rmap = _public(xj, cfg, bias)
    shape3 = (lead, cfg.num_tokens // lead, cfg.num_experts)
    probs3, rmap3 = _public(xj.reshape(shape3), cfg, bias)
    assert probs3.shape == shape3 and rmap3.shape == shape3
    np.testing.assert_array_equal(np.asarray(rmap3).reshape(cfg.shape), np.asarray(rmap))
    np.testing.assert_array_equal(np.asarray(probs3, np.float32).reshape(cfg.shape),
                                  np.asarray(probs, np.float32))
    probs1, rmap1 = _public(xj[0], cfg, bias)  # a single token, rank 1
    np.testing.assert_array_equal(np.asarray(rmap1), np.asarray(rmap)[0])


@settings(max_examples=max(3, settings.default.max_examples // 5))  # eager: slow per shape
@given(st.data())
def test_jit_equals_eager(data):
    cfg = data.draw(router_configs(), label="cfg")
    bias = data.draw(biases(cfg), label="bias")
    x = data.draw(arbitrary_logits(cfg), label="logits")
    xj = as_jnp(x, cfg.dtype)
    eager = ref.fused_topk_with_score_function(xj, expert_bias=_bias(bias), **cfg.kwargs())
    jitted = _public(xj, cfg, bias)
    np.testing.assert_array_equal(np.asarray(jitted[1]), np.asarray(eager[1]))
    assert_close(jitted[0], eager[0], "probs", cfg.dtype)


# ----------------------------------------------------------------------------
# Explicit cases
# ----------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16", "float16")


def _cfg(x, topk, **kw) -> RouterConfig:
    x = np.asarray(x)
    return RouterConfig(num_tokens=x.shape[0], num_experts=x.shape[1], topk=topk, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tie_lower_index_wins_expert_stage(dtype):
    x = np.array([[1.0, 3.0, 3.0, 3.0, 0.0],
                  [2.0, 2.0, 2.0, 2.0, 2.0],
                  [-0.0, 0.0, -1.0, 0.0, -0.0],  # -0.0 == +0.0
                  [0.0, -0.0, -1.0, -0.0, 0.0]], np.float32)
    cfg = _cfg(x, 2, dtype=dtype)
    _, rmap = _public(as_jnp(x, dtype), cfg)
    expected = np.zeros(x.shape, bool)
    expected[0, [1, 2]] = expected[1, [0, 1]] = expected[2, [0, 1]] = expected[3, [0, 1]] = True
    np.testing.assert_array_equal(np.asarray(rmap), expected)
    np.testing.assert_array_equal(oracles.topk_fwd(x, **cfg.kwargs())[1], expected)
    # sigmoid with a bias that creates exact ties in r = s + b: lower index wins.
    cfg = _cfg(np.zeros((1, 4)), 2, score_function="sigmoid", expert_bias=True, dtype=dtype)
    _, rmap = _public(as_jnp(np.zeros((1, 4)), dtype), cfg, np.array([0, .25, .25, .25],
                                                                     np.float32))
    np.testing.assert_array_equal(np.asarray(rmap), [[False, True, True, False]])


@pytest.mark.parametrize("per_group", [1, 2])
def test_tie_lower_index_wins_group_stage(per_group):
    # 4 groups of 2; groups 0, 1, 2 tie on their score; group 3 is lower.
    x = np.array([[0.0, 5.0, 5.0, 0.0, 1.0, 4.0, 0.0, 1.0]], np.float32)
    if per_group == 1:  # group score = max: 5, 5, 4, 1 -> keep groups 0, 1
        x = np.array([[0.0, 5.0, 5.0, 0.0, 0.0, 5.0, 0.0, 1.0]], np.float32)
        expected = [1, 2]
    else:  # group score = sum of both: 5, 5, 5, 1 -> keep groups 0, 1
        expected = [0, 1, 2, 3]
    cfg = _cfg(x, 2 * per_group, num_groups=4, group_topk=2)
    _, rmap = _public(jnp.asarray(x), cfg)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(rmap)[0]), expected)
    np.testing.assert_array_equal(np.flatnonzero(oracles.topk_fwd(x, **cfg.kwargs())[1][0]),
                                  expected)


@pytest.mark.parametrize("score_function,pre", [("softmax", False), ("softmax", True),
                                                ("sigmoid", False), ("sqrtsoftplus", False)])
def test_neg_inf_masking(score_function, pre):
    ninf = -np.inf
    x = np.array([[ninf, 1.0, ninf, 2.0, 0.5],   # masked experts, K finite
                  [ninf, 1.0, ninf, ninf, 2.0],  # fewer than K=3 finite: filler index 0
                  [ninf, ninf, ninf, ninf, ninf]], np.float32)
    cfg = _cfg(x, 3, score_function=score_function, use_pre_softmax=pre)
    probs, rmap = _public(jnp.asarray(x), cfg)
    probs, rmap = np.asarray(probs), np.asarray(rmap)
    np.testing.assert_array_equal(np.flatnonzero(rmap[0]), [1, 3, 4])
    np.testing.assert_array_equal(np.flatnonzero(rmap[1]), [0, 1, 4])
    np.testing.assert_array_equal(np.flatnonzero(rmap[2]), [0, 1, 2])
    assert np.isfinite(probs[:2]).all()  # -inf masks never make NaN
    assert probs[1, 0] == 0.0
    if score_function == "softmax":
        # an all -inf row gives NaN softmax on the selected experts, like jax.nn.softmax
        assert np.isnan(probs[2, rmap[2]]).all()
        assert np.isnan(np.asarray(jax.nn.softmax(jnp.asarray(x[2])))).all()
    else:
        np.testing.assert_array_equal(probs[2], 0.0)  # sigmoid(-inf) = 0, 0 / (0 + eps)
    assert_close(probs, oracles.topk_fwd(x, **cfg.kwargs())[0], "probs", "float32")
    # gradients stay finite on the masked rows
    _, pullback = jax.vjp(lambda a: _public(a, cfg)[0], jnp.asarray(x[:2]))
    (dx,) = pullback(jnp.ones((2, 5), jnp.float32))
    assert np.isfinite(np.asarray(dx)).all()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_nan_counts_as_neg_inf_for_selection(score_function):
    nan = np.nan
    x = np.array([[nan, 1.0, nan, 0.0],
                  [nan, nan, nan, 3.0]], np.float32)
    cfg = _cfg(x, 2, score_function=score_function)
    _, rmap = _public(jnp.asarray(x), cfg)
    np.testing.assert_array_equal(np.asarray(rmap), [[False, True, False, True],
                                                     [True, False, False, True]])
    # the group stage too: a NaN group score counts as -inf
    xg = np.array([[nan, nan, 0.0, 1.0, -1.0, -2.0]], np.float32)
    cfg = _cfg(xg, 2, score_function=score_function, num_groups=3, group_topk=1)
    _, rmap = _public(jnp.asarray(xg), cfg)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(rmap)[0]), [2, 3])


# (num_tokens, E, K, G, Kg, score_function, pre, bias, scaling, dtype)
SPECIAL = {
    "k1-softmax": (3, 8, 1, -1, -1, "softmax", False, False, 1.0, "float32"),
    "k1-softmax-pre": (3, 8, 1, -1, -1, "softmax", True, False, 1.0, "float32"),
    "k1-sigmoid": (3, 8, 1, -1, -1, "sigmoid", False, True, 2.0, "float32"),
    "k1-sqrtsoftplus": (3, 8, 1, -1, -1, "sqrtsoftplus", False, False, 1.0, "bfloat16"),
    "k-eq-e-softmax": (2, 6, 6, -1, -1, "softmax", False, False, 1.0, "float32"),
    "k-eq-e-sigmoid": (2, 6, 6, -1, -1, "sigmoid", False, True, 1.0, "float16"),
    "e1": (2, 1, 1, -1, -1, "sqrtsoftplus", False, False, 1.0, "float32"),
    "e33": (3, 33, 5, -1, -1, "sigmoid", False, True, 1.0, "float32"),
    "e100-grouped": (2, 100, 4, 10, 2, "sqrtsoftplus", False, True, 1.5, "bfloat16"),
    "e1024-fp32": (2, 1024, 8, -1, -1, "softmax", False, False, 1.0, "float32"),
    "e1024-bf16": (2, 1024, 8, -1, -1, "sigmoid", False, False, 1.0, "bfloat16"),
    "deepseek-v3": (4, 256, 8, 8, 4, "sigmoid", False, True, 2.5, "float32"),
    "deepseek-v3-bf16": (4, 256, 8, 8, 4, "sigmoid", False, True, 2.5, "bfloat16"),
    "nemotron": (4, 512, 22, -1, -1, "sigmoid", False, True, 5.0, "float32"),
    "fp16-softmax-pre": (3, 64, 6, -1, -1, "softmax", True, False, 1.0, "float16"),
    "bf16-softmax-post": (3, 64, 6, 8, 2, "softmax", False, False, 1.0, "bfloat16"),
}


@pytest.mark.parametrize("name", list(SPECIAL))
def test_special_configs(name):
    t, e, k, g, kg, sf, pre, has_bias, scale, dtype = SPECIAL[name]
    cfg = RouterConfig(num_tokens=t, num_experts=e, topk=k, use_pre_softmax=pre, num_groups=g,
                       group_topk=kg, scaling_factor=scale, score_function=sf,
                       expert_bias=has_bias, dtype=dtype)
    cfg.check()
    rng = np.random.default_rng(e)
    bias = (rng.integers(-16, 17, e) / 64).astype(np.float32) if has_bias else None
    x = tie_free_rows_np(k, cfg, bias)
    check_against_oracle(cfg, x, bias, seed=e)


# ----------------------------------------------------------------------------
# check_grads in float64 (the reference computes in float32 inside, so the
# finite differences use eps=1e-2 and the tolerance is 2e-3, not float64's)
# ----------------------------------------------------------------------------

GRAD_CONFIGS = {
    "softmax-post": dict(topk=3),
    "softmax-pre": dict(topk=3, use_pre_softmax=True),
    "softmax-grouped": dict(topk=4, num_groups=4, group_topk=2, scaling_factor=2.0),
    "sigmoid": dict(topk=3, score_function="sigmoid"),
    "sigmoid-k1": dict(topk=1, score_function="sigmoid"),
    "sigmoid-bias-grouped": dict(topk=4, num_groups=4, group_topk=2, score_function="sigmoid",
                                 expert_bias=True, scaling_factor=2.5),
    "sqrtsoftplus": dict(topk=3, score_function="sqrtsoftplus", expert_bias=True),
}


def _robust_logits(cfg: RouterConfig, bias, seed: int = 0) -> np.ndarray:
    """Tie-free logits whose routing survives any +-0.1 perturbation (checked)."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        x = np.stack([(rng.permutation(cfg.num_experts) - cfg.num_experts / 2) / 4
                      for _ in range(cfg.num_tokens)]).astype(np.float64)
        m0 = oracles.topk_fwd(x, expert_bias=bias, **cfg.kwargs())[1]
        if all(np.array_equal(oracles.topk_fwd(x + rng.uniform(-0.1, 0.1, x.shape),
                                               expert_bias=bias, **cfg.kwargs())[1], m0)
               for _ in range(10)):
            return x
    raise AssertionError(f"no robust logits for {cfg}")


@pytest.mark.parametrize("name", list(GRAD_CONFIGS))
def test_check_grads_float64(name):
    kw = dict(GRAD_CONFIGS[name])
    cfg = RouterConfig(num_tokens=3, num_experts=8, **kw)
    cfg.check()
    bias = np.linspace(-0.2, 0.2, 8) if cfg.has_bias else None
    x = _robust_logits(cfg, bias)
    with jax.enable_x64(True):
        b = None if bias is None else jnp.asarray(bias, jnp.float64)

        def f(a):
            return ref.fused_topk_with_score_function(a, expert_bias=b, **cfg.kwargs())[0]

        def f_aux(a):
            return ref.fused_topk_with_score_function(a, cfg.topk, compute_aux_scores=True,
                                                      score_function=cfg.score_function)[0]

        xj = jnp.asarray(x, jnp.float64)
        assert f(xj).dtype == jnp.float64
        check_grads(f, (xj,), order=1, modes=["fwd", "rev"], eps=1e-2, atol=2e-3, rtol=2e-3)
        check_grads(f_aux, (xj,), order=1, modes=["fwd", "rev"], eps=1e-2, atol=2e-3,
                    rtol=2e-3)


@pytest.mark.parametrize("score_function", ["sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("variant", ["plain", "grouped", "aux-scores", "nan-row"])
def test_no_nan_gradient_at_selected_fillers(score_function, variant):
    """Rows whose selected experts are all -inf fillers (S = sum_I s = 0): the
    derivative is 0 there, as the kernels compute, not 0/0 from (S + eps)^2
    underflowing (a bug of the reference before this test)."""
    x = jnp.array([[-jnp.inf] * 8, [0.0, 1, 2, 3, 4, 5, 6, 7]], jnp.float32)
    if variant == "nan-row":  # NaN and -inf; the fillers (lowest indices of NaN-as-inf) are -inf
        x = x.at[0, 4:].set(jnp.nan)
    kw = dict(score_function=score_function)
    if variant == "grouped":
        kw.update(num_groups=4, group_topk=2)
    if variant == "aux-scores":
        kw.update(compute_aux_scores=True)

    def loss(x):
        return ref.fused_topk_with_score_function(x, 2, **kw)[0].sum()

    g = jax.grad(loss)(x)
    np.testing.assert_array_equal(np.asarray(g[0, :4]), np.zeros(4, np.float32))
    assert np.all(np.isfinite(np.asarray(g[1])))
    # the hand-written backward agrees (it had the same d / s^2 term)
    _, m, saved = ref.topk_with_score_function_fwd(x, 2, score_function=score_function)
    dx = ref.topk_with_score_function_bwd(m, saved, jnp.ones_like(x), 2, score_function=score_function)
    np.testing.assert_array_equal(np.asarray(dx[0, :4]), np.zeros(4, np.float32))
