"""``token_mask`` inside the numba loss kernels (docs/contract.md section 10;
gpurouter/_ops/aux_loss.py, losses.py: the kernels compiled with
``has_mask``), against the jax backend and the float64 oracles of the valid
rows. Tiny shapes on the CUDA simulator; the ``gpu`` test runs the issue's
shape (T = 65536, E = 384) on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from public_helpers import masked_losses_under_axis_name

import gpurouter as gr
from gpurouter import _backend
from gpurouter.testing import oracle as oracles

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _backend.numba_usable(),
                       reason="backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1"),
]

MASK = np.array([1, 0, 1, 1, 0, 1, 1, 1], bool)
TPE = np.array([3, 1, 0, 2, 4, 2, 5, 1], np.int32)


def _inputs(dtype, seed=0, T=8, E=8):
    rng = np.random.default_rng(seed)
    p = rng.random((T, E)).astype(np.float32)
    x = (rng.normal(size=(T, E)) * 3).astype(np.float32)
    return jnp.asarray(p, dtype), jnp.asarray(x, dtype)


def _jaxpr_text(fn, *args):
    """``fn``'s jaxpr as text."""
    return str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_masked_losses_match_the_jax_backend(dtype):
    p, x = _inputs(dtype)
    mask = jnp.asarray(MASK)

    def losses(q, z, b):
        return (gr.fused_moe_aux_loss(q, TPE, 2, 0.1, token_mask=mask, backend=b),
                gr.router_z_loss(z, 0.01, token_mask=mask, backend=b))

    got = jax.jit(lambda q, z: losses(q, z, "numba"))(p, x)
    want = jax.jit(lambda q, z: losses(q, z, "jax"))(p, x)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(float(a), float(b), rtol=tol)
    z64 = oracles.z_loss(np.asarray(x, np.float32)[MASK], 0.01)
    np.testing.assert_allclose(float(got[1]), z64, rtol=1e-5 if dtype == jnp.float32 else 1e-4)
    for i, arg in ((0, p), (1, x)):
        g = [np.asarray(jax.grad(lambda a, b=b, i=i: losses(*((a, x) if i == 0 else (p, a)), b)[i]
                                 .astype(jnp.float32))(arg), np.float32) for b in ("numba", "jax")]
        assert not g[0][~MASK].any()
        np.testing.assert_allclose(g[0], g[1], rtol=tol, atol=1e-6)


def test_masked_rows_holding_nan_and_inf_add_nothing():
    p, x = (np.array(a) for a in _inputs(jnp.float32, seed=1))
    p[1, 2] = np.nan
    x[4, 0], x[4, 1] = np.inf, np.nan
    mask = jnp.asarray(MASK)
    aux = gr.fused_moe_aux_loss(p, TPE, 2, 0.1, token_mask=mask, backend="numba")
    want, _ = oracles.aux_loss_fwd(p[MASK], TPE, 2, 0.1, total_num_tokens=int(MASK.sum()))
    np.testing.assert_allclose(float(aux), want, rtol=1e-5)
    zl, gz = jax.value_and_grad(lambda z: gr.router_z_loss(z, 0.01, token_mask=mask, backend="numba"))(x)
    np.testing.assert_allclose(float(zl), oracles.z_loss(x[MASK], 0.01), rtol=1e-5)
    gz = np.asarray(gz)
    assert not gz[~MASK].any() and np.isfinite(gz).all()
    np.testing.assert_allclose(gz[MASK], oracles.z_loss_grad(x[MASK], 0.01), rtol=1e-4, atol=1e-7)
    gp = np.asarray(jax.grad(lambda q: gr.fused_moe_aux_loss(q, TPE, 2, 0.1, token_mask=mask, backend="numba"))(p))
    assert not gp[~MASK].any()


def test_all_masked_and_a_traced_count():
    """No valid token: zero losses and gradients (T = max(0, 1)). A traced T
    with a mask: one trace for every value, T used as given."""
    p, x = _inputs(jnp.float32, seed=2)
    none = jnp.zeros(8, bool)
    assert float(gr.fused_moe_aux_loss(p, TPE, 2, 1.0, token_mask=none, backend="numba")) == 0.0
    zl, g = jax.value_and_grad(lambda z: gr.router_z_loss(z, 1.0, token_mask=none, backend="numba"))(x)
    assert float(zl) == 0.0 and not np.asarray(g).any()
    traces = []

    @jax.jit
    def step(q, z, t):
        traces.append(1)
        return (gr.fused_moe_aux_loss(q, TPE, 2, 0.1, total_num_tokens=t, token_mask=MASK, backend="numba"),
                gr.router_z_loss(z, 0.01, total_num_tokens=t, token_mask=MASK, backend="numba"))

    for t in (6, 100):
        aux, zl = step(p, x, jnp.int32(t))
        pv, xv = np.asarray(p)[MASK], np.asarray(x)[MASK]
        np.testing.assert_allclose(float(aux), oracles.aux_loss_fwd(pv, TPE, 2, 0.1, total_num_tokens=t)[0],
                                   rtol=1e-5)
        np.testing.assert_allclose(float(zl), oracles.z_loss(xv, 0.01, total_num_tokens=t), rtol=1e-5)
    assert len(traces) == 1


