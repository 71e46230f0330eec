"""Token-sharded routing on many devices (8 host CPU devices in CI, GPUs where present).

Sharded results must equal the unsharded reference: probs, routing map,
gradients, aux loss and its gradient, under ``jit`` with a token-sharded
``NamedSharding`` and inside ``shard_map``; the compiled program must not
all-gather the logits; a sharded expert axis is made whole, never routed in
slices.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gpurouter as gr
from gpurouter import _backend
from gpurouter import reference as ref

N = jax.device_count()
pytestmark = pytest.mark.skipif(N < 2, reason=f"needs >= 2 devices of the default backend, have {N}")
BACKENDS = [
    "jax",
    pytest.param("numba", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not _backend.numba_usable(), reason="backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")]),
]
E = 16
KW = dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5)
BIAS = jnp.linspace(0.2, -0.2, E, dtype=jnp.float32)


@pytest.fixture(scope="module")
def mesh_1d():
    return jax.make_mesh((N,), ("data",))


@pytest.fixture(scope="module")
def mesh_2d():
    if N % 2:
        pytest.skip(f"a data x expert mesh needs an even device count, have {N}")
    return jax.make_mesh((N // 2, 2), ("data", "expert"))


def _logits(shape, seed=0):
    """Tie-free rows (distinct values) in float32."""
    rng = np.random.default_rng(seed)
    rows = int(np.prod(shape[:-1]))
    return jnp.asarray(np.stack([rng.permutation(E) for _ in range(rows)]).reshape(shape) / 4.0 - 2.0,
                       jnp.float32)


def _route(x, backend):
    return gr.fused_topk_with_score_function(x, expert_bias=BIAS, backend=backend, **KW)


def _route_ref(x):
    return ref.fused_topk_with_score_function(x, expert_bias=BIAS, **KW)


def _loss(route, x, w):
    probs, _ = route(x)
    return jnp.sum(probs * w)


def _no_all_gather(fn, *args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    gathers = [line.strip()[:160] for line in hlo.splitlines() if re.search(r"\ball-gather(-start)?\(", line)]
    assert not gathers, gathers


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2 * N, E), (N, 2, E)], ids=["2d", "leading-dim"])
def test_jit_token_sharded(mesh_1d, backend, shape):
    x = _logits(shape)
    w = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
    spec = P("data", *([None] * len(shape[1:])))
    with jax.set_mesh(mesh_1d):
        xs = jax.device_put(x, NamedSharding(mesh_1d, spec))
        route = functools.partial(_route, backend=backend)
        probs, rmap = jax.jit(route)(xs)
        grad = jax.jit(jax.grad(functools.partial(_loss, route)))(xs, w)
        assert probs.sharding.spec == spec and rmap.sharding.spec == spec
        assert grad.sharding.spec == spec
        _no_all_gather(route, xs)
        _no_all_gather(jax.grad(functools.partial(_loss, route)), xs, w)
    want_p, want_m = _route_ref(x)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want_p), atol=1e-6, rtol=1e-5)
    want_g = jax.grad(functools.partial(_loss, _route_ref))(x, w)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_g), atol=1e-5 * 4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_axis_sharded_is_made_whole(mesh_2d, backend):
    x = _logits((N, E), seed=2)
    with jax.set_mesh(mesh_2d):
        xs = jax.device_put(x, NamedSharding(mesh_2d, P("data", "expert")))
        probs, rmap = jax.jit(functools.partial(_route, backend=backend))(xs)
        scores, smap = jax.jit(lambda x: gr.fused_topk_with_score_function(
            x, 3, compute_aux_scores=True, backend=backend))(xs)
    want_p, want_m = _route_ref(x)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want_p), atol=1e-6, rtol=1e-5)
    want_s, want_sm = ref.fused_topk_with_score_function(x, 3, compute_aux_scores=True)
    np.testing.assert_array_equal(np.asarray(smap), np.asarray(want_sm))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(want_s), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_map_runs_per_shard(mesh_1d, backend):
    x = _logits((2 * N, E), seed=3)
    w = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)
    route = functools.partial(_route, backend=backend)
    sm = jax.shard_map(route, mesh=mesh_1d, in_specs=P("data", None), out_specs=P("data", None))
    xs = jax.device_put(x, NamedSharding(mesh_1d, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh_1d, P("data", None)))
    with jax.set_mesh(mesh_1d):
        probs, rmap = jax.jit(sm)(xs)
        grad = jax.jit(jax.grad(lambda x: jnp.sum(sm(x)[0] * ws)))(xs)
    want_p, want_m = _route_ref(x)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want_p), atol=1e-6, rtol=1e-5)
    want_g = jax.grad(functools.partial(_loss, _route_ref))(x, w)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_g), atol=1e-5 * 4, rtol=1e-4)


def _aux_inputs(seed=4):
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(seed), (2 * N, E)), axis=-1)
    tpe = jnp.asarray(np.random.default_rng(seed).integers(0, 50, E), jnp.int32)
    return probs, tpe


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_loss_jit_token_sharded(mesh_1d, backend):
    probs, tpe = _aux_inputs()
    f = lambda p: gr.fused_moe_aux_loss(p, tpe, 4, 0.01, backend=backend)  # noqa: E731
    with jax.set_mesh(mesh_1d):
        ps = jax.device_put(probs, NamedSharding(mesh_1d, P("data", None)))
        loss = jax.jit(f)(ps)
        grad = jax.jit(jax.grad(f))(ps)
        _no_all_gather(f, ps)
        assert grad.sharding.spec == P("data", None)
    want = ref.fused_moe_aux_loss(probs, tpe, 4, 0.01)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    want_g = jax.grad(lambda p: ref.fused_moe_aux_loss(p, tpe, 4, 0.01))(probs)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_g), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_loss_axis_name_in_shard_map(mesh_1d, backend):
    """Megatron's pattern: local probs, counts all-reduced, global T; psum of shard losses.

    (On 2 H200s this case once hung with the zero-copy transport, when its
    callback allocated, copied and freed device memory next to XLA's
    all-reduce; callbacks now only launch kernels.)
    """
    probs, _ = _aux_inputs(seed=5)
    local_counts = jnp.asarray(np.random.default_rng(5).integers(0, 9, (N, E)), jnp.int32)

    def shard_loss(p, counts):
        return gr.fused_moe_aux_loss(p, counts[0], 4, 0.01, axis_name="data", backend=backend)

    total = jax.shard_map(lambda p, c: jax.lax.psum(shard_loss(p, c), "data"), mesh=mesh_1d,
                          in_specs=(P("data", None), P("data", None)), out_specs=P())
    shard = NamedSharding(mesh_1d, P("data", None))
    with jax.set_mesh(mesh_1d):
        ps, cs = jax.device_put(probs, shard), jax.device_put(local_counts, shard)
        loss = jax.jit(total)(ps, cs)
        grad = jax.jit(jax.grad(total))(ps, cs)
    global_counts = local_counts.sum(0)
    want = ref.fused_moe_aux_loss(probs, global_counts, 4, 0.01)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    want_g = jax.grad(lambda p: ref.fused_moe_aux_loss(p, global_counts, 4, 0.01))(probs)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_g), rtol=1e-5, atol=1e-9)


def test_axis_name_outside_a_mapped_context():
    probs, tpe = _aux_inputs()
    with pytest.raises(ValueError, match=re.escape(
            "fused_moe_aux_loss: axis_name ('data') must be a mesh axis bound here (inside "
            "jax.shard_map, vmap or pmap over it), or None.")):
        gr.fused_moe_aux_loss(probs, tpe, 4, 0.01, axis_name="data")


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_axes_mesh_runs_per_shard(backend):
    """A mesh with Auto axes (``Mesh(devices, names)``, what most training code
    builds): the ffi transport routes each shard's tokens where they are (no
    all-gather, outputs and gradients token-sharded); on the jax backend and
    the callbacks XLA decides (it gathers; values only)."""
    from jax.sharding import Mesh

    from gpurouter._transport import resolve_transport

    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = _logits((4 * N, E))
    w = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)
    sharding = NamedSharding(mesh, P("data", None))
    xs, ws = jax.device_put(x, sharding), jax.device_put(w, sharding)
    route = functools.partial(_route, backend=backend)
    fwd = jax.jit(route, in_shardings=sharding)
    bwd = jax.jit(jax.grad(functools.partial(_loss, route)), in_shardings=(sharding, sharding))
    probs, rmap = fwd(xs)
    grad = bwd(xs, ws)
    per_shard = backend == "numba" and resolve_transport("test", "auto") == "ffi"
    if per_shard:
        assert probs.sharding.spec[0] == "data" and grad.sharding.spec[0] == "data"
        for f, args in ((fwd, (xs,)), (bwd, (xs, ws))):
            hlo = f.lower(*args).compile().as_text()
            gathers = [ln.strip()[:160] for ln in hlo.splitlines() if re.search(r"\ball-gather(-start)?\(", ln)]
            assert not gathers, gathers
    want_p, want_m = _route_ref(x)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want_p), atol=1e-6, rtol=1e-5)
    want_g = jax.grad(functools.partial(_loss, _route_ref))(x, w)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_g), atol=1e-5 * 4, rtol=1e-4)
