"""The router z-loss, the expert-bias update and the normalisation contract of
docs/losses.md: NumPy float64 oracles (checked against finite differences),
micro-batch accumulation, data-parallel shard_map, DeepSeek-V3's
sequence-wise balance loss, and every op under jax.checkpoint, lax.scan and
vmap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from public_helpers import BACKENDS
from public_helpers import backend_kw as _backend_kw
from public_helpers import tie_free_logits as _tie_free_logits

import gpurouter as gr
from gpurouter import reference as ref
from gpurouter.testing import oracle as oracles
from gpurouter.testing.tolerances import assert_close


def _logits(seed, shape, dtype="float32", masked=True):
    """Random logits with some -inf entries and, when ``masked``, an all -inf row."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, shape).astype(np.float32)
    if masked and x.size:
        flat = x.reshape(-1, shape[-1])
        flat[rng.random(flat.shape) < 0.2] = -np.inf
        flat[0] = -np.inf
    return jnp.asarray(x, dtype)


# ----------------------------------------------------------------------------
# The oracles themselves
# ----------------------------------------------------------------------------


def test_z_loss_oracle_gradient_matches_finite_differences():
    x = np.random.default_rng(0).normal(0, 2, (3, 5))
    x[1, 2] = -np.inf
    g = oracles.z_loss_grad(x, 0.3)
    h = 1e-6
    for t in range(3):
        for e in range(5):
            if not np.isfinite(x[t, e]):
                continue
            xp, xm = x.copy(), x.copy()
            xp[t, e] += h
            xm[t, e] -= h
            fd = (oracles.z_loss(xp, 0.3) - oracles.z_loss(xm, 0.3)) / (2 * h)
            assert abs(fd - g[t, e]) < 1e-6, (t, e, fd, g[t, e])


# ----------------------------------------------------------------------------
# z-loss: reference vs oracle, public op on every backend
# ----------------------------------------------------------------------------


# 5 examples (the suite profile: 10): each draws new shapes, so each compiles the reference's
# value and gradient again; the five still draw every dtype (fp32, bf16, fp16)
@settings(max_examples=5)
@given(st.data())
def test_z_loss_reference_matches_oracle(data):
    e = data.draw(st.integers(1, 12), label="E")
    lead = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=2), label="leading"))
    dtype = data.draw(st.sampled_from(["float32", "bfloat16", "float16"]), label="dtype")
    coeff = data.draw(st.sampled_from([1e-3, 0.5, 2.0]), label="coeff")
    x = _logits(data.draw(st.integers(0, 2**16), label="seed"), lead + (e,), dtype,
                masked=data.draw(st.booleans(), label="masked"))
    got = ref.router_z_loss(x, coeff)
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_allclose(float(got), oracles.z_loss(np.asarray(x, np.float32), coeff), rtol=1e-5, atol=1e-7)
    grad = jax.grad(lambda x: ref.router_z_loss(x, coeff))(x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(grad), oracles.z_loss_grad(np.asarray(x, np.float32), coeff),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_z_loss_public_matches_oracle(backend, dtype):
    x = _logits(1, (3, 4, 12), dtype)
    f = jax.jit(lambda x: gr.router_z_loss(x, 1e-2, **_backend_kw(backend)))
    np.testing.assert_allclose(float(f(x)), oracles.z_loss(np.asarray(x, np.float32), 1e-2), rtol=1e-5)
    g = jax.jit(jax.grad(lambda x: gr.router_z_loss(x, 1e-2, **_backend_kw(backend))))(x)
    assert g.dtype == x.dtype
    assert_close(g, oracles.z_loss_grad(np.asarray(x, np.float32), 1e-2), "grads", dtype, E=12,
                 check_dtype=False)


def test_z_loss_all_masked_and_empty():
    assert float(gr.router_z_loss(jnp.full((2, 4), -jnp.inf), 1.0)) == 0.0
    g = jax.grad(lambda x: gr.router_z_loss(x, 1.0))(jnp.full((2, 4), -jnp.inf))
    np.testing.assert_array_equal(np.asarray(g), np.zeros((2, 4), np.float32))
    assert float(gr.router_z_loss(jnp.zeros((0, 4)), 1.0)) == 0.0
    nan_row = jnp.array([[0.0, jnp.nan, 1.0]])
    assert np.isnan(float(gr.router_z_loss(nan_row, 1.0)))


# ----------------------------------------------------------------------------
# The expert-bias update
# ----------------------------------------------------------------------------


@given(st.data())
def test_update_expert_bias_matches_oracle(data):
    e = data.draw(st.integers(1, 16), label="E")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    bias = rng.normal(0, 0.1, e).astype(np.float32)
    counts = rng.integers(0, 9, e).astype(data.draw(st.sampled_from([np.int32, np.float32]), label="tpe"))
    rate = data.draw(st.sampled_from([1e-3, 0.01]), label="rate")
    got = gr.update_expert_bias(jnp.asarray(bias), jnp.asarray(counts), rate)
    assert got.dtype == jnp.float32 and got.shape == (e,)
    np.testing.assert_allclose(np.asarray(got), oracles.update_expert_bias(bias, counts, rate), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.int16, jnp.float32])
