"""Mutants of gpurouter's reference: routers that each break ONE contract point.

Each is a one-line mistake a kernel author really makes, wrapped around the
jnp reference (``backend="jax"``); tests/testing/test_mutants.py checks that the
conformance checks catch each one, and names the property that must. Not a
test file: the lists below are imported by it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import gpurouter as gr
from gpurouter.testing import check_aux_loss, check_aux_scores, check_router_z_loss


def ref(*a, **kw):
    return gr.fused_topk_with_score_function(*a, backend="jax", **kw)


def _indices(rmap, k):
    return jax.lax.top_k(rmap.astype(jnp.float32), k)[1]


def _replay(x, rmap, k, pre, scaling, sf):
    """The reference's weights for a given map (routing replay)."""
    return ref(x, k, pre, -1, -1, scaling, sf, None, forced_indices=_indices(rmap, k))


# ---- top-k mutants -----------------------------------------------------------


def higher_index_wins(x, k, pre, g, gk, s, sf, b):
    def flip(a):
        return a[..., ::-1]

    p, m = ref(flip(x), k, pre, g, gk, s, sf, None if b is None else flip(b))
    return flip(p), flip(m)


def negative_zero_below_zero(x, k, pre, g, gk, s, sf, b):
    """Ranks a ``-0.0`` logit below ``+0.0`` (as a sort on the raw bits does): the
    contract ties them, the lower index first."""
    tiny = jnp.asarray(jnp.finfo(x.dtype).smallest_subnormal, x.dtype)
    return ref(jnp.where((x == 0) & jnp.signbit(x), -tiny, x), k, pre, g, gk, s, sf, b)


