"""The public ops on every backend under jit, grad and vmap, against the reference.

``backend="numba"`` runs the kernels through the pure_callback custom_vjp: on
a GPU, or on the CUDA simulator in CI (tiny shapes: the simulator runs one OS
thread per CUDA thread).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from public_helpers import BACKENDS, CONFIGS
from public_helpers import backend_kw as _backend_kw
from public_helpers import call as _call
from public_helpers import tie_free_logits as _tie_free_logits

import gpurouter as gr
from gpurouter import _backend
from gpurouter import reference as ref
from gpurouter.testing.tolerances import assert_close


def _close(actual, expected, dtype, kind):
    """docs/contract.md section 7 (tests/tolerances.py); kind "probs" or "grad"."""
    kind = "grads" if kind == "grad" else kind
    assert_close(actual, expected, kind, dtype, E=np.shape(actual)[-1] if kind == "grads" else None,
                 check_dtype=False)


# Each config in one dtype in the fast suite, by turns (every backend runs both dtypes), the other
# under slow (``make test-slow``): the turns opposite to test_topk_indices.py's replay test, so
# that every (config, dtype) pair runs through the public op in the fast suite in one of the two;
# bf16 routes and gradients of every score function: test_aux_scores_forward_and_grad, and the
# kernels' bf16 paths tests/kernels/.
DTYPE_CASES = [
    pytest.param(dtype, name, id=f"{dtype}-{name}",
                 marks=() if dtype == ("bfloat16", "float32")[i % 2] else pytest.mark.slow)
    for dtype in ("float32", "bfloat16") for i, name in enumerate(CONFIGS)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,name", DTYPE_CASES)
def test_topk_forward_and_grad(backend, name, dtype):
    cfg = CONFIGS[name]
    x = _tie_free_logits((2, 3, 16), dtype)
    w = jax.random.normal(jax.random.PRNGKey(1), x.shape, jnp.float32)

    def loss(fn, x, **kw):
        probs, _ = _call(fn, x, cfg, **kw)
        return jnp.sum(probs.astype(jnp.float32) * w)

    probs, rmap = jax.jit(lambda x: _call(gr.fused_topk_with_score_function, x, cfg, **_backend_kw(backend)))(x)
    want_p, want_m = _call(ref.fused_topk_with_score_function, x, cfg)
    assert probs.dtype == x.dtype and rmap.dtype == jnp.bool_ and probs.shape == x.shape
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    _close(probs, want_p, dtype, "probs")
    grad = jax.jit(jax.grad(functools.partial(loss, gr.fused_topk_with_score_function, **_backend_kw(backend))))(x)
    want_g = jax.grad(functools.partial(loss, ref.fused_topk_with_score_function))(x)
    assert grad.dtype == x.dtype
    _close(grad, want_g, dtype, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_forward_and_grad(backend, sf):
    x = _tie_free_logits((5, 16), jnp.bfloat16, seed=3)
    w = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)

    def loss(fn, x, **kw):
        scores, _ = fn(x, 3, score_function=sf, compute_aux_scores=True, **kw)
        return jnp.sum(scores * w)

    scores, rmap = gr.fused_topk_with_score_function(x, 3, score_function=sf, compute_aux_scores=True,
                                                     **_backend_kw(backend))
    want_s, want_m = ref.fused_topk_with_score_function(x, 3, score_function=sf, compute_aux_scores=True)
    assert scores.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    _close(scores, want_s, "float32", "probs")
    grad = jax.grad(functools.partial(loss, gr.fused_topk_with_score_function, **_backend_kw(backend)))(x)
    want_g = jax.grad(functools.partial(loss, ref.fused_topk_with_score_function))(x)
    assert grad.dtype == jnp.bfloat16
    _close(grad, want_g, "bfloat16", "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_folds_batch_into_tokens(backend):
    x = _tie_free_logits((3, 4, 8), jnp.float32, seed=5)
    bias = jnp.linspace(-0.2, 0.2, 8, dtype=jnp.float32)
    f = functools.partial(gr.fused_topk_with_score_function, topk=2, score_function="sigmoid",
                          expert_bias=bias, **_backend_kw(backend))
    probs, rmap = jax.jit(jax.vmap(f))(x)
    want_p, want_m = ref.fused_topk_with_score_function(x, 2, score_function="sigmoid", expert_bias=bias)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    _close(probs, want_p, "float32", "probs")
    # grad of a vmapped op
    g = jax.grad(lambda x: jnp.sum(jax.vmap(f)(x)[0] ** 2))(x)
    want_g = jax.grad(lambda x: jnp.sum(ref.fused_topk_with_score_function(
        x, 2, score_function="sigmoid", expert_bias=bias)[0] ** 2))(x)
    _close(g, want_g, "float32", "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_with_a_batched_bias(backend):
    # A bias that differs per batch element cannot fold into tokens.
    x = _tie_free_logits((2, 3, 8), jnp.float32, seed=6)
    biases = jnp.stack([jnp.linspace(-1, 1, 8), jnp.linspace(1, -1, 8)]).astype(jnp.float32)
    f = functools.partial(gr.fused_topk_with_score_function, topk=2, score_function="sigmoid",
                          **_backend_kw(backend))
    probs, rmap = jax.vmap(lambda x, b: f(x, expert_bias=b))(x, biases)
    for i in range(2):
        want_p, want_m = ref.fused_topk_with_score_function(x[i], 2, score_function="sigmoid",
                                                            expert_bias=biases[i])
        np.testing.assert_array_equal(np.asarray(rmap[i]), np.asarray(want_m))
        _close(probs[i], want_p, "float32", "probs")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compute_aux_scores", [False, True])
def test_zero_tokens(backend, compute_aux_scores):
    x = jnp.zeros((0, 3, 8), jnp.bfloat16)
    probs, rmap = jax.jit(lambda x: gr.fused_topk_with_score_function(
        x, 2, compute_aux_scores=compute_aux_scores, **_backend_kw(backend)))(x)
    assert probs.shape == rmap.shape == (0, 3, 8)
    assert probs.dtype == (jnp.float32 if compute_aux_scores else jnp.bfloat16)
    g = jax.grad(lambda x: jnp.sum(gr.fused_topk_with_score_function(
        x, 2, **_backend_kw(backend))[0].astype(jnp.float32)))(x)
    assert g.shape == x.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tpe_dtype", ["int32", "float32"])
def test_aux_loss(backend, dtype, tpe_dtype):
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (6, 16)), axis=-1).astype(dtype)
    tpe = jnp.arange(16).astype(tpe_dtype)
    kw = dict(total_num_tokens=24, num_experts=8)  # sequence aux loss: C = 2 * E
    f = jax.jit(lambda p: gr.fused_moe_aux_loss(p, tpe, 4, 0.01, **_backend_kw(backend), **kw))
    loss = f(probs)
    want = ref.fused_moe_aux_loss(probs, tpe, 4, 0.01, **kw)
    assert loss.shape == () and loss.dtype == probs.dtype
    assert_close(loss, want, "aux_loss", dtype)
    g = jax.grad(lambda p: gr.fused_moe_aux_loss(p, tpe, 4, 0.01, **_backend_kw(backend), **kw).astype(
        jnp.float32) * 3.0)(probs)
    want_g = jax.grad(lambda p: ref.fused_moe_aux_loss(p, tpe, 4, 0.01, **kw).astype(jnp.float32) * 3.0)(probs)
    assert g.dtype == probs.dtype
    _close(g, want_g, dtype, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_loss_vmap(backend):
    probs = jax.random.uniform(jax.random.PRNGKey(4), (3, 5, 8))
    tpe = jnp.arange(8, dtype=jnp.int32)
    got = jax.vmap(lambda p: gr.fused_moe_aux_loss(p, tpe, 2, 0.1, **_backend_kw(backend)))(probs)
    want = jnp.stack([ref.fused_moe_aux_loss(p, tpe, 2, 0.1) for p in probs])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aux_loss_is_bit_identical_run_to_run(backend):
    probs = jax.random.uniform(jax.random.PRNGKey(7), (7, 24))
    tpe = jnp.arange(24, dtype=jnp.int32) * 13
    f = jax.jit(lambda p: gr.fused_moe_aux_loss(p, tpe, 3, 0.01, **_backend_kw(backend)))
    first = np.asarray(f(probs))
    for _ in range(3):
        assert np.asarray(f(probs)).tobytes() == first.tobytes()


@pytest.mark.cuda
@pytest.mark.skipif(not _backend.numba_usable(),
                    reason="backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")
@settings(max_examples=6)
@given(data=st.data())
def test_kernel_vjp_matches_reference_vjp(data):
    """Fuzz: the kernel VJP equals jax.vjp of the reference for the same random cotangent."""
    sf = data.draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]), label="score_function")
    e = data.draw(st.sampled_from([4, 8, 12]), label="E")
    topk = data.draw(st.integers(1, e), label="topk")
    pre = data.draw(st.booleans(), label="use_pre_softmax") if sf == "softmax" else False
    seed = data.draw(st.integers(0, 2**16), label="seed")
    x = _tie_free_logits((3, e), jnp.float32, seed=seed)
    ct = jax.random.normal(jax.random.PRNGKey(seed), x.shape, jnp.float32)
    kw = dict(use_pre_softmax=pre, scaling_factor=1.3, score_function=sf)
    p1, vjp1 = jax.vjp(lambda x: gr.fused_topk_with_score_function(x, topk, **kw, backend="numba")[0], x)
    p2, vjp2 = jax.vjp(lambda x: ref.fused_topk_with_score_function(x, topk, **kw)[0], x)
    _close(p1, p2, "float32", "probs")
    _close(vjp1(ct)[0], vjp2(ct)[0], "float32", "grad")


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["ffi", "zero-copy", "callback"])
@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3", "mixtral", "nemotron-3-super"])
def test_presets_on_the_gpu(preset, transport):
    """Real shapes, bf16, jit + grad + vmap + fori_loop, through each transport."""
    from gpurouter.presets import PRESETS

    if transport != "callback" and jax.default_backend() != "gpu":
        pytest.skip(f"{transport} needs JAX on a GPU")
    p = PRESETS[preset]
    x = _tie_free_logits((2, 2048, p.num_experts), jnp.bfloat16, seed=11)
    bias = jnp.linspace(-0.01, 0.01, p.num_experts, dtype=jnp.float32) if p.expert_bias else None
    kw = dict(p.router_kwargs(), expert_bias=bias)
    w = jax.random.normal(jax.random.PRNGKey(3), x.shape, jnp.float32)

    def loss(x, **call):
        probs, _ = gr.fused_topk_with_score_function(x, **kw, **call)
        return jnp.sum(probs.astype(jnp.float32) * w)

    call = dict(backend="numba", transport=transport)
    probs, rmap = jax.jit(jax.vmap(lambda x: gr.fused_topk_with_score_function(x, **kw, **call)))(x)
    want_p, want_m = ref.fused_topk_with_score_function(x, **kw)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_m))
    _close(probs, want_p, "bfloat16", "probs")
    grad = jax.jit(jax.grad(functools.partial(loss, **call)))(x)
    _close(grad, jax.grad(loss)(x), "bfloat16", "grad")

    def body(i, x):
        return x - jnp.bfloat16(1e-2) * jax.grad(functools.partial(loss, **call))(x)

    def body_ref(i, x):
        return x - jnp.bfloat16(1e-2) * jax.grad(loss)(x)

    got = jax.jit(lambda x: jax.lax.fori_loop(0, 5, body, x))(x)
    want = jax.jit(lambda x: jax.lax.fori_loop(0, 5, body_ref, x))(x)
    _close(got, want, "bfloat16", "grad")


def test_forward_without_a_gradient_saves_no_scores(monkeypatch):
    """A forward without a gradient (the custom_vjp's primal) on the warp kernel gives
    no ``[T, E]`` f32 saved scores to the kernels' call (one output fewer: not
    allocated), and its probs and map are those of the forward under ``jax.vjp``,
    bit for bit (the warp kernel as on a GPU: ``warp_auto`` forced on the simulator)."""
    pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
    from gpurouter.kernels.topk import warp_paths

    monkeypatch.setattr(warp_paths, "warp_auto", lambda simulator=None: True)
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 128), jnp.bfloat16)
    bias = jnp.linspace(-0.1, 0.1, 128, dtype=jnp.float32)

    def route(v):
        return gr.fused_topk_with_score_function(v, 4, score_function="sigmoid", expert_bias=bias, backend="numba")

    def f32_rows(jaxpr) -> int:
        """The ``[T, E]`` f32 values the equations make, nested jaxprs included."""
        n = 0
        for eq in jaxpr.eqns:
            n += sum(1 for v in eq.outvars if getattr(v.aval, "shape", None) == x.shape
                     and v.aval.dtype == jnp.float32)
            for p in eq.params.values():
                for sub in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        n += f32_rows(inner)
        return n

    plain = route(x)
    primal, _ = jax.vjp(route, x)
    for a, b in zip(plain, primal, strict=True):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert f32_rows(jax.make_jaxpr(route)(x).jaxpr) == 0
    assert f32_rows(jax.make_jaxpr(lambda v: jax.vjp(route, v)[0])(x).jaxpr) >= 1