@pytest.mark.parametrize("jit", [False, True])
def test_update_expert_bias_keeps_an_expert_exactly_at_the_mean(dtype, jit):
    """A mean whose ``1/E`` is not exact in float32 (E = 15, 3, 7): an expert
    at the mean keeps its bias. A float32 ``mean`` (XLA: the sum times
    ``1/E``) read 60/15 as just above 4 and moved every expert with 4 tokens
    (found by the hypothesis test at 400 examples)."""
    f = jax.jit(gr.update_expert_bias, static_argnums=2) if jit else gr.update_expert_bias
    for counts in ([5, 4, 6, 3, 6, 3, 8, 3, 2, 3, 7, 5, 7, 6, 7], [4] * 15, [1, 2, 3], [9, 0, 3, 3, 3, 3, 0]):
        c = np.array(counts)
        want = oracles.update_expert_bias(np.zeros(len(c), np.float32), c, 0.25)
        assert 0.0 in want.tolist()  # each case has an expert at the mean
        got = f(jnp.zeros(len(c), jnp.float32), jnp.asarray(c, dtype), 0.25)
        assert np.asarray(got).tolist() == want.tolist(), counts


def test_update_expert_bias_exact_for_large_integer_counts():
    """Counts of a large global batch (sums past float32's 2**24 integers):
    one token above or below the mean still moves the bias the right way."""
    mean = 3_000_000
    counts = jnp.array([mean] * 5 + [mean + 1, mean - 1], jnp.int32)
    got = gr.update_expert_bias(jnp.zeros(7), counts, 1.0)
    assert got.tolist() == [0.0] * 5 + [-1.0, 1.0]


def test_update_expert_bias_under_vmap_and_scan():
    counts = jnp.array([[4, 0, 2, 2], [0, 4, 2, 2]], jnp.int32)
    out = jax.vmap(lambda c: gr.update_expert_bias(jnp.zeros(4), c, 0.5))(counts)
    assert out.tolist() == [[-0.5, 0.5, 0.0, 0.0], [0.5, -0.5, 0.0, 0.0]]
    bias, _ = jax.lax.scan(lambda b, c: (gr.update_expert_bias(b, c, 0.5), None), jnp.zeros(4), counts)
    assert bias.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_update_expert_bias_under_jit_with_a_traced_rate_keeps_the_dtype():
    bias = jnp.zeros((4,), jnp.bfloat16)
    f = jax.jit(lambda b, c, r: gr.update_expert_bias(b, c, r))
    out = f(bias, jnp.array([4, 0, 2, 2], jnp.int32), jnp.float32(0.5))
    assert out.dtype == jnp.bfloat16 and out.tolist() == [-0.5, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("args,exc,msg", [
    ((jnp.zeros((4,)), jnp.zeros((3,), jnp.int32), 0.1), ValueError,
     "update_expert_bias: tokens_per_expert shape (3,) must be (num_experts,) = (4,)."),
    ((jnp.zeros((2, 4)), jnp.zeros((4,), jnp.int32), 0.1), ValueError,
     "update_expert_bias: expert_bias shape (2, 4) must be (num_experts,), num_experts >= 1."),
    ((jnp.zeros((4,)), jnp.zeros((4,), jnp.int32), float("nan")), ValueError,
     "update_expert_bias: rate (nan) must be finite."),
    ((jnp.zeros((4,)), jnp.zeros((4,), jnp.int32), jnp.zeros((2,))), ValueError,
     "update_expert_bias: rate shape (2,) must be () (a scalar)."),
    ((jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32), 0.1), TypeError,
     "update_expert_bias: expert_bias must be float32, bfloat16 or float16"),
])
def test_update_expert_bias_errors(args, exc, msg):
    import re

    with pytest.raises(exc, match="^" + re.escape(msg)):
        gr.update_expert_bias(*args)


