"""The conformance checks are sharp: routers that each break one contract point
(the one-line mistakes kernel authors make) raise AssertionError; the reference
passes. Each mutant wraps the jnp reference and breaks one thing; each test runs
only the property that should catch it, with few examples and a fixed seed (CI
stays cheap; the default of 100 examples only makes a catch likelier)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gpurouter as gr
from gpurouter.testing import (
    CheckFailure,
    check_aux_loss,
    check_aux_scores,
    check_router_z_loss,
    check_topk,
)


def ref(*a, **kw):
    return gr.fused_topk_with_score_function(*a, backend="jax", **kw)


def _indices(rmap, k):
    return jax.lax.top_k(rmap.astype(jnp.float32), k)[1]


def _replay(x, rmap, k, pre, scaling, sf):
    """The reference's weights for a given map (routing replay)."""
    return ref(x, k, pre, -1, -1, scaling, sf, None, forced_indices=_indices(rmap, k))


# ---- top-k mutants: (name, fn, property that must catch it) ------------------


def higher_index_wins(x, k, pre, g, gk, s, sf, b):
    def flip(a):
        return a[..., ::-1]

    p, m = ref(flip(x), k, pre, g, gk, s, sf, None if b is None else flip(b))
    return flip(p), flip(m)


def bias_in_weights(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if b is None:
        return p, m
    return jnp.where(m, p + (s * b).astype(p.dtype), 0).astype(p.dtype), m


def scaling_twice(x, k, pre, g, gk, s, sf, b):
    return ref(x, k, pre, g, gk, s * s, sf, b)


def scaling_never(x, k, pre, g, gk, s, sf, b):
    return ref(x, k, pre, g, gk, 1.0, sf, b)


def pre_post_swapped(x, k, pre, g, gk, s, sf, b):
    return ref(x, k, (not pre) if sf == "softmax" else pre, g, gk, s, sf, b)


def softplus_not_sqrt(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf != "sqrtsoftplus":
        return p, m
    v = jnp.where(m, jax.nn.softplus(x.astype(jnp.float32)), 0.0)
    if k > 1:
        v = v / (jnp.sum(v, -1, keepdims=True) + 1e-20)
    return (s * v).astype(x.dtype), m


def group_score_max(x, k, pre, g, gk, s, sf, b):
    if gk <= 0:
        return ref(x, k, pre, g, gk, s, sf, b)
    xf = x.astype(jnp.float32)
    r = {"softmax": jax.nn.softmax(xf, -1) if pre else xf, "sigmoid": jax.nn.sigmoid(xf),
         "sqrtsoftplus": jnp.sqrt(jax.nn.softplus(xf))}[sf]
    r = r if b is None else r + b
    t, e = r.shape
    gs = jnp.max(r.reshape(t, g, e // g), -1)  # the bug: max instead of the sum of the top K/Kg
    kept = jnp.zeros((t, g), bool).at[jnp.arange(t)[:, None], jax.lax.top_k(gs, gk)[1]].set(True)
    r = jnp.where(jnp.repeat(kept, e // g, -1), r, -jnp.inf)
    idx = jax.lax.top_k(r, k)[1]
    return ref(x, k, pre, -1, -1, s, sf, None, forced_indices=idx)


def drops_masked_fillers(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    m = m & jnp.isfinite(x)
    return jnp.where(m, p, 0).astype(p.dtype), m


def nan_as_plus_inf(x, k, pre, g, gk, s, sf, b):
    big = jnp.where(jnp.isnan(x), jnp.asarray(6e4, x.dtype), x)
    _, m = ref(big, k, pre, g, gk, s, sf, b)
    return _replay(x, m, k, pre, s, sf)


def rounded_scores(x, k, pre, g, gk, s, sf, b):
    """A kernel that keeps its scores in the logits' dtype: each step rounded.

    (Half arithmetic written in jnp without the roundings, ``jnp.exp`` on bf16
    and so on, is no mutant on XLA: its fusions compute bf16 elementwise work
    in fp32 and round once at the end, which the contract allows.)"""
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if x.dtype == jnp.float32 or (sf == "softmax" and pre):
        return p, m
    dt, xf = x.dtype, x.astype(jnp.float32)

    def rnd(v):
        return v.astype(dt).astype(jnp.float32)

    if sf == "softmax":
        z = jnp.where(m, xf, -jnp.inf)
        e = rnd(jnp.exp(z - jnp.max(z, -1, keepdims=True)))
        w = rnd(e / jnp.sum(e, -1, keepdims=True))
    else:
        sc = rnd(jax.nn.sigmoid(xf) if sf == "sigmoid" else jnp.sqrt(jax.nn.softplus(xf)))
        sc = jnp.where(m, sc, 0.0)
        w = rnd(sc / (jnp.sum(sc, -1, keepdims=True) + 1e-20)) if k > 1 else sc
    return (w * s).astype(dt), m


def fp32_out(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    return p.astype(jnp.float32), m


def sigmoid_unnormalised(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf != "sigmoid":
        return p, m
    return (s * jnp.where(m, jax.nn.sigmoid(x.astype(jnp.float32)), 0.0)).astype(x.dtype), m


def grad_without_scaling(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    q, _ = ref(x, k, pre, g, gk, 1.0, sf, b)  # the gradient flows through the unscaled probs
    return (jax.lax.stop_gradient(p) + (q - jax.lax.stop_gradient(q))).astype(p.dtype), m


def softmax_pre_grad_wrong(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf != "softmax" or not pre:
        return p, m
    q = _replay(x, m, k, False, s, sf)[0]  # gradient of the post-softmax weights
    return (jax.lax.stop_gradient(p) + (q - jax.lax.stop_gradient(q))).astype(p.dtype), m


def crashes_on_empty(x, k, pre, g, gk, s, sf, b):
    if x.size == 0:
        raise ValueError("cannot route zero tokens")
    return ref(x, k, pre, g, gk, s, sf, b)


def flattens_leading_dims(x, k, pre, g, gk, s, sf, b):
    return ref(x.reshape(-1, x.shape[-1]), k, pre, g, gk, s, sf, b)


TOPK_MUTANTS = [
    (higher_index_wins, "tie rule"),
    (higher_index_wins, "ties of groups"),
    (bias_in_weights, "bias chooses, never weighs"),
    (scaling_twice, "values (tie-free)"),
    (scaling_never, "values (tie-free)"),
    (pre_post_swapped, "values (tie-free)"),
    (softplus_not_sqrt, "values (tie-free)"),
    (group_score_max, "group-limited selection"),
    (drops_masked_fillers, "-inf and NaN masking"),
    (nan_as_plus_inf, "-inf and NaN masking"),
    (fp32_out, "values (tie-free)"),
    (sigmoid_unnormalised, "values (tie-free)"),
    (grad_without_scaling, "gradients"),
    (softmax_pre_grad_wrong, "gradients"),
    (crashes_on_empty, "jit, vmap, grad, leading dims, T=0"),
    (flattens_leading_dims, "jit, vmap, grad, leading dims, T=0"),
]


# On this 2-core CI machine under load a mutant takes 10 s to 3 min (one jit
# compile per example, shrinking included): the whole list is marked slow; the
# two cheapest run in CI below.
@pytest.mark.slow
@pytest.mark.parametrize("mutant,prop", TOPK_MUTANTS, ids=[f"{m.__name__}-{p}" for m, p in TOPK_MUTANTS])
def test_topk_mutant_is_caught(mutant, prop):
    with pytest.raises(AssertionError) as info:
        check_topk(mutant, max_examples=30, seed=0, properties=[prop], grads=True)
    assert isinstance(info.value, CheckFailure)
    text = str(info.value)
    assert f"property '{prop}' failed" in text and "config: fn(logits=" in text
    assert "smallest counterexample" in text


@pytest.mark.slow
def test_scores_rounded_to_the_logits_dtype_are_caught_at_the_defaults():
    """A half-precision rounding at each step (1-2 ulps off) is rarer than the
    other mutants' errors: 30 examples of every dtype miss it, the default
    100 catch it (about 30 s on a CPU for this property alone)."""
    with pytest.raises(AssertionError) as info:
        check_topk(rounded_scores, seed=0, properties=["values (tie-free)"], grads=False)
    assert "property 'values (tie-free)' failed" in str(info.value)


# ---- aux scores, aux loss, z-loss mutants ------------------------------------


def aux_ref(x, k, sf):
    return ref(x, k, score_function=sf, compute_aux_scores=True)


def aux_unnormalised(x, k, sf):
    s, m = aux_ref(x, k, sf)
    if sf != "sigmoid":
        return s, m
    return jax.nn.sigmoid(x.astype(jnp.float32)), m


def aux_scores_in_logits_dtype(x, k, sf):
    s, m = aux_ref(x, k, sf)
    return s.astype(x.dtype), m


def loss_ref(p, n, k, c):
    return gr.fused_moe_aux_loss(p, n, k, c, backend="jax")


def loss_over_t(p, n, k, c):  # E / (K T) instead of E / (K T^2)
    return (loss_ref(p, n, k, c).astype(jnp.float32) * p.shape[0]).astype(p.dtype)


def loss_without_k(p, n, k, c):
    return loss_ref(p, n, 1, c)


def loss_grad_doubled(p, n, k, c):
    v = loss_ref(p, n, k, c)
    return jax.lax.stop_gradient(v) + 2 * (v - jax.lax.stop_gradient(v))


def z_ref(x, c):
    return gr.router_z_loss(x, c, backend="jax")


def z_sum_not_mean(x, c):
    return z_ref(x, c) * (x.size // max(x.shape[-1], 1))


def z_naive_lse(x, c):
    lse = jax.nn.logsumexp(x.astype(jnp.float32).reshape(-1, x.shape[-1]), -1)
    return c * jnp.mean(jnp.where(jnp.isfinite(lse), lse, 0.0) ** 2 + 0 * lse)


OTHER_MUTANTS = [
    (check_aux_scores, aux_unnormalised, "values (tie-free)"),
    (check_aux_scores, aux_scores_in_logits_dtype, "values (tie-free)"),
    (check_aux_loss, loss_over_t, "value and dtype"),
    (check_aux_loss, loss_without_k, "value and dtype"),
    (check_aux_loss, loss_grad_doubled, "gradient"),
    (check_router_z_loss, z_sum_not_mean, "value and dtype"),
    (check_router_z_loss, z_naive_lse, "gradient"),
]


@pytest.mark.slow
@pytest.mark.parametrize("check,mutant,prop", OTHER_MUTANTS, ids=[m.__name__ for _, m, _ in OTHER_MUTANTS])
def test_other_mutants_are_caught(check, mutant, prop):
    with pytest.raises(AssertionError, match=f"property '{prop}' failed"):
        check(mutant, max_examples=30, seed=0, properties=[prop])


def test_scaling_mutants_caught_cheaply():
    for mutant in (scaling_twice, scaling_never):
        with pytest.raises(CheckFailure, match="property 'values \\(tie-free\\)' failed"):
            check_topk(mutant, max_examples=10, seed=0, properties=["values (tie-free)"],
                       dtypes=("float32",))


def test_fn_that_returns_garbage_is_reported_not_a_traceback():
    # (called under jit, the 3 may reach the check as a traced int32 scalar)
    with pytest.raises(AssertionError,
                       match=r"fn must return \(probs, routing_map\); it returned (int 3|ArrayImpl int32\[\])"):
        check_topk(lambda *a: 3, max_examples=2, seed=0, properties=["values (tie-free)"])
    with pytest.raises(AssertionError, match="fn raised RuntimeError: boom"):
        check_aux_loss(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")), max_examples=2, seed=0)
