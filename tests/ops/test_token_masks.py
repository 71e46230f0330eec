"""Token masks and traced token counts (docs/contract.md section 10) on the
losses and ``tokens_per_expert``, jax backend and reference, against the
float64 oracles of gpurouter.testing.oracle applied to the valid rows only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from public_helpers import masked_losses_under_axis_name

import gpurouter as gr
from gpurouter import reference as ref
from gpurouter.testing import oracle as oracles

MASK = np.array([1, 0, 1, 1, 0, 1, 1, 1], bool)


def _probs(seed=0):
    rng = np.random.default_rng(seed)
    p = rng.random((8, 6)).astype(np.float32)
    return p / p.sum(axis=1, keepdims=True)


def test_tokens_per_expert_counts_valid_rows_only():
    m = np.random.default_rng(1).random((2, 4, 10)) > 0.6
    got = gr.tokens_per_expert(m, token_mask=MASK.reshape(2, 4))
    np.testing.assert_array_equal(np.asarray(got), m.reshape(8, 10)[MASK].sum(axis=0))
    packed = gr.pack_routing_map(m)
    got = gr.tokens_per_expert(packed, 10, token_mask=MASK)
    np.testing.assert_array_equal(np.asarray(got), m.reshape(8, 10)[MASK].sum(axis=0))


@pytest.mark.parametrize("fn", [gr.fused_moe_aux_loss, ref.fused_moe_aux_loss])
def test_masked_aux_loss_is_the_loss_of_the_valid_rows(fn):
    p, tpe = _probs(), np.array([3, 1, 0, 2, 4, 2], np.int32)
    got = fn(p, tpe, 2, 0.1, token_mask=MASK)
    want, _ = oracles.aux_loss_fwd(p[MASK], tpe, 2, 0.1, total_num_tokens=int(MASK.sum()))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    grad = jax.grad(lambda q: fn(q, tpe, 2, 0.1, token_mask=MASK))(p)
    assert not np.asarray(grad)[~MASK].any()
    np.testing.assert_allclose(np.asarray(grad)[MASK],
                               oracles.aux_loss_bwd(0.1 * 6 / (2 * 36), tpe, 1.0, 6), rtol=1e-5)


@pytest.mark.parametrize("fn", [gr.router_z_loss, ref.router_z_loss])
def test_masked_z_loss_is_the_loss_of_the_valid_rows(fn):
    x = np.asarray(np.random.default_rng(2).normal(size=(2, 4, 6)) * 3, np.float32)
    x[0, 1, 2] = np.nan  # a masked row's NaN goes nowhere
    got = fn(x, 0.01, token_mask=MASK.reshape(2, 4))
    want = oracles.z_loss(x.reshape(8, 6)[MASK], 0.01)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    grad = np.asarray(jax.grad(lambda z: fn(z, 0.01, token_mask=MASK))(x)).reshape(8, 6)
    assert not grad[~MASK].any()
    np.testing.assert_allclose(grad[MASK], oracles.z_loss_grad(x.reshape(8, 6)[MASK], 0.01), rtol=1e-4, atol=1e-7)


def test_all_masked_gives_zero_losses():
    none = np.zeros(8, bool)
    assert float(gr.router_z_loss(np.ones((8, 6), np.float32), 1.0, token_mask=none)) == 0.0
    assert float(gr.fused_moe_aux_loss(_probs(), np.zeros(6, np.int32), 2, 1.0, token_mask=none)) == 0.0


def test_mask_under_axis_name_uses_the_global_valid_count():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 JAX devices (tests/conftest.py asks for 8 host devices)")
    mesh = jax.make_mesh((4,), ("data",), devices=devices[:4])
    p = _probs(3)
    tpe_local = np.asarray(np.random.default_rng(3).integers(0, 5, (4, 6)), np.int32)
    x = np.asarray(np.random.default_rng(4).normal(size=(8, 6)), np.float32)

    aux, zl = masked_losses_under_axis_name(mesh, p, tpe_local, x, MASK)
    want_aux, _ = oracles.aux_loss_fwd(p[MASK], tpe_local.sum(axis=0), 2, 0.1, total_num_tokens=int(MASK.sum()))
    np.testing.assert_allclose(float(aux), want_aux, rtol=1e-5)
    np.testing.assert_allclose(float(zl), oracles.z_loss(x[MASK], 0.01), rtol=1e-5)


def test_traced_total_num_tokens_compiles_once():
    p, tpe = _probs(), np.array([3, 1, 0, 2, 4, 2], np.int32)
    x = np.asarray(np.random.default_rng(5).normal(size=(8, 6)), np.float32)
    traces = []

    @jax.jit
    def step(q, z, total):
        traces.append(1)
        return (gr.fused_moe_aux_loss(q, tpe, 2, 0.1, total_num_tokens=total),
                gr.router_z_loss(z, 0.01, total_num_tokens=total))

    for total in (8, 20, 1000):
        aux, zl = step(p, x, jnp.int32(total))
        np.testing.assert_allclose(float(aux), oracles.aux_loss_fwd(p, tpe, 2, 0.1, total_num_tokens=total)[0],
                                   rtol=1e-5)
        np.testing.assert_allclose(float(zl), oracles.z_loss(x, 0.01, total_num_tokens=total), rtol=1e-5)
    aux = step(p, x, jnp.float32(16.0))[0]  # a float scalar: one more trace (its dtype)
    np.testing.assert_allclose(float(aux), oracles.aux_loss_fwd(p, tpe, 2, 0.1, total_num_tokens=16)[0], rtol=1e-5)
    assert len(traces) == 2


def test_update_expert_bias_with_a_mask_counts_the_valid_rows_of_the_map():
    m = np.random.default_rng(6).random((8, 6)) > 0.5
    bias = np.asarray(np.linspace(-0.1, 0.1, 6), np.float32)
    counts = m[MASK].sum(axis=0)
    want = oracles.update_expert_bias(bias, counts, 0.01)
    for routing_map in (m, gr.pack_routing_map(m)):
        got = gr.update_expert_bias(bias, routing_map, 0.01, token_mask=MASK)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    with pytest.raises(ValueError, match="update_expert_bias: tokens_per_expert \\(shape \\(6,\\), int32\\) must be "
                                         "a routing map"):
        gr.update_expert_bias(bias, np.ones(6, np.int32), 0.01, token_mask=MASK)