@pytest.mark.parametrize("args,kwargs,exc,msg", [
    ((jnp.zeros((4, 0)), 0.1), {}, ValueError, "router_z_loss: num_experts (logits.shape[-1] = 0) must be >= 1."),
    ((jnp.float32(1.0), 0.1), {}, ValueError, "router_z_loss: logits rank (0) must be >= 1"),
    ((jnp.zeros((4, 2), jnp.int32), 0.1), {}, TypeError, "router_z_loss: logits must be float32, bfloat16"),
    ((jnp.zeros((4, 2)), float("inf")), {}, ValueError, "router_z_loss: coeff (inf) must be finite."),
    ((jnp.zeros((4, 2)), 0.1), dict(total_num_tokens=0), ValueError,
     "router_z_loss: total_num_tokens (0) must be > 0 (or 0 with no tokens; there are 4)."),
    (([[0.0, 1.0]], 0.1), {}, TypeError, "router_z_loss: logits must be an array"),
])
def test_z_loss_errors(args, kwargs, exc, msg):
    import re

    for fn in (gr.router_z_loss, ref.router_z_loss):
        with pytest.raises(exc, match="^" + re.escape(msg)):
            fn(*args, **kwargs)


# ----------------------------------------------------------------------------
# The normalisation contract: micro-batches, data parallelism, sequences
# ----------------------------------------------------------------------------


def _aux_step(backend, k=2, e=8):
    def scores_and_counts(x):
        scores, m = gr.fused_topk_with_score_function(x, k, score_function="sigmoid", compute_aux_scores=True,
                                                      **_backend_kw(backend))
        return scores, gr.tokens_per_expert(m)
    return scores_and_counts


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batches_accumulate_to_the_full_batch(backend):
    """2 micro-batches (4 until 2026-11-28: each one more chain of kernel launches on the
    simulator), counts accumulated over all of them and the global T: the summed losses
    and gradients equal the full batch's (docs/losses.md)."""
    k, e, t = 2, 8, 16
    x = _tie_free_logits((t, e), jnp.float32, seed=11)
    scores_counts = _aux_step(backend, k, e)
    kw = _backend_kw(backend)

    def full(x):
        scores, counts = scores_counts(x)
        return (gr.fused_moe_aux_loss(scores, counts, k, 1e-2, **kw)
                + gr.router_z_loss(x, 1e-3, **kw))

    counts = sum(scores_counts(mb)[1] for mb in jnp.split(x, 2))  # the step's counts

    def micro(mb):
        scores, _ = scores_counts(mb)
        return (gr.fused_moe_aux_loss(scores, counts, k, 1e-2, total_num_tokens=t, **kw)
                + gr.router_z_loss(mb, 1e-3, total_num_tokens=t, **kw))

    want, want_g = jax.value_and_grad(full)(x)
    parts = [jax.value_and_grad(micro)(mb) for mb in jnp.split(x, 2)]
    np.testing.assert_allclose(float(sum(p[0] for p in parts)), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jnp.concatenate([p[1] for p in parts])), np.asarray(want_g),
                               rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_data_parallel_shard_map_equals_one_device(backend):
    n = min(len(jax.devices()), 4)
    if n < 2:
        pytest.skip(f"needs >= 2 devices of the default backend, have {n}")
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    k, e, t = 2, 8, 4 * n
    x = _tie_free_logits((t, e), jnp.float32, seed=12)
    bias = jnp.linspace(-0.1, 0.1, e, dtype=jnp.float32)
    kw = _backend_kw(backend)
    scores_counts = _aux_step(backend, k, e)

    def local(x, bias):
        scores, counts = scores_counts(x)
        aux = gr.fused_moe_aux_loss(scores, counts, k, 1e-2, axis_name="data", **kw)
        z = gr.router_z_loss(x, 1e-3, axis_name="data", **kw)
        new_bias = gr.update_expert_bias(bias, counts, 1e-3, axis_name="data")
        return jax.lax.psum(aux + z, "data"), new_bias

    P = jax.sharding.PartitionSpec
    step = jax.shard_map(local, mesh=mesh, in_specs=(P("data", None), P()), out_specs=(P(), P()))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data", None)))
        loss, new_bias = jax.jit(step)(xs, bias)
    scores, counts = scores_counts(x)
    want = gr.fused_moe_aux_loss(scores, counts, k, 1e-2) + gr.router_z_loss(x, 1e-3)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_bias), np.asarray(gr.update_expert_bias(bias, counts, 1e-3)))


