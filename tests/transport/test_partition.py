"""The ffi transport's per-shard wrapper on an Auto-axes mesh of 8 CPU devices,
with a jnp body standing in for the kernel call (the wrapper is transport-free;
on a GPU the body is the FFI call): the body runs on each shard's tokens, no
operand is gathered, the values are one device's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gpurouter._transport.partition import _rule, token_parallel

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py sets 8 CPU devices)")


def _body(seen):
    def fn(x, idx, bias):
        seen.append(x.shape)
        return x * 2 + bias[None, :], x > bias[None, :], idx + 1
    return fn


def test_the_rule_names_the_token_factor_and_one_factor_per_other_dim():
    assert _rule(2, [2, 2, 1, 0], [2, 1]) == "t d0, t d1, d2, () -> t d3, t"


@pytest.mark.parametrize("spec", [P("d", None), P(("a", "b"), None)])
def test_token_sharded_operands_stay_on_their_devices(spec):
    names = ("d",) if spec[0] == "d" else ("a", "b")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape((8,) if len(names) == 1 else (2, 4)), names)
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 16), jnp.float32)
    idx = jnp.arange(64 * 3, dtype=jnp.int32).reshape(64, 3)
    bias = jnp.linspace(-1, 1, 16, dtype=jnp.float32)
    seen = []
    body = _body(seen)
    out_shapes = [jax.ShapeDtypeStruct((64, 16), jnp.float32), jax.ShapeDtypeStruct((64, 16), jnp.bool_),
                  jax.ShapeDtypeStruct((64, 3), jnp.int32)]

    @jax.jit
    def f(x, idx, bias):
        return token_parallel(body, 2, (x, idx, bias), out_shapes)

    xs = jax.device_put(x, NamedSharding(mesh, spec))
    idxs = jax.device_put(idx, NamedSharding(mesh, spec))
    hlo = f.lower(xs, idxs, bias).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    got = f(xs, idxs, bias)
    assert (8, 16) in seen  # traced on one shard's tokens
    for g, w in zip(got, body(x, idx, bias), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert got[0].sharding.spec[0] == spec[0]


def test_unsharded_operands_run_whole():
    seen = []
    x = jnp.ones((8, 4), jnp.float32)
    out = jax.jit(lambda x: token_parallel(_body(seen), 2, (x, jnp.zeros((8, 1), jnp.int32), jnp.zeros(4)),
                                           [jax.ShapeDtypeStruct((8, 4), jnp.float32),
                                            jax.ShapeDtypeStruct((8, 4), jnp.bool_),
                                            jax.ShapeDtypeStruct((8, 1), jnp.int32)]))(x)
    assert out[0].shape == (8, 4) and (8, 4) in seen


def test_the_ffi_call_under_vmap_and_on_a_mesh_asks_for_plans_of_the_right_size(monkeypatch):
    """The ffi transport's batching and partitioning, its launch faked by jnp:
    a folded vmap batch asks for results of the folded token count, a batched
    per-call array for one element's, a token-sharded mesh for one shard's."""
    from gpurouter._transport import ffi

    asked = []

    def fake_launch(planner, out_specs, args):
        asked.append((args[0].shape[0], tuple(s.shape for s in out_specs)))
        x, b = args
        assert all(s.shape[0] == x.shape[0] for s in out_specs)
        return (x * 2 + b[None, :], x > 0)

    monkeypatch.setattr(ffi, "_launch", fake_launch)
    specs = (jax.ShapeDtypeStruct((32, 8), jnp.float32), jax.ShapeDtypeStruct((32, 8), jnp.bool_))

    def op(x, b):
        return ffi.ffi_call(None, specs, [x], [b])

    x = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 8), jnp.float32)
    b = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 8)
    folded = jax.jit(jax.vmap(lambda x: op(x, b[0])))(x)
    assert asked[-1][0] == 128 and folded[0].shape == (4, 32, 8)
    np.testing.assert_array_equal(np.asarray(folded[0]), np.asarray(x * 2 + b[0][None, None, :]))
    mapped = jax.jit(jax.vmap(op))(x, b)
    assert asked[-1][0] == 32
    np.testing.assert_array_equal(np.asarray(mapped[0]), np.asarray(x * 2 + b[:, None, :]))
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    xs = jax.device_put(x[0], NamedSharding(mesh, P("d", None)))
    f = jax.jit(op)
    assert "all-gather" not in f.lower(xs, b[0]).compile().as_text()
    sharded = f(xs, b[0])
    assert asked[-1][0] == 4 and sharded[0].sharding.spec[0] == "d"
    np.testing.assert_array_equal(np.asarray(sharded[0]), np.asarray(x[0] * 2 + b[0][None, :]))
