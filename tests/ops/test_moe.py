"""The MoE block (``gpurouter.moe.moe``) against a dense per-token oracle,
early vs late weighting, alignment padding, remat / scan / jit, and expert
parallelism on CPU devices (the ragged_all_to_all stand-in) against one device."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpurouter import moe as gmoe
from gpurouter import reference as ref

T, H, E, K, M = 12, 8, 8, 2, 6


def _params(seed=0, dtype=jnp.float32, biases=True):
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)
    p = dict(
        x=jax.random.normal(ks[0], (T, H)),
        gate_kernel=jax.random.normal(ks[1], (H, E)),
        wi_0=jax.random.normal(ks[2], (E, H, M)) * 0.4,
        wi_1=jax.random.normal(ks[3], (E, H, M)) * 0.4,
        wo=jax.random.normal(ks[4], (E, M, H)) * 0.4,
        wi_0_bias=jax.random.normal(ks[5], (E, M)) * 0.3 if biases else None,
        wi_1_bias=jax.random.normal(ks[6], (E, M)) * 0.3 if biases else None,
        wo_bias=jax.random.normal(ks[7], (E, H)) * 0.3 if biases else None,
        expert_bias=None,
    )
    return {k: None if v is None else v.astype(dtype) for k, v in p.items()}


ACT = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu, "linear": lambda v: v}


def _dense(p, kw):
    """``sum_k p_k FFN_{e_k}(x_t)``, every expert on every token, masked: the oracle."""
    logits = p["x"] @ p["gate_kernel"]
    route = {k: v for k, v in kw.items() if k in ("score_function", "use_pre_softmax", "scaling_factor")}
    probs, _ = ref.fused_topk_with_score_function(logits, kw["num_experts_per_tok"], expert_bias=p["expert_bias"],
                                                  **route)
    act = ACT[kw.get("activation_type", "silu")]
    g = jnp.einsum("th,ehm->tem", p["x"], p["wi_0"])
    u = jnp.einsum("th,ehm->tem", p["x"], p["wi_1"])
    if p["wi_0_bias"] is not None:
        g, u = g + p["wi_0_bias"][None], u + p["wi_1_bias"][None]
    z = jnp.einsum("tem,emh->teh", act(g) * u, p["wo"])
    if p["wo_bias"] is not None:
        z = z + p["wo_bias"][None]
    return jnp.einsum("te,teh->th", probs.astype(z.dtype), z)


def _call(fn, p, kw, **extra):
    return fn(p["x"], p["gate_kernel"], p["wi_0"], p["wi_1"], p["wo"], p["wi_0_bias"], p["wi_1_bias"],
              p["wo_bias"], p["expert_bias"], **kw, **extra)


KW = dict(num_experts=E, num_experts_per_tok=K)
CASES = {
    "softmax-late": dict(KW),
    "softmax-early": dict(KW, apply_topk_weights_early=True),
    "sigmoid-scaled-gelu": dict(KW, score_function="sigmoid", scaling_factor=2.0, activation_type="gelu"),
    "pre-softmax-aligned": dict(KW, use_pre_softmax=True, align_size=4),
    "k-equals-e-relu": dict(num_experts=E, num_experts_per_tok=E, activation_type="relu"),
    "k1-linear-early": dict(num_experts=E, num_experts_per_tok=1, activation_type="linear",
                            apply_topk_weights_early=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_block_matches_the_dense_oracle(name):
    kw = CASES[name]
    with jax.enable_x64(True):
        p = _params(dtype=jnp.float64)
        out, loss = jax.jit(lambda p: _call(gmoe.moe, p, kw))(p)
        assert loss is None
        np.testing.assert_allclose(np.asarray(out), np.asarray(_dense(p, kw)), rtol=1e-10, atol=1e-12)
        diff = [k for k, v in p.items() if v is not None]
        # under jit: one compile each instead of op-by-op dispatch of every primitive at new
        # shapes (eager gradients: test_under_checkpoint_scan_and_bf16 and the tests after it)
        grads = jax.jit(jax.grad(lambda p: jnp.sum(_call(gmoe.moe, p, kw)[0] ** 2)))(p)
        want = jax.jit(jax.grad(lambda p: jnp.sum(_dense(p, kw) ** 2)))(p)
        for k in diff:  # every input and weight
            np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want[k]), rtol=1e-8, atol=1e-10,
                                       err_msg=k)


# softmax-late on batched_ragged_dot under slow (``make test-slow``): its late weighting runs
# in the fast suite with pre-softmax-aligned (padded groups), its unpadded groups with
# k1-linear-early
@pytest.mark.parametrize("name,gmm", [pytest.param("softmax-late", "batched", marks=pytest.mark.slow),
                                      ("pre-softmax-aligned", "batched"),
                                      ("k1-linear-early", "batched"), ("softmax-early", "tiled"),
                                      ("softmax-late", "slots"), ("sigmoid-scaled-gelu", "slots"),
                                      ("pre-softmax-aligned", "slots")])
def test_block_on_batched_ragged_dot_matches_the_dense_oracle(name, gmm):
    """``grouped_matmul=batched_ragged_dot`` (or ``tiled_ragged_dot``, with
    2-row tiles so that its slots and tiles both run, or ``"slots"``, the
    whole FFN in slots): the same block, values and every gradient."""
    fn = {"batched": gmoe.batched_ragged_dot, "slots": "slots",
          "tiled": functools.partial(gmoe.tiled_ragged_dot, tile=2, chunk=2)}[gmm]
    kw = dict(CASES[name], grouped_matmul=fn)
    with jax.enable_x64(True):
        p = _params(seed=5, dtype=jnp.float64)
        out, _ = jax.jit(lambda p: _call(gmoe.moe, p, kw))(p)
        np.testing.assert_allclose(np.asarray(out), np.asarray(_dense(p, kw)), rtol=1e-10, atol=1e-12)
        grads = jax.jit(jax.grad(lambda p: jnp.sum(_call(gmoe.moe, p, kw)[0] ** 2)))(p)  # (as above)
        want = jax.jit(jax.grad(lambda p: jnp.sum(_dense(p, kw) ** 2)))(p)
        for k in (k for k, v in p.items() if v is not None):
            np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want[k]), rtol=1e-8, atol=1e-10,
                                       err_msg=k)


def test_early_and_late_weighting_agree_with_biases():
    """TE #2864: early weighting scales the wo bias too, or a token gets K biases."""
    p = _params(seed=1)
    with jax.default_matmul_precision("float32"):  # not TF32 (a GPU's default): the paths round alike
        late, _ = _call(gmoe.moe, p, KW)
        early, _ = _call(gmoe.moe, p, dict(KW, apply_topk_weights_early=True))
    np.testing.assert_allclose(np.asarray(early), np.asarray(late), rtol=2e-5, atol=2e-6)


