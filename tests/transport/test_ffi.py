"""The ``"ffi"`` transport on the GPU: every kernel op, forward and backward,
bit for bit what the zero-copy transport gives (the same kernels, launched by
XLA instead of Python), under jit, grad, vmap, fori_loop, scan and remat, for
every float dtype, leading dims and T == 0, and its error path."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gpurouter as gr
from gpurouter.presets import PRESETS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="the ffi transport needs JAX on a CUDA GPU"),
]

ROUTERS = {  # the presets' routers, and two variants the presets lack
    "deepseek-v3": PRESETS["deepseek-v3"].router_kwargs(),
    "qwen3": dict(PRESETS["qwen3"].router_kwargs(), use_pre_softmax=True),
    "mixtral": PRESETS["mixtral"].router_kwargs(),
    "sqrtsoftplus": dict(PRESETS["deepseek-v4"].router_kwargs(), topk=4),
}
EXPERTS = {"deepseek-v3": 256, "qwen3": 128, "mixtral": 8, "sqrtsoftplus": 64}


def _logits(shape, dtype, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x),
                                      np.asarray(y.astype(jnp.float32) if y.dtype == jnp.bfloat16 else y))


def _route(transport, kw, bias=None, **extra):
    def f(x):
        return gr.fused_topk_with_score_function(x, **kw, expert_bias=bias, backend="numba",
                                                 transport=transport, **extra)
    return f


def _loss_and_grad(f, x, w):
    def loss(x):
        out = f(x)
        return jnp.sum(out[0].astype(jnp.float32) * w), out
    (value, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    return value, out, grad


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_topk_equals_zero_copy_bit_for_bit(router, dtype):
    e = EXPERTS[router]
    x = _logits((3, 40, e), dtype, seed=1)  # leading dims
    w = _logits(x.shape, jnp.float32, seed=2)
    bias = jnp.linspace(-0.05, 0.05, e, dtype=jnp.float32) if router == "deepseek-v3" else None
    kw = ROUTERS[router]
    _same(_loss_and_grad(_route("ffi", kw, bias), x, w), _loss_and_grad(_route("zero-copy", kw, bias), x, w))


@pytest.mark.parametrize("extra", [dict(compute_aux_scores=True), dict(routing_map_format="BITMAP_U8"),
                                   dict(return_indices=True)])
def test_aux_scores_bitmap_and_indices_equal_zero_copy(extra):
    x = _logits((64, 256), jnp.bfloat16, seed=3)
    w = _logits(x.shape, jnp.float32, seed=4)
    kw = ROUTERS["deepseek-v3"]
    if extra.get("compute_aux_scores"):  # the aux scores take no groups or scaling (contract section 6)
        kw = dict(topk=kw["topk"], score_function=kw["score_function"])
    _same(_loss_and_grad(_route("ffi", kw, **extra), x, w), _loss_and_grad(_route("zero-copy", kw, **extra), x, w))


def test_replay_equals_zero_copy():
    x = _logits((64, 128), jnp.float32, seed=5)
    w = _logits(x.shape, jnp.float32, seed=6)
    idx = jnp.tile(jnp.arange(8, dtype=jnp.int32)[::-1], (64, 1))
    kw = ROUTERS["qwen3"]
    _same(_loss_and_grad(_route("ffi", kw, forced_indices=idx), x, w),
          _loss_and_grad(_route("zero-copy", kw, forced_indices=idx), x, w))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_aux_loss_and_z_loss_equal_zero_copy(dtype):
    probs = jax.nn.softmax(_logits((96, 64), jnp.float32, seed=7)).astype(dtype)
    tpe = jnp.arange(64, dtype=jnp.int32) % 7

    def both(transport):
        def f(p):
            aux = gr.fused_moe_aux_loss(p, tpe, 4, 0.01, backend="numba", transport=transport)
            z = gr.router_z_loss(p, 0.001, backend="numba", transport=transport)
            return aux.astype(jnp.float32) + z
        return jax.jit(jax.value_and_grad(f))(probs)

    _same(both("ffi"), both("zero-copy"))


def test_vmap_folds_tokens_and_maps_a_batched_bias():
    kw = ROUTERS["deepseek-v3"]
    x = _logits((4, 32, 256), jnp.bfloat16, seed=8)
    biases = jnp.stack([jnp.linspace(-0.1, 0.1, 256) * s for s in (1, -1, 2, 0)]).astype(jnp.float32)
    folded = [jax.jit(jax.vmap(_route(t, kw, biases[0])))(x) for t in ("ffi", "zero-copy")]
    _same(folded[0], folded[1])
    per_elem = [jax.jit(jax.vmap(lambda x, b, t=t: _route(t, kw, b)(x)))(x, biases) for t in ("ffi", "zero-copy")]
    _same(per_elem[0], per_elem[1])
    for i in range(4):  # and each element is the unbatched call
        _same(jax.tree.map(lambda a, i=i: a[i], per_elem[0]), _route("ffi", kw, biases[i])(x[i]))


def test_fori_loop_scan_and_remat():
    kw = ROUTERS["qwen3"]
    x = _logits((128, 128), jnp.float32, seed=9)
    f = _route("ffi", kw)

    def body(_, c):
        return c + 0.01 * f(c)[0]

    looped = jax.jit(lambda x: lax.fori_loop(0, 5, body, x))(x)
    want = x
    for _ in range(5):
        want = want + 0.01 * _route("zero-copy", kw)(want)[0]
    _same(looped, want)
    scanned = jax.jit(lambda xs: lax.scan(lambda c, xi: (c + jnp.sum(f(xi)[0]), None), 0.0, xs)[0])(
        jnp.stack([x, 2 * x]))
    assert np.isfinite(float(scanned))
    g1 = jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(lambda y: f(y)[0])(x) ** 2)))(x)
    g2 = jax.jit(jax.grad(lambda x: jnp.sum(f(x)[0] ** 2)))(x)
    _same(g1, g2)


def test_zero_tokens():
    x = jnp.zeros((0, 64), jnp.bfloat16)
    probs, routing_map = _route("ffi", ROUTERS["sqrtsoftplus"])(x)
    assert probs.shape == (0, 64) and routing_map.shape == (0, 64)


def test_every_call_carries_this_process_number():
    """The ``process`` attribute beside ``plan``: the lowered program holds this
    process's number, so a persistent compile cache cannot reuse it elsewhere."""
    from gpurouter._transport import ffi

    x = _logits((16, 64), jnp.float32)
    text = jax.jit(_route("ffi", ROUTERS["sqrtsoftplus"])).lower(x).as_text()
    numbers = {int(n) for n in re.findall(r"process = (-?\d+) : i64", text)}
    assert numbers == {int(ffi.PROCESS_SALT)}


