"""An independent audit of issue #37's token masks on the losses and the
traced ``total_num_tokens`` (docs/contract.md section 10) through the
public API, on ``backend="jax"`` and ``"numba"`` (the CUDA simulator in CI).

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
    _sig,
)
from public_helpers import masked_losses_under_axis_name

import gpurouter as gr

# --------------------------------------------------------------------------- masks on the losses

R, C = 6, 8
MASK = np.array([True, False, True, True, False, True])


def _aux_probs(seed=0):
    rng = np.random.default_rng(seed)
    p = rng.random((R, C))
    return np.asarray(p / p.sum(1, keepdims=True), np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_loss_token_mask(backend):
    """Masked rows count nowhere; T defaults to the valid count; masked rows get zero
    gradient even when they hold NaN or inf."""
    p = _aux_probs()
    p[1] = np.nan
    p[4, 0] = np.inf
    n = np.array([3, 1, 0, 2, 4, 2, 0, 4], np.int32)
    k, coeff = 2, 0.1
    loss, grad = jax.value_and_grad(lambda q: gr.fused_moe_aux_loss(q, n, k, coeff, token_mask=MASK,
                                                                    backend=backend))(p)
    tv = MASK.sum()
    cf = C * coeff / (k * tv * tv)
    want = cf * (p[MASK].astype(np.float64).sum(0) * n).sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    want_g = np.where(MASK[:, None], cf * n[None, :], 0.0)
    np.testing.assert_allclose(np.asarray(grad), want_g, rtol=1e-5)
    assert np.isfinite(np.asarray(grad)).all()
    # an explicit total_num_tokens overrides the valid count, concrete or traced
    got = gr.fused_moe_aux_loss(p, n, k, coeff, token_mask=MASK, total_num_tokens=10, backend=backend)
    np.testing.assert_allclose(float(got), want * tv * tv / 100, rtol=1e-5)
    got = jax.jit(lambda q, tt: gr.fused_moe_aux_loss(q, n, k, coeff, token_mask=MASK, total_num_tokens=tt,
                                                      backend=backend))(p, jnp.int32(10))
    np.testing.assert_allclose(float(got), want * tv * tv / 100, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_scores_tokens_per_expert_path_with_a_mask(backend):
    """The aux scores' routing map counted with tokens_per_expert(token_mask=), into the aux
    loss with the same mask: the loss of the valid tokens alone.

    The issue names "the aux scores' tokens_per_expert path" without saying where the mask
    goes; the contract (sections 6 and 10) puts it on the counting and the loss, and a mask on
    the router op itself without QB is a ValueError (it would do nothing there). This test
    follows the contract."""
    rng = np.random.default_rng(3)
    x = np.asarray(rng.normal(size=(R, C)), np.float32)
    scores, amap = gr.fused_topk_with_score_function(x, 2, score_function="sigmoid", compute_aux_scores=True,
                                                     backend=backend)
    n = gr.tokens_per_expert(amap, token_mask=MASK)
    assert n.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(n), np.asarray(amap)[MASK].sum(0))
    loss = gr.fused_moe_aux_loss(scores, n, 2, 1e-2, token_mask=MASK, backend=backend)
    v = _sig(x[MASK])
    v /= v.sum(1, keepdims=True)
    cnt = np.zeros(C)
    for row in v:
        cnt[_order(row)[:2]] += 1
    tv = MASK.sum()
    np.testing.assert_allclose(float(loss), C * 1e-2 / (2 * tv * tv) * (v.sum(0) * cnt).sum(), rtol=1e-5)


def test_tokens_per_expert_mask_shapes_and_formats():
    """Masked rows add nothing; the mask in the tokens' shape or flat; a bitmap too."""
    rng = np.random.default_rng(4)
    m = rng.random((2, 3, 10)) < 0.3
    mask = np.array([[True, False, True], [False, True, True]])
    want = m[mask].sum(0)
    np.testing.assert_array_equal(np.asarray(gr.tokens_per_expert(m, token_mask=mask)), want)
    np.testing.assert_array_equal(np.asarray(gr.tokens_per_expert(m, token_mask=mask.reshape(-1))), want)
    bits = gr.pack_routing_map(m)
    np.testing.assert_array_equal(np.asarray(gr.tokens_per_expert(bits, 10, token_mask=mask)), want)
    with pytest.raises(TypeError, match="token_mask"):
        gr.tokens_per_expert(m, token_mask=mask.astype(np.int32))
    with pytest.raises(ValueError, match="token_mask"):
        gr.tokens_per_expert(m, token_mask=np.ones(5, bool))


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_z_loss_token_mask(backend):
    """coeff * sum over valid tokens of lse^2 / T_valid; masked rows (NaN included) 0 gradient."""
    rng = np.random.default_rng(6)
    x = np.asarray(rng.normal(size=(R, C)) * 3, np.float32)
    x[4] = np.nan
    coeff = 0.01
    loss, g = jax.value_and_grad(lambda z: gr.router_z_loss(z, coeff, token_mask=MASK, backend=backend))(x)
    x64 = np.where(MASK[:, None], x, 0.0).astype(np.float64)   # the masked NaN row plays no part
    mx = x64.max(1, keepdims=True)
    lse = (mx + np.log(np.exp(x64 - mx).sum(1, keepdims=True)))[:, 0]
    tv = MASK.sum()
    np.testing.assert_allclose(float(loss), coeff * (lse[MASK] ** 2).sum() / tv, rtol=1e-5)
    sm = np.exp(x64 - lse[:, None])
    want_g = np.where(MASK[:, None], 2 * coeff / tv * lse[:, None] * sm, 0.0)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-4, atol=1e-7)
    # the mask in the tokens' shape [..., T]
    loss3 = gr.router_z_loss(x.reshape(2, 3, C), coeff, token_mask=MASK.reshape(2, 3), backend=backend)
    np.testing.assert_allclose(float(loss3), float(loss), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_masked_gives_zero_losses_and_gradients(backend):
    none = np.zeros(R, bool)
    p, x = _aux_probs(), np.ones((R, C), np.float32)
    n = np.ones(C, np.int32)
    la, ga = jax.value_and_grad(lambda q: gr.fused_moe_aux_loss(q, n, 2, 1.0, token_mask=none, backend=backend))(p)
    lz, gz = jax.value_and_grad(lambda z: gr.router_z_loss(z, 1.0, token_mask=none, backend=backend))(x)
    assert float(la) == 0.0 and float(lz) == 0.0
    assert not np.asarray(ga).any() and not np.asarray(gz).any()


def test_update_expert_bias_token_mask_counts_valid_rows():
    """With a mask the second argument is the routing map; the counts are its valid rows'
    (bias + rate * sign(mean(n) - n))."""
    rng = np.random.default_rng(7)
    m = rng.random((R, C)) < 0.4
    bias = np.asarray(rng.normal(size=C) * 0.1, np.float32)
    got = gr.update_expert_bias(bias, m, 1e-3, token_mask=MASK)
    n = m[MASK].sum(0).astype(np.float64)
    want = bias + 1e-3 * np.sign(n.mean() - n)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-7)
    got_bits = gr.update_expert_bias(bias, gr.pack_routing_map(m), 1e-3, token_mask=MASK)
    np.testing.assert_array_equal(np.asarray(got_bits), np.asarray(got))
    with pytest.raises(ValueError, match="token_mask"):   # with a mask: the map, not counts
        gr.update_expert_bias(bias, jnp.asarray(m.sum(0), jnp.int32), 1e-3, token_mask=MASK)
    # without a mask it takes counts, as before
    np.testing.assert_array_equal(np.asarray(gr.update_expert_bias(bias, jnp.asarray(m[MASK].sum(0), jnp.int32),
                                                                   1e-3)), np.asarray(got))