def test_aux_loss_is_the_routers():
    p = _params(seed=2)
    _, loss = _call(gmoe.moe, p, dict(KW, aux_loss_coeff=1e-2))
    logits = p["x"] @ p["gate_kernel"]
    scores, m = ref.fused_topk_with_score_function(logits, K, compute_aux_scores=True)
    want = ref.fused_moe_aux_loss(scores, ref.tokens_per_expert(m), K, 1e-2)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)


def test_under_checkpoint_scan_and_bf16():
    p = _params(seed=3, dtype=jnp.bfloat16)

    def f(x):
        return jnp.sum(_call(gmoe.moe, dict(p, x=x), KW)[0].astype(jnp.float32))

    g = jax.grad(f)(p["x"])
    np.testing.assert_array_equal(np.asarray(jax.grad(jax.checkpoint(f))(p["x"]), np.float32),
                                  np.asarray(g, np.float32))
    xs = jnp.stack([p["x"], p["x"] * 0.5])
    _, gs = jax.jit(lambda xs: jax.lax.scan(lambda c, x: (c, jax.grad(f)(x)), 0, xs))(xs)
    np.testing.assert_allclose(np.asarray(gs[0], np.float32), np.asarray(g, np.float32), rtol=2e-2, atol=2e-2)
    out, _ = _call(gmoe.moe, p, KW)
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out.astype(jnp.float32)).all())