def test_masked_losses_under_vmap():
    """A batch of masked calls: each element its own valid count (the counting
    kernels run once per element), values and gradients as the jax backend's."""
    rng = np.random.default_rng(4)
    p = jnp.asarray(rng.random((2, 6, 8)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 6, 8)), jnp.float32)
    m = jnp.asarray(rng.random((2, 6)) > 0.3)

    def both(b):
        def f(q, z):
            one = jax.vmap(lambda qq, zz, mm: gr.fused_moe_aux_loss(qq, TPE, 2, 0.1, token_mask=mm, backend=b)
                           + gr.router_z_loss(zz, 0.01, token_mask=mm, backend=b))
            return one(q, z, m)
        return f(p, x), jax.grad(lambda q, z: f(q, z).sum(), argnums=(0, 1))(p, x)

    (got, g_got), (want, g_want) = both("numba"), both("jax")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    for a, b in zip(g_got, g_want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_mask_goes_to_the_kernels_not_a_select():
    """The numba path gives the mask to the kernels: no ``select_n`` over the
    rows in the jaxpr (the jax backend has one)."""
    p, x = _inputs(jnp.float32)
    mask = jnp.asarray(MASK)
    for b, has in (("numba", False), ("jax", True)):
        text = _jaxpr_text(lambda q, z, b=b: (gr.fused_moe_aux_loss(q, TPE, 2, 0.1, token_mask=mask, backend=b),
                                              gr.router_z_loss(z, 0.01, token_mask=mask, backend=b)), p, x)
        assert ("select_n" in text) == has, b


def test_mask_errors_unchanged_on_numba():
    p, x = _inputs(jnp.float32)
    with pytest.raises(TypeError, match="router_z_loss: token_mask must be bool"):
        gr.router_z_loss(x, 0.01, token_mask=np.ones(8, np.int32), backend="numba")
    with pytest.raises(ValueError, match=r"fused_moe_aux_loss: token_mask shape \(7,\)"):
        gr.fused_moe_aux_loss(p, TPE, 2, 0.1, token_mask=np.ones(7, bool), backend="numba")


def test_mask_under_axis_name_and_sharding_uses_the_global_valid_count():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 JAX devices (tests/conftest.py asks for 8 host devices)")
    mesh = jax.make_mesh((4,), ("data",), devices=devices[:4])
    p, x = (np.array(a) for a in _inputs(jnp.float32, seed=3))
    tpe_local = np.asarray(np.random.default_rng(3).integers(0, 5, (4, 8)), np.int32)

    aux, zl = masked_losses_under_axis_name(mesh, p, tpe_local, x, MASK, backend="numba")
    with jax.set_mesh(mesh):  # explicit token sharding (no axis_name): the mask is sharded with the rows
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        ms = jax.device_put(MASK, NamedSharding(mesh, P("data")))
        sharded = jax.jit(lambda z, m: gr.router_z_loss(z, 0.01, token_mask=m, backend="numba"))(xs, ms)
    want_aux, _ = oracles.aux_loss_fwd(p[MASK], tpe_local.sum(axis=0), 2, 0.1, total_num_tokens=int(MASK.sum()))
    np.testing.assert_allclose(float(aux), want_aux, rtol=1e-5)
    np.testing.assert_allclose(float(zl), oracles.z_loss(x[MASK], 0.01), rtol=1e-5)
    np.testing.assert_allclose(float(sharded), oracles.z_loss(x[MASK], 0.01), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_masked_losses_at_the_issue_shape_on_the_gpu(dtype):
    """T = 65536, E = 384, bf16 and fp16, every 10th token masked (the probe's
    mask): the numba kernels against the jax backend, forward and gradient (GPU only)."""
    rng = np.random.default_rng(7)
    T, E = 65536, 384
    p = jnp.asarray(rng.random((T, E)).astype(np.float32), dtype)
    x = jnp.asarray((rng.normal(size=(T, E)) * 3).astype(np.float32), dtype)
    tpe = jnp.asarray(rng.integers(0, 2048, E), jnp.int32)
    mask = jnp.asarray(np.arange(T) % 10 != 0)

    def run(b, transport="auto"):
        kw = dict(token_mask=mask, backend=b, transport=transport)

        def f(q, z):
            return (gr.fused_moe_aux_loss(q, tpe, 8, 1e-2, **kw).astype(jnp.float32)
                    + gr.router_z_loss(z, 1e-3, **kw))
        return jax.jit(lambda q, z: (gr.fused_moe_aux_loss(q, tpe, 8, 1e-2, **kw), gr.router_z_loss(z, 1e-3, **kw),
                                     *jax.grad(f, argnums=(0, 1))(q, z)))(p, x)

    got, want = run("numba"), run("jax")
    for a, b in zip(got, run("numba", "zero-copy"), strict=True):  # auto (ffi where it runs) == zero-copy
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-2)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-4)
    m = np.asarray(mask)
    for g, w in zip(got[2:], want[2:], strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert not g[~m].any()
        np.testing.assert_allclose(g[m], w[m], rtol=2e-2, atol=1e-6)
    print(f"masked losses at T=65536 E=384 {jnp.dtype(dtype).name}: numba == jax (PASS)")
