"""The block's slot FFN from tokens to tokens (``slots_token_ffn``, on
gpurouter/reference/slot_frame.py's token frame) against a NumPy float64
oracle, token by token: values, and every gradient (tokens, routing weights,
weights and biases) against the jnp oracle's autodiff; the slots alone and
the largest slots with tiles past them (small tiles: several tiles and
chunks), empty experts, and hypothesis-drawn routings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpurouter.reference import slot_experts
from gpurouter.reference.moe import ACTIVATIONS
from gpurouter.reference.slot_experts import slot_capacities, slots_token_ffn

H, M = 5, 4
NP_ACT = {"silu": lambda v: v / (1 + np.exp(-v)), "relu": lambda v: np.maximum(v, 0), "linear": lambda v: v}
KEYS = ("wi_0", "wi_1", "wo", "wi_0_bias", "wi_1_bias", "wo_bias")


def _routing(t, e, k, hot, seed):
    """``idx [T, K]``: distinct experts a token; the first ``hot`` tokens all pick expert 0."""
    rng = np.random.default_rng(seed)
    score = rng.random((t, e))
    score[:hot, 0] = 2.0
    return np.argsort(-score, axis=1)[:, :k].astype(np.int32)


def _operands(t, e, seed, biases=True):
    rng = np.random.default_rng(seed + 100)
    p = dict(wi_0=rng.normal(size=(e, H, M)) * 0.5, wi_1=rng.normal(size=(e, H, M)) * 0.5,
             wo=rng.normal(size=(e, M, H)) * 0.5,
             wi_0_bias=rng.normal(size=(e, M)) if biases else None,
             wi_1_bias=rng.normal(size=(e, M)) if biases else None,
             wo_bias=rng.normal(size=(e, H)) if biases else None)
    return rng.normal(size=(t, H)), p, rng.normal(size=(t, H))


def _np_oracle(x, idx, wt, p, act):
    """``out[t] = sum_k w_tk (act(x W0 + b0) * (x W1 + b1)) Wo + w_tk bo`` in float64."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(idx[t]):
            a, b = x[t] @ p["wi_0"][e], x[t] @ p["wi_1"][e]
            if p["wi_0_bias"] is not None:
                a, b = a + p["wi_0_bias"][e], b + p["wi_1_bias"][e]
            bo = 0 if p["wo_bias"] is None else p["wo_bias"][e]
            out[t] += wt[t, j] * ((NP_ACT[act](a) * b) @ p["wo"][e] + bo)
    return out


def _jnp_oracle(x, idx, wt, p, act):
    """The same in jnp, dense over the K picks (its autodiff: the gradients' oracle)."""
    def pick(name):
        return None if p[name] is None else p[name][idx]
    a = jnp.einsum("th,tkhm->tkm", x, pick("wi_0"))
    b = jnp.einsum("th,tkhm->tkm", x, pick("wi_1"))
    if p["wi_0_bias"] is not None:
        a, b = a + pick("wi_0_bias"), b + pick("wi_1_bias")
    y = jnp.einsum("tkm,tkmh->tkh", ACTIVATIONS[act](a) * b, pick("wo"))
    if p["wo_bias"] is not None:
        y = y + pick("wo_bias")
    return jnp.sum(wt[..., None] * y, axis=1)


def _check(t, e, k, hot, act="silu", biases=True, seed=0):
    x, p, ct = _operands(t, e, seed, biases)
    idx = _routing(t, e, k, hot, seed)
    wt = np.random.default_rng(seed + 7).uniform(0.1, 1, size=(t, k))
    with jax.enable_x64(True):
        jp = {n: None if v is None else jnp.asarray(v) for n, v in p.items()}

        def slots(x_, wt_, p_):
            return slots_token_ffn(x_, jnp.asarray(idx), wt_, **p_, activation=ACTIVATIONS[act], dtype=jnp.float64)
        out, vjp = jax.vjp(jax.jit(slots), jnp.asarray(x), jnp.asarray(wt), jp)
        assert out.shape == (t, H) and out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), _np_oracle(x, idx, wt, p, act), rtol=1e-12, atol=1e-12)
        got = vjp(jnp.asarray(ct))
        want = jax.grad(lambda x_, wt_, p_: jnp.vdot(_jnp_oracle(x_, jnp.asarray(idx), wt_, p_, act), jnp.asarray(ct)),
                        argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(wt), jp)
        for what, g, w in zip(("d x", "d weights"), got[:2], want[:2], strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-11, err_msg=what)
        for n in KEYS:
            if p[n] is not None:
                np.testing.assert_allclose(np.asarray(got[2][n]), np.asarray(want[2][n]), rtol=1e-10, atol=1e-11,
                                           err_msg=n)


@pytest.mark.parametrize("t,e,k,hot,act,biases", [
    (12, 4, 2, 0, "silu", True),      # balanced: slots alone
    (10, 6, 2, 0, "relu", False),     # some experts without a token
    (16, 8, 2, 16, "linear", True),   # expert 0 in every token: 16 rows, past slots of 8 (mean 4): tiles
    (24, 12, 3, 20, "silu", True),    # 20 rows on expert 0, past slots of 16 (mean 6): tiles
])
def test_matches_the_oracle(t, e, k, hot, act, biases, monkeypatch):
    monkeypatch.setattr(slot_experts, "TILE", 2)
    monkeypatch.setattr(slot_experts, "CHUNK", 2)
    _check(t, e, k, hot, act, biases)


def test_the_tiles_run_when_the_largest_expert_is_past_the_slots():
    """The skewed cases above do reach the tiles: the largest expert's rows
    exceed the largest capacity."""
    for t, e, k, hot in ((16, 8, 2, 16), (24, 12, 3, 20)):
        largest = np.bincount(_routing(t, e, k, hot, 0).reshape(-1), minlength=e).max()
        assert largest > slot_capacities(t * k, e)[-1]


@settings(max_examples=6, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.data())
def test_any_routing(t, e, data):
    """Any T, E, K <= E and any number of tokens on one expert; 3-row tiles,
    2 a chunk."""
    k = data.draw(st.integers(1, e))
    hot = data.draw(st.integers(0, t))
    biases = data.draw(st.booleans())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slot_experts, "TILE", 3)
        mp.setattr(slot_experts, "CHUNK", 2)
        _check(t, e, k, hot, biases=biases, seed=t * 7 + e)