def test_slots_under_checkpoint_and_scan():
    """``grouped_matmul="slots"`` (its own VJP, a switch in each half) under
    remat and inside a jitted scan: the plain gradient."""
    p = _params(seed=3)
    kw = dict(KW, grouped_matmul="slots", apply_topk_weights_early=True)

    def f(x):
        return jnp.sum(_call(gmoe.moe, dict(p, x=x), kw)[0] ** 2)

    g = jax.grad(f)(p["x"])
    np.testing.assert_allclose(np.asarray(jax.grad(jax.checkpoint(f))(p["x"])), np.asarray(g), rtol=1e-6, atol=1e-6)
    _, gs = jax.jit(lambda xs: jax.lax.scan(lambda c, x: (c, jax.grad(f)(x)), 0, xs))(jnp.stack([p["x"]] * 2))
    np.testing.assert_allclose(np.asarray(gs[1]), np.asarray(g), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gmm", ["ragged_dot", "slots"])
def test_experts_without_tokens_get_zero_weight_gradients(gmm):
    p = _params(seed=4)
    p["expert_bias"] = jnp.zeros((E,), jnp.float32).at[3].set(-1e3)  # expert 3 is never selected
    kw = dict(KW, score_function="sigmoid", **({"grouped_matmul": "slots"} if gmm == "slots" else {}))
    g = jax.grad(lambda w: jnp.sum(_call(gmoe.moe, dict(p, wi_0=w), kw)[0]))(p["wi_0"])
    np.testing.assert_array_equal(np.asarray(g[3]), np.zeros((H, M), np.float32))
    assert bool(jnp.isfinite(g).all())


NUMBA_CASES = {
    "softmax-late": dict(KW),
    "sigmoid-early-aligned": dict(KW, score_function="sigmoid", scaling_factor=2.0, apply_topk_weights_early=True,
                                  align_size=4),
    "grouped-aux": dict(KW, score_function="sigmoid", num_groups=4, group_topk=2, aux_loss_coeff=1e-2),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(NUMBA_CASES))
@jax.default_matmul_precision("float32")  # on GPUs: no TF32 in either block
def test_numba_block_matches_the_jax_block(name):
    """backend="numba": the router and the dispatch / combine on the kernels;
    the same values and gradients (every input and weight) as the jnp block."""
    kw = NUMBA_CASES[name]
    p = _params(seed=8)
    if kw.get("score_function") == "sigmoid":
        p["expert_bias"] = jax.random.normal(jax.random.PRNGKey(9), (E,)) * 0.1
    diff = ("x", "gate_kernel", "wi_0", "wi_1", "wo", "wi_0_bias", "wo_bias")

    def loss(backend):
        def f(*vals):
            out, aux = _call(gmoe.moe, dict(p, **dict(zip(diff, vals, strict=True))), kw, backend=backend)
            return jnp.sum(out ** 2) + (0.0 if aux is None else aux), (out, aux)
        return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(diff))), has_aux=True))

    args = [p[k] for k in diff]
    (_, (want, want_aux)), want_g = loss("jax")(*args)
    (_, (got, got_aux)), got_g = loss("numba")(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if want_aux is not None:
        np.testing.assert_allclose(float(got_aux), float(want_aux), rtol=1e-5)
    for k, g, w in zip(diff, got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4, err_msg=k)


@pytest.mark.cuda
def test_numba_block_in_bf16_is_the_jax_blocks():
    p = _params(seed=10, dtype=jnp.bfloat16)
    got, _ = jax.jit(lambda p: _call(gmoe.moe, p, KW, backend="numba"))(p)
    want, _ = jax.jit(lambda p: _call(gmoe.moe, p, KW, backend="jax"))(p)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


# (2, early) and (4, late) on ragged_dot under slow (``make test-slow``): the fast suite runs
# early weighting over 4 shards, late over 2, and late over 4 on batched_ragged_dot
@pytest.mark.parametrize("shards,early,gmm", [(2, False, "ragged_dot"),
                                              pytest.param(2, True, "ragged_dot", marks=pytest.mark.slow),
                                              pytest.param(4, False, "ragged_dot", marks=pytest.mark.slow),
                                              (4, True, "ragged_dot"),
                                              (4, False, "batched"),  # batched: a buffer 4x its rows
                                              (2, True, "slots"),  # slots: its capacities below the mean too
                                              pytest.param(4, False, "slots", marks=pytest.mark.slow)])
@jax.default_matmul_precision("float32")  # on GPUs: no TF32 in either block
def test_expert_parallel_equals_one_device(shards, early, gmm):
    if len(jax.devices()) < shards:
        pytest.skip(f"needs {shards} devices, have {len(jax.devices())}")
    P = jax.sharding.PartitionSpec
    p = _params(seed=5)
    kw = dict(KW, aux_loss_coeff=1e-2, apply_topk_weights_early=early,
              grouped_matmul={"batched": gmoe.batched_ragged_dot, "slots": "slots"}.get(gmm, jax.lax.ragged_dot))
    want, want_loss = _call(gmoe.moe, p, kw)
    mesh = jax.make_mesh((shards,), ("ep",), devices=jax.devices()[:shards])
    sharded = ("x", "wi_0", "wi_1", "wo", "wi_0_bias", "wi_1_bias", "wo_bias")

    def local(*vals):
        q = dict(p, **dict(zip(sharded, vals, strict=True)))
        out, loss = _call(gmoe.moe, q, kw, ep_axis="ep")
        return out, jax.lax.psum(loss, "ep")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * len(sharded), out_specs=(P("ep"), P()))
    args = [jax.device_put(p[k], jax.sharding.NamedSharding(mesh, P("ep"))) for k in sharded]
    with jax.set_mesh(mesh):
        out, loss = jax.jit(f)(*args)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0] ** 2), argnums=(0, 1, 6)))(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    want_g = jax.grad(lambda x, w0, bo: jnp.sum(_call(gmoe.moe, dict(p, x=x, wi_0=w0, wo_bias=bo), kw)[0] ** 2),
                      argnums=(0, 1, 2))(p["x"], p["wi_0"], p["wo_bias"])
    for got, w in zip(grads, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_expert_parallel_gpu_branch_types_and_lowers(monkeypatch):
    """The branch GPUs take (the real ``ragged_all_to_all``, which XLA:CPU
    cannot run) traced and lowered here under ``shard_map``'s type checks,
    forward and backward: a zero output buffer left replicated made the
    exchange's backward a ValueError on two H200s (its cotangent was not
    varying over the axis like its operand) while every CPU test passed."""
    from gpurouter import _ep
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices of the default backend (CPU runs get eight host devices; one GPU is one)")
    monkeypatch.setattr(_ep, "has_ragged_all_to_all", lambda: True)
    P = jax.sharding.PartitionSpec
    p = _params(seed=5)
    kw = dict(KW, aux_loss_coeff=1e-2)
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
    sharded = ("x", "wi_0", "wi_1", "wo", "wi_0_bias", "wi_1_bias", "wo_bias")

    def local(*vals):
        out, loss = _call(gmoe.moe, dict(p, **dict(zip(sharded, vals, strict=True))), kw, ep_axis="ep")
        return out, jax.lax.psum(loss, "ep")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * len(sharded), out_specs=(P("ep"), P()))
    step = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0] ** 2) + f(*a)[1], argnums=tuple(range(len(sharded)))))
    args = [jax.device_put(p[k], jax.sharding.NamedSharding(mesh, P("ep"))) for k in sharded]
    hlo = step.trace(*args).lower().as_text()
    # dispatch and combine forward, and each one's backward: four collectives
    calls = hlo.count("@ragged_all_to_all(")  # stablehlo.custom_call @ragged_all_to_all(...)
    assert calls == 4, calls


