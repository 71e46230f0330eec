"""No false alarms: an independent, clean jnp router, written here from
docs/contract.md sections 2-3 (not from gpurouter.reference), passes
``check_topk`` at ``max_examples=30`` under several seeds, as gpurouter's
reference does (tests/testing/test_dogfood.py). The mutants' side is
tests/testing/test_mutants.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gpurouter as gr
from gpurouter.testing import check_topk


def _sqrtsoftplus(x):
    # contract section 2: softplus(x) = x above 20; sqrt(softplus(x)) = exp(x / 2) below -20. Each branch
    # gets an input where it is finite, so the unused branches give no NaN gradients.
    big = jnp.sqrt(jnp.where(x > 20, x, 21.0))
    small = jnp.exp(jnp.where(x < -20, x, -21.0) / 2)
    mid = jnp.sqrt(jnp.log1p(jnp.exp(jnp.clip(x, -20, 20))))
    return jnp.where(x > 20, big, jnp.where(x < -20, small, mid))


def _first_k(key, eligible, k):
    """Indices of the top ``k``: eligible first, larger key first, then the lower index."""
    idx = jnp.broadcast_to(jnp.arange(key.shape[-1]), key.shape)
    order = jnp.lexsort((idx, -key + 0.0, ~eligible), axis=-1)
    return order[..., :k]


def clean_router(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
                 expert_bias):
    x = logits.astype(jnp.float32)
    E = x.shape[-1]
    if score_function == "softmax":
        s = jax.nn.softmax(x, axis=-1) if use_pre_softmax else x
    else:
        s = jax.nn.sigmoid(x) if score_function == "sigmoid" else _sqrtsoftplus(x)
    r = s if expert_bias is None else s + jnp.broadcast_to(expert_bias.astype(jnp.float32), x.shape)
    key = jax.lax.stop_gradient(jnp.where(jnp.isnan(r), -jnp.inf, r))  # NaN counts as -inf
    eligible = jnp.ones(x.shape, bool)
    if group_topk > 0:
        size = E // num_groups
        per = jnp.sort(key.reshape(x.shape[:-1] + (num_groups, size)), axis=-1)[..., ::-1][..., :topk // group_topk]
        gsel = _first_k(jnp.sum(per, -1), jnp.ones(per.shape[:-1], bool), group_topk)
        kept = jnp.any(jax.nn.one_hot(gsel, num_groups, dtype=bool), axis=-2)
        eligible = jnp.repeat(kept, size, axis=-1)
    sel = _first_k(key, eligible, topk)
    m = jnp.any(jax.nn.one_hot(sel, E, dtype=bool), axis=-2)
    if score_function == "softmax":
        t = s if use_pre_softmax else jax.nn.softmax(jnp.where(m, x, -jnp.inf), axis=-1)
    else:
        v = jnp.where(m, s, 0.0)
        total = jnp.sum(v, -1, keepdims=True)
        # a row whose selected scores are all 0 (all -inf logits) has weights 0 and a zero gradient:
        # d/dS of v / (S + 1e-20) there is 0 / 1e-40, which float32 flushes to 0 / 0 (contract section 3)
        safe = jnp.where(total > 0, total, 1.0)
        t = jnp.where(total > 0, v / (safe + 1e-20), 0.0) if topk > 1 else v
    return jnp.where(m, scaling_factor * t, 0.0).astype(logits.dtype), m


def test_clean_router_passes_cheap():
    report = check_topk(clean_router, max_examples=5, seed=0, grads=False,
                        properties=["values (tie-free)", "tie rule", "-inf and NaN masking"])
    assert report.passed


def reference(*args):
    return gr.fused_topk_with_score_function(*args, backend="jax")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("router", [clean_router, reference], ids=["clean", "reference"])
def test_correct_routers_pass_every_property_at_30_examples(router, seed):
    report = check_topk(router, max_examples=30, seed=seed)
    print(report)
    assert report.passed