def test_sequence_level_loss_is_deepseek_v3s_sequence_wise_balance_loss():
    """[B, S, E] -> [S, B*E] columns, T = S, divided by B: DeepSeek-V3's
    sequence-wise balance loss averaged over sequences (float64 oracle)."""
    b, s, e, k, alpha = 3, 5, 8, 2, 1e-4
    x = jax.random.normal(jax.random.PRNGKey(4), (b, s, e), jnp.float32)
    scores, m = gr.fused_topk_with_score_function(x, k, score_function="sigmoid", compute_aux_scores=True)
    cols = jnp.transpose(scores, (1, 0, 2)).reshape(s, b * e)
    counts = jnp.sum(m, axis=1, dtype=jnp.int32).reshape(b * e)
    loss = gr.fused_moe_aux_loss(cols, counts, k, alpha, total_num_tokens=s, num_experts=e) / b
    want = oracles.deepseek_sequence_balance_loss(np.asarray(scores), np.asarray(m), alpha)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


# ----------------------------------------------------------------------------
# Every op under jax.checkpoint, lax.scan and vmap
# ----------------------------------------------------------------------------


def _ops(backend):
    kw = _backend_kw(backend)
    bias = jnp.linspace(-0.2, 0.2, 8, dtype=jnp.float32)
    return {
        "topk-sigmoid-bias": lambda x: gr.fused_topk_with_score_function(
            x, 2, score_function="sigmoid", expert_bias=bias, **kw)[0].astype(jnp.float32).sum(),
        "topk-softmax-bitmap": lambda x: gr.fused_topk_with_score_function(
            x, 2, routing_map_format="bitmap_u8", **kw)[0].astype(jnp.float32).sum(),
        "aux-scores+aux-loss": lambda x: gr.fused_moe_aux_loss(
            *_aux_step(backend)(x), 2, 1e-2, **kw),
        "z-loss": lambda x: gr.router_z_loss(x, 1e-2, **kw),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["topk-sigmoid-bias", "topk-softmax-bitmap", "aux-scores+aux-loss", "z-loss"])
def test_every_op_under_checkpoint_scan_and_vmap(backend, name):
    f = _ops(backend)[name]
    xs = _tie_free_logits((2, 4, 8), jnp.float32, seed=13)  # 2 steps (3 until 2026-11-28)
    want_v = jnp.stack([f(x) for x in xs])
    want_g = jnp.stack([jax.grad(f)(x) for x in xs])
    # remat must not break the custom VJPs
    g_ckpt = jnp.stack([jax.grad(jax.checkpoint(f))(x) for x in xs])
    np.testing.assert_allclose(np.asarray(g_ckpt), np.asarray(want_g), rtol=1e-5, atol=1e-7)
    # a scan over steps (values and gradients carried)
    def body(acc, x):
        v, g = jax.value_and_grad(f)(x)
        return acc + v, g
    total, gs = jax.jit(lambda xs: jax.lax.scan(body, jnp.float32(0), xs))(xs)
    np.testing.assert_allclose(float(total), float(want_v.sum()), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gs), np.asarray(want_g), rtol=1e-5, atol=1e-7)
    # vmap of the value and of the gradient
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(xs)), np.asarray(want_v), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.vmap(jax.grad(f))(xs)), np.asarray(want_g), rtol=1e-5, atol=1e-7)


def test_routing_helpers_under_scan_and_vmap():
    m = jax.random.uniform(jax.random.PRNGKey(5), (3, 4, 13)) < 0.3
    bits = jax.vmap(gr.pack_routing_map)(m)
    np.testing.assert_array_equal(np.asarray(bits), np.packbits(np.asarray(m), axis=-1, bitorder="little"))
    _, counts = jax.lax.scan(lambda c, b: (c, gr.tokens_per_expert(b, 13)), 0, bits)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(m).sum(1))
    back = jax.vmap(functools.partial(gr.unpack_routing_map, num_experts=13))(bits)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(m))