@pytest.mark.parametrize("change,exc,msg", [
    (dict(gate_kernel=jnp.zeros((H, E + 1))), ValueError,
     f"moe: gate_kernel shape ({H}, {E + 1}) must be (hidden, num_experts) = ({H}, {E})."),
    (dict(wi_1=jnp.zeros((E, H, M + 1))), ValueError, f"moe: wi_1 shape ({E}, {H}, {M + 1}) must be wi_0's"),
    (dict(wo=jnp.zeros((E, H, M))), ValueError, f"moe: wo shape ({E}, {H}, {M}) must be (num_experts, M, hidden)"),
    (dict(wo_bias=jnp.zeros((E, M))), ValueError, f"moe: wo_bias shape ({E}, {M}) must be ({E}, {H})."),
])
def test_block_errors(change, exc, msg):
    p = dict(_params(seed=6), **change)
    with pytest.raises(exc, match="^" + re.escape(msg)):
        _call(gmoe.moe, p, KW)


@pytest.mark.parametrize("kw,msg", [
    (dict(num_experts=E, num_experts_per_tok=E + 1),
     f"moe: num_experts_per_tok ({E + 1}) must be in [1, num_experts ({E})]."),
    (dict(KW, activation_type="tanh"),
     "moe: activation_type ('tanh') must be one of 'silu', 'gelu', 'relu', 'linear'."),
    (dict(KW, align_size=-1), "moe: align_size (-1) must be >= 0 (0: no padding)."),
    (dict(KW, backend="cuda"), "moe: backend ('cuda') must be one of 'auto', 'jax', 'numba'."),
])
def test_block_config_errors(kw, msg):
    with pytest.raises(ValueError, match="^" + re.escape(msg)):
        _call(gmoe.moe, _params(seed=7), kw)