def bias_in_weights(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if b is None:
        return p, m
    return jnp.where(m, p + jnp.broadcast_to(s * b, p.shape).astype(p.dtype), 0).astype(p.dtype), m


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
    r = r if b is None else r + jnp.broadcast_to(b, r.shape)
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


def bias_gets_a_gradient(x, k, pre, g, gk, s, sf, b):
    """The forward right, but the probs' cotangent leaks into ``expert_bias`` (a custom
    VJP that returns one for the bias: contract section 3 gives it none)."""
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if b is None:
        return p, m
    leak = jnp.sum(jnp.where(m, b, 0.0), axis=-1, keepdims=True)
    return (p + (leak - jax.lax.stop_gradient(leak)).astype(p.dtype)).astype(p.dtype), m


def nan_gradient_off_the_map(x, k, pre, g, gk, s, sf, b):
    """The forward right, but a NaN logit off the map gets a NaN gradient: the sigmoid's
    derivative at NaN times a zero cotangent (a ``where`` hides a NaN forward, not
    backward; contract section 2, "NaN at unselected experts")."""
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf != "sigmoid":
        return p, m
    z = jax.nn.sigmoid(x.astype(jnp.float32))
    leak = jnp.where(jnp.isnan(z), 0.0, 0.0 * (z - jax.lax.stop_gradient(z)))
    return (p + leak.astype(p.dtype)).astype(p.dtype), m


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


def _scores(x, sf):
    xf = x.astype(jnp.float32)
    return jax.nn.sigmoid(xf) if sf == "sigmoid" else jnp.sqrt(jax.nn.softplus(xf))


def _weights(x, m, k, s, sf, w):
    """probs of the map ``m`` with weights ``w`` (fp32) for sigmoid/sqrtsoftplus, scaled, in x's dtype."""
    return (s * jnp.where(m, w, 0.0)).astype(x.dtype), m


def normalised_over_all_experts(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf == "softmax" or k == 1:
        return p, m
    v = _scores(x, sf)
    return _weights(x, m, k, s, sf, v / (jnp.sum(v, -1, keepdims=True) + 1e-20))


def normalised_when_k_is_1(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf == "softmax" or k > 1:
        return p, m
    v = jnp.where(m, _scores(x, sf), 0.0)
    return _weights(x, m, k, s, sf, v / (jnp.sum(v, -1, keepdims=True) + 1e-20))


def normalised_without_eps(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf == "softmax" or k == 1:
        return p, m
    v = jnp.where(m, _scores(x, sf), 0.0)
    return _weights(x, m, k, s, sf, v / jnp.sum(v, -1, keepdims=True))


def weights_from_biased_scores(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if b is None:
        return p, m
    v = jnp.where(m, _scores(x, sf) + jnp.broadcast_to(b, x.shape), 0.0)
    return _weights(x, m, k, s, sf, v / (jnp.sum(v, -1, keepdims=True) + 1e-20) if k > 1 else v)


def naive_softplus(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf != "sqrtsoftplus":
        return p, m
    v = jnp.where(m, jnp.sqrt(jnp.log1p(jnp.exp(x.astype(jnp.float32)))), 0.0)
    return _weights(x, m, k, s, sf, v / (jnp.sum(v, -1, keepdims=True) + 1e-20) if k > 1 else v)


def softmax_without_max(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf != "softmax":
        return p, m
    e = jnp.exp(x.astype(jnp.float32))
    if not pre:
        e = jnp.where(m, e, 0.0)
    w = e / jnp.sum(e, -1, keepdims=True)
    return (s * jnp.where(m, w, 0.0)).astype(x.dtype), m


def cast_before_scaling(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    q, _ = ref(x, k, pre, g, gk, 1.0, sf, b)  # the unscaled weights, rounded to x's dtype first
    return (q * jnp.asarray(s, x.dtype)).astype(x.dtype), m


def group_ties_to_higher_index(x, k, pre, g, gk, s, sf, b):
    if gk <= 0:
        return ref(x, k, pre, g, gk, s, sf, b)
    t, e = x.shape[-2:]

    def flip_groups(a):
        return a.reshape(a.shape[:-1] + (g, e // g))[..., ::-1, :].reshape(a.shape)

    _, m = ref(flip_groups(x), k, pre, g, gk, s, sf, None if b is None else flip_groups(b))
    return _replay(x, flip_groups(m), k, pre, s, sf)


def grad_without_normalisation(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf == "softmax" or k == 1:
        return p, m
    v = jnp.where(m, _scores(x, sf), 0.0)
    w = v / (jax.lax.stop_gradient(jnp.sum(v, -1, keepdims=True)) + 1e-20)  # the sum taken as a constant
    q = (s * w).astype(x.dtype)
    return (jax.lax.stop_gradient(p) + (q - jax.lax.stop_gradient(q))).astype(p.dtype), m


def nan_as_zero(x, k, pre, g, gk, s, sf, b):
    _, m = ref(jnp.nan_to_num(x, nan=0.0), k, pre, g, gk, s, sf, b)
    return _replay(x, m, k, pre, s, sf)


def fillers_from_the_highest_index(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if g > 0 and gk > 0:
        return p, m
    e = x.shape[-1]
    finite = jnp.isfinite(x)
    xf = x.astype(jnp.float32)
    r = xf if sf == "softmax" else _scores(x, sf) + (0.0 if b is None else jnp.broadcast_to(b, x.shape))
    last_first = -1e30 + jnp.broadcast_to(jnp.arange(e, dtype=jnp.float32), x.shape)  # masked: the last index first
    key = jnp.where(finite, r, last_first)
    idx = jax.lax.top_k(key, k)[1]
    return ref(x, k, pre, -1, -1, s, sf, None, forced_indices=idx)


def map_as_int8(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    return p, m.astype(jnp.int8)


def pre_softmax_unmasked(x, k, pre, g, gk, s, sf, b):
    p, m = ref(x, k, pre, g, gk, s, sf, b)
    if sf != "softmax" or not pre:
        return p, m
    return (s * jax.nn.softmax(x.astype(jnp.float32), -1)).astype(x.dtype), m


TOPK_MUTANTS = [
    (higher_index_wins, "tie rule"),
    (higher_index_wins, "ties of groups"),
    (negative_zero_below_zero, "tie rule"),
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
    (bias_gets_a_gradient, "gradients"),
    (nan_gradient_off_the_map, "gradients with -inf"),
    (crashes_on_empty, "jit, vmap, grad, leading dims, T=0"),
    (flattens_leading_dims, "jit, vmap, grad, leading dims, T=0"),
    (normalised_over_all_experts, "values (tie-free)"),
    (normalised_when_k_is_1, "values (tie-free)"),
    (normalised_without_eps, "-inf and NaN masking"),
    (weights_from_biased_scores, "bias chooses, never weighs"),
    (naive_softplus, "large logits"),
    (softmax_without_max, "large logits"),
    (cast_before_scaling, "values (tie-free)"),
    (group_ties_to_higher_index, "ties of groups"),
    (grad_without_normalisation, "gradients"),
    (nan_as_zero, "-inf and NaN masking"),
    (fillers_from_the_highest_index, "-inf and NaN masking"),
    (map_as_int8, "values (tie-free)"),
    (pre_softmax_unmasked, "values (tie-free)"),
]


# ---- aux scores, aux loss, z-loss mutants ----------------------------------


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


def aux_without_eps(x, k, sf):  # v / sum(v): an all -inf row is 0 / 0
    s, m = aux_ref(x, k, sf)
    if sf == "softmax":
        return s, m
    xf = x.astype(jnp.float32)
    v = jax.nn.sigmoid(xf) if sf == "sigmoid" else jnp.sqrt(jax.nn.softplus(xf))
    return v / jnp.sum(v, -1, keepdims=True), m


def aux_normalised_over_the_selected(x, k, sf):  # top-k's normalisation leaks into the aux scores
    s, m = aux_ref(x, k, sf)
    if sf == "softmax":
        return s, m
    v = jnp.where(m, s, 0.0)
    return jnp.where(m, v / (jnp.sum(v, -1, keepdims=True) + 1e-20), s), m


def aux_crashes_on_empty(x, k, sf):
    if x.size == 0:
        raise ValueError("cannot route zero tokens")
    return aux_ref(x, k, sf)


def loss_without_e(p, n, k, c):  # coeff / (K T^2): the E of E * coeff forgotten
    return (loss_ref(p, n, k, c).astype(jnp.float32) / p.shape[-1]).astype(p.dtype)


def loss_in_fp32(p, n, k, c):
    return loss_ref(p, n, k, c).astype(jnp.float32)


def loss_grad_without_the_coefficient(p, n, k, c):  # a hand-written backward: g * tpe, C forgotten
    v = loss_ref(p, n, k, c)
    raw = jnp.sum(p.astype(jnp.float32) * jnp.broadcast_to(n.astype(jnp.float32), p.shape)).astype(v.dtype)
    return jax.lax.stop_gradient(v) + (raw - jax.lax.stop_gradient(raw))


def z_mean_over_unmasked_rows(x, c):  # an all -inf row left out of T
    rows = x.reshape(-1, x.shape[-1])
    live = jnp.sum(jnp.any(jnp.isfinite(rows), -1)).astype(jnp.float32)
    return z_ref(x, c) * rows.shape[0] / jnp.maximum(live, 1.0)


def z_in_logits_dtype(x, c):
    return z_ref(x, c).astype(x.dtype)


OTHER_MUTANTS = [
    (check_aux_scores, aux_unnormalised, "values (tie-free)"),
    (check_aux_scores, aux_scores_in_logits_dtype, "values (tie-free)"),
    (check_aux_loss, loss_over_t, "value and dtype"),
    (check_aux_loss, loss_without_k, "value and dtype"),
    (check_aux_loss, loss_grad_doubled, "gradient"),
    (check_router_z_loss, z_sum_not_mean, "value and dtype"),
    (check_router_z_loss, z_naive_lse, "gradient"),
    (check_aux_scores, aux_without_eps, "-inf and NaN masking"),
    (check_aux_scores, aux_normalised_over_the_selected, "values (tie-free)"),
    (check_aux_scores, aux_crashes_on_empty, "jit, vmap, grad, leading dims, T=0"),
    (check_aux_loss, loss_without_e, "value and dtype"),
    (check_aux_loss, loss_in_fp32, "value and dtype"),
    (check_aux_loss, loss_grad_without_the_coefficient, "gradient"),
    (check_router_z_loss, z_mean_over_unmasked_rows, "value and dtype"),
    (check_router_z_loss, z_in_logits_dtype, "value and dtype"),
]
