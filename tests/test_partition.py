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