def test_grouped_matmul_names_the_strings_it_takes():
    with pytest.raises(TypeError, match=re.escape("moe: grouped_matmul ('slot') must be a function with "
                                                  "jax.lax.ragged_dot's signature")) as e:
        _call(gmoe.moe, _params(seed=7), dict(KW, grouped_matmul="slot"))
    assert '"slots"' in str(e.value) and '"auto"' in str(e.value)


def test_activation_names_are_the_checks():
    from gpurouter._checks import MOE_ACTIVATIONS
    from gpurouter.reference.moe import ACTIVATIONS

    assert tuple(ACTIVATIONS) == MOE_ACTIVATIONS


def test_auto_block_permutes_on_the_kernels_where_the_rule_says(monkeypatch):
    """backend="auto": the dispatch/combine kernels for the block's T K x H rows
    where the combine's measured rule picks them (a device transport faked)."""
    from gpurouter import _auto, _backend, _transport

    monkeypatch.setattr(_backend, "zero_copy_available", lambda: True)
    monkeypatch.setattr(_transport, "resolve_transport", lambda op, t: "ffi")
    h, k = 256, 8
    t = _auto.AUTO_MOE_MIN_ELEMENTS // (h * k)
    x = jnp.zeros((t, h), jnp.bfloat16)
    assert _auto.moe_block_on_kernels(x, 64, k, "auto")
    assert not _auto.moe_block_on_kernels(x[:-1], 64, k, "auto")
    assert not _auto.moe_block_on_kernels(x, 64, k, "jax")
    assert not _auto.moe_block_on_kernels(x.astype(jnp.float32)[None], 2048, k, "auto")  # E past the kernels'
    monkeypatch.setattr(_backend, "zero_copy_available", lambda: False)  # JAX not on a GPU
    assert not _auto.moe_block_on_kernels(x, 64, k, "auto")