@pytest.mark.parametrize("fn", ["aux", "z"])
def test_loss_mask_errors_name_the_argument(fn):
    p = _aux_probs()
    n = np.ones(C, np.int32)
    call = ((lambda mk: gr.fused_moe_aux_loss(p, n, 2, 1.0, token_mask=mk, backend="jax")) if fn == "aux"
            else (lambda mk: gr.router_z_loss(p, 1.0, token_mask=mk, backend="jax")))
    with pytest.raises(TypeError, match="token_mask"):
        call(MASK.astype(np.float32))
    with pytest.raises(ValueError, match="token_mask"):
        call(MASK[:4])


def test_loss_masks_under_axis_name_use_the_global_valid_count():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 JAX devices (tests/conftest.py asks for 8 host devices)")
    mesh = jax.make_mesh((2,), ("data",), devices=devices[:2])
    p = _aux_probs(8)
    n_local = np.asarray(np.random.default_rng(8).integers(0, 5, (2, C)), np.int32)
    x = np.asarray(np.random.default_rng(9).normal(size=(R, C)), np.float32)

    aux, zl = masked_losses_under_axis_name(mesh, p, n_local, x, MASK, backend="jax")
    tv = MASK.sum()
    n = n_local.sum(0)
    np.testing.assert_allclose(float(aux), C * 0.1 / (2 * tv * tv) * (p[MASK].astype(np.float64).sum(0) * n).sum(),
                               rtol=1e-5)
    x64 = x[MASK].astype(np.float64)
    lse = np.log(np.exp(x64).sum(1))
    np.testing.assert_allclose(float(zl), 0.01 * (lse ** 2).sum() / tv, rtol=1e-5)