def test_a_failed_launch_is_an_error_naming_the_op_and_the_process_lives_on():
    """A record whose kernel handle is 0: cuLaunchKernel refuses it, the handler
    returns XLA's error with the CUresult, and the next call works."""
    from gpurouter._transport import ffi, ffi_record
    from gpurouter.kernels._base.context import primary_context
    from gpurouter.kernels._base.plan import Plan, Spec
    from gpurouter.kernels._base.pointer import CompiledStep

    plan = Plan("broken_op", [Spec((4,), np.float32)], [Spec((4,), np.float32)], [], [])
    ordinals = ffi_record._gpu_ordinals()
    step = CompiledStep(0, 1, 32, 0, bytes(8), [], "none")
    rec, msgs = ffi_record.build_record(plan, ordinals, {o: [step] for o in ordinals},
                                 {o: primary_context(o) for o in ordinals}, ffi_record._driver())
    ffi._register()
    call = jax.ffi.ffi_call(ffi.TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))
    with pytest.raises(Exception, match=re.escape("gpurouter ffi (broken_op): cuLaunchKernel failed (CUresult ")):
        jax.block_until_ready(jax.jit(lambda a: call(a, plan=np.int64(rec.ctypes.data)))(jnp.ones(4)))
    del msgs
    x = _logits((16, 64), jnp.float32)
    assert _route("ffi", ROUTERS["sqrtsoftplus"])(x)[0].shape == (16, 64)
