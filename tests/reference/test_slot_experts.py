"""The expert FFN in capacity slots (``moe(..., grouped_matmul="slots")``,
gpurouter/reference/slot_experts.py) against a NumPy float64 oracle, row by
row: values, every gradient (against the oracle's gradients, written out),
both plans (slots when the largest group fits ``SLOTS_MAX_FACTOR`` times
the mean, else the largest slots and tiles past them, with tiles small enough
here for several tiles and chunks) and the boundary between them, empty
groups and rows past the groups."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpurouter.reference import slot_experts
from gpurouter.reference.moe import ACTIVATIONS, _expert_ffn, rows_of_groups
from gpurouter.reference.slot_experts import SLOTS_MAX_FACTOR, slot_capacities, slots_expert_ffn

H, M = 5, 4
NP_ACT = {"silu": lambda v: v / (1 + np.exp(-v)), "relu": lambda v: np.maximum(v, 0), "linear": lambda v: v}


def _operands(sizes, n, seed=0, biases=True):
    rng = np.random.default_rng(seed)
    g = len(sizes)
    p = dict(xs=rng.normal(size=(n, H)), w_rows=rng.uniform(0.1, 1, size=n),
             wi_0=rng.normal(size=(g, H, M)) * 0.5, wi_1=rng.normal(size=(g, H, M)) * 0.5,
             wo=rng.normal(size=(g, M, H)) * 0.5,
             wi_0_bias=rng.normal(size=(g, M)) if biases else None,
             wi_1_bias=rng.normal(size=(g, M)) if biases else None,
             wo_bias=rng.normal(size=(g, H)) if biases else None)
    return p, rng.normal(size=(n, H))


def _oracle(p, sizes, act, early):
    """``z[i]`` row by row in float64; 0 past the groups."""
    n = p["xs"].shape[0]
    z = np.zeros((n, H))
    ends = np.cumsum(sizes)
    for i in range(int(ends[-1]) if len(ends) else 0):
        g = int(np.searchsorted(ends, i, side="right"))
        a, b = p["xs"][i] @ p["wi_0"][g], p["xs"][i] @ p["wi_1"][g]
        if p["wi_0_bias"] is not None:
            a, b = a + p["wi_0_bias"][g], b + p["wi_1_bias"][g]
        h = NP_ACT[act](a) * b
        w = p["w_rows"][i] if early else 1.0
        z[i] = (h * w) @ p["wo"][g] + (0 if p["wo_bias"] is None else p["wo_bias"][g] * w)
    return z


def _slots(p, sizes, act, early):
    sizes = jnp.asarray(sizes, jnp.int32)
    n = p["xs"].shape[0]
    return slots_expert_ffn(p["xs"], rows_of_groups(sizes, n), sizes, p["w_rows"],
                            **{k: v for k, v in p.items() if k not in ("xs", "w_rows")},
                            activation=ACTIVATIONS[act], early=early, dtype=jnp.float64)


def _check(sizes, n, act="silu", early=True, biases=True, seed=0):
    p, ct = _operands(sizes, n, seed, biases)
    with jax.enable_x64(True):
        p = {k: None if v is None else jnp.asarray(v) for k, v in p.items()}
        z, vjp = jax.vjp(jax.jit(lambda q: _slots(q, sizes, act, early)), p)
        np.testing.assert_allclose(np.asarray(z), _oracle({k: None if v is None else np.asarray(v)
                                                           for k, v in p.items()}, sizes, act, early),
                                   rtol=1e-12, atol=1e-12)
        (got,) = vjp(jnp.asarray(ct))
        # the gradients against the row-by-row FFN's (jax.lax.ragged_dot, autodiff), itself
        # checked against a dense oracle in tests/ops/test_moe.py
        want = jax.grad(lambda q: jnp.vdot(_expert_ffn(
            q["xs"], rows_of_groups(jnp.asarray(sizes, jnp.int32), n), jnp.asarray(sizes, jnp.int32),
            q["w_rows"], **{k: v for k, v in q.items() if k not in ("xs", "w_rows")},
            activation=ACTIVATIONS[act], early=early, align_size=0, grouped_matmul=jax.lax.ragged_dot,
            dtype=jnp.float64), jnp.asarray(ct)))(p)
        for k, v in want.items():
            if v is not None:
                np.testing.assert_allclose(np.asarray(got[k]), np.asarray(v), rtol=1e-10, atol=1e-12, err_msg=k)


def test_capacities_stop_at_the_max_factor():
    caps = slot_capacities(64, 4)  # mean 16
    assert caps[0] == 8 and caps[-1] == 24 == SLOTS_MAX_FACTOR * 16
    assert all(c % 8 == 0 for c in caps) and list(caps) == sorted(set(caps))
    assert slot_capacities(3, 8) == (8,)  # a mean below one row: one capacity of 8


@pytest.mark.parametrize("sizes,n,act,early,biases", [
    ([3, 2, 4], 9, "silu", True, True),          # balanced: slots
    ([3, 2, 4], 12, "relu", False, True),        # rows past the groups
    ([0, 5, 4, 0], 10, "silu", True, False),     # empty groups
    ([12, 0, 1], 14, "linear", True, True),      # skewed past 1.5x the mean: slots of 8 and tiles
    ([12, 0, 1], 13, "silu", False, False),
    ([30, 1, 1, 0], 33, "silu", True, True),     # 14 rows past 16 slots: 7 two-row tiles in 4 chunks
])
def test_matches_the_oracle(sizes, n, act, early, biases, monkeypatch):
    if sum(sizes) > 30:
        monkeypatch.setattr(slot_experts, "TILE", 2)
        monkeypatch.setattr(slot_experts, "CHUNK", 2)
    _check(sizes, n, act, early, biases)


@pytest.mark.parametrize("largest", [24, 25])
def test_both_sides_of_the_largest_capacity(largest):
    """Mean 16 over 4 groups: a largest group of 24 rows fits the largest slot
    capacity (1.5x); 25 does not: its last row goes to a tile."""
    sizes = [largest, 64 - largest - 20, 10, 10]
    assert (largest <= slot_capacities(64, 4)[-1]) == (largest == 24)
    _check(sizes, 64, seed=largest)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=5), st.integers(0, 4), st.booleans())
def test_any_group_sizes(sizes, tail, early):
    """Any sizes (empty, skewed, all in one group) and any rows past them;
    3-row tiles, 2 a chunk."""
    if sum(sizes) == 0:
        sizes = sizes[:-1] + [1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slot_experts, "TILE", 3)
        mp.setattr(slot_experts, "CHUNK", 2)
        _check(sizes, sum(sizes) + tail, early=early, biases=early)


def test_bf16_is_the_row_ffns_on_batched_ragged_dot():
    """In bf16 (the block's dtype on GPUs): the row-by-row FFN on
    ``batched_ragged_dot`` within bf16 rounding, values and gradients."""
    from gpurouter.reference.grouped_matmul import batched_ragged_dot
    sizes = jnp.asarray([6, 3, 0, 7], jnp.int32)
    n = 18
    p, ct = _operands(list(sizes), n, seed=3)
    p = {k: None if v is None else jnp.asarray(v, jnp.bfloat16 if k != "w_rows" else jnp.float32)
         for k, v in p.items()}
    rows_e = rows_of_groups(sizes, n)
    kw = dict(activation=jax.nn.silu, early=True, dtype=jnp.bfloat16)

    def run(fn):
        f = jax.jit(lambda q: fn(q["xs"], rows_e, sizes, q["w_rows"],
                                 **{k: v for k, v in q.items() if k not in ("xs", "w_rows")}))
        z, vjp = jax.vjp(f, p)
        return z, vjp(jnp.asarray(ct, jnp.float32))[0]

    z, g = run(lambda *a, **w: slots_expert_ffn(*a, **w, **kw))
    z0, g0 = run(lambda *a, **w: _expert_ffn(*a, **w, **kw, align_size=0, grouped_matmul=batched_ragged_dot))
    assert z.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(z), np.asarray(z0), rtol=2e-2, atol=2e-2)
    for k, v in g0.items():
        if v is not None:
            assert g[k].dtype == v.dtype, k
            np.testing.assert_allclose(np.asarray(g[k], np.float32), np.asarray(v, np.float32),
                                       rtol=3e-2, atol=3e-2, err_msg=k)


def test_no_rows_give_an_empty_output_and_zero_gradients():
    """``slots_expert_ffn`` on ``[0, H]`` rows (an expert-parallel device, or a
    block, with none): ``[0, H]`` in fp32 and zero weight gradients (the slots'
    gathers need a row, so there are no slots at all)."""
    h, e, m = 8, 4, 6
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    w = dict(wi_0=jax.random.normal(ks[0], (e, h, m)), wi_1=jax.random.normal(ks[1], (e, h, m)),
             wo=jax.random.normal(ks[2], (e, m, h)))

    def f(w_):
        return slots_expert_ffn(jnp.zeros((0, h), jnp.bfloat16), jnp.zeros((0,), jnp.int32),
                                jnp.zeros((e,), jnp.int32), jnp.zeros((0,)), **w_, wi_0_bias=None, wi_1_bias=None,
                                wo_bias=None, activation=jax.nn.silu, early=False, dtype=jnp.bfloat16)

    z = f(w)
    assert z.shape == (0, h) and z.dtype == jnp.float32
    g = jax.grad(lambda w_: jnp.sum(f(w_)))(w)
    assert all(not np.asarray(v).any() for v in g.values())