# --------------------------------------------------------------------------- traced total_num_tokens

@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_total_num_tokens_no_retrace(backend):
    """total_num_tokens may be a traced scalar (int or float): the formula's value for each,
    one trace for every value."""
    p = _aux_probs(1)
    n = np.array([3, 1, 0, 2, 4, 2, 0, 4], np.int32)
    x = np.asarray(np.random.default_rng(10).normal(size=(R, C)), np.float32)
    traces = []

    @jax.jit
    def step(total):
        traces.append(1)
        return (gr.fused_moe_aux_loss(p, n, 2, 0.1, total_num_tokens=total, backend=backend),
                gr.router_z_loss(x, 0.01, total_num_tokens=total, backend=backend))

    lse = np.log(np.exp(x.astype(np.float64)).sum(1))
    for tot in (6, 11, 40):
        aux, zl = step(jnp.int32(tot))
        np.testing.assert_allclose(float(aux), C * 0.1 / (2 * tot * tot) * (p.sum(0) * n).sum(), rtol=1e-5)
        np.testing.assert_allclose(float(zl), 0.01 * (lse ** 2).sum() / tot, rtol=1e-5)
    assert len(traces) == 1
    # a float scalar too; and a traced T <= 0 is used as it is (the formula's value)
    aux, zl = jax.jit(lambda tt: (gr.fused_moe_aux_loss(p, n, 2, 0.1, total_num_tokens=tt, backend=backend),
                                  gr.router_z_loss(x, 0.01, total_num_tokens=tt, backend=backend)))(
        jnp.float32(-4.0))
    np.testing.assert_allclose(float(aux), C * 0.1 / (2 * 16) * (p.sum(0) * n).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(zl), -0.01 * (lse ** 2).sum() / 4, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concrete_device_scalar_total_num_tokens(backend):
    """A 0-d int or float array (TE's graph-safe aux loss takes a device scalar) outside jit:
    the same value as under jit and as the Python int; a float one used as a value."""
    p = _aux_probs(1)
    n = np.array([3, 1, 0, 2, 4, 2, 0, 4], np.int32)
    x = np.asarray(np.random.default_rng(10).normal(size=(R, C)), np.float32)
    lse = np.log(np.exp(x.astype(np.float64)).sum(1))
    for tot in (jnp.int32(12), jnp.float32(12.0), np.float32(12.0), jnp.float32(12.5)):
        t = float(tot)
        aux = gr.fused_moe_aux_loss(p, n, 2, 0.1, total_num_tokens=tot, backend=backend)
        zl = gr.router_z_loss(x, 0.01, total_num_tokens=tot, backend=backend)
        np.testing.assert_allclose(float(aux), C * 0.1 / (2 * t * t) * (p.sum(0) * n).sum(), rtol=1e-5)
        np.testing.assert_allclose(float(zl), 0.01 * (lse ** 2).sum() / t, rtol=1e-5)
    for bad in (jnp.float32(0.0), jnp.float32(-2.0), jnp.float32(np.nan), jnp.float32(np.inf)):
        with pytest.raises(ValueError, match="total_num_tokens"):
            gr.fused_moe_aux_loss(p, n, 2, 0.1, total_num_tokens=bad, backend=backend)
        with pytest.raises(ValueError, match="total_num_tokens"):
            gr.router_z_loss(x, 0.01, total_num_tokens=bad, backend=backend)


def test_total_num_tokens_errors():
    p = _aux_probs()
    n = np.ones(C, np.int32)
    with pytest.raises(ValueError, match="total_num_tokens"):
        gr.fused_moe_aux_loss(p, n, 2, 1.0, total_num_tokens=0, backend="jax")
    with pytest.raises(ValueError, match="total_num_tokens"):
        gr.router_z_loss(p, 1.0, total_num_tokens=-3, backend="jax")
    with pytest.raises((TypeError, ValueError), match="total_num_tokens"):
        gr.fused_moe_aux_loss(p, n, 2, 1.0, total_num_tokens=jnp.array([4, 4]), backend="jax")
    with pytest.raises(ValueError, match="total_num_tokens"):
        jax.jit(lambda tt: gr.fused_moe_aux_loss(p, n, 2, 1.0, total_num_tokens=tt, backend="jax"))(
            jnp.array([4, 4]))
    with pytest.raises(TypeError, match="total_num_tokens"):
        jax.jit(lambda tt: gr.router_z_loss(p, 1.0, total_num_tokens=tt, backend="jax"))(jnp.array(True))
