"""The expert FFN in capacity slots (``moe(..., grouped_matmul="slots")``) on a
GPU at the MoE issue's two full shapes: the same values and gradients in bf16
as the row-by-row FFN on ``batched_ragged_dot``, balanced routing (slots) and
skewed (the largest expert at 4x the mean: the largest slots, 1.5x the mean,
and tiles past them); and the block's path from tokens to tokens
(``slots_token_ffn``) against the argsort dispatch, that row FFN and the
combine.
Times: ``moe-bench --grouped-matmul batched,slots``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemm_gpu_helpers import SHAPES, max_rel_error
from gemm_gpu_helpers import sizes as _sizes

from gpurouter.reference.grouped_matmul import batched_ragged_dot
from gpurouter.reference.moe import _expert_ffn, argsort_combine, argsort_dispatch, rows_of_groups
from gpurouter.reference.slot_experts import slots_expert_ffn, slots_token_ffn

pytestmark = pytest.mark.gpu


@functools.cache
def _operands(name):
    t, h, e, k, m = SHAPES[name][:5]
    ks = jax.random.split(jax.random.PRNGKey(1), 6)
    n = t * k
    x = jax.random.normal(ks[0], (n, h)).astype(jnp.bfloat16)
    w = dict(wi_0=(jax.random.normal(ks[1], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16),
             wi_1=(jax.random.normal(ks[2], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16),
             wo=(jax.random.normal(ks[3], (e, m, h)) / np.sqrt(m)).astype(jnp.bfloat16))
    w_rows = jax.random.uniform(ks[4], (n,), jnp.float32)
    dz = jax.random.normal(ks[5], (n, h), jnp.float32)
    return (t, e, k), x, w, w_rows, dz


@functools.cache
def _step(slots: bool):
    def f(x, w, w_rows, sizes, dz):
        rows_e = rows_of_groups(sizes, x.shape[0])
        kw = dict(wi_0_bias=None, wi_1_bias=None, wo_bias=None, activation=jax.nn.silu, early=True,
                  dtype=jnp.bfloat16)
        if slots:
            fn = functools.partial(slots_expert_ffn, **kw)
        else:
            fn = functools.partial(_expert_ffn, **kw, align_size=0, grouped_matmul=batched_ragged_dot)
        z, vjp = jax.vjp(lambda x_, w_: fn(x_, rows_e, sizes, w_rows, **w_), x, w)
        dx, dw = vjp(dz)
        return z, dx, dw["wi_0"], dw["wo"]
    return jax.jit(f)


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_slots_equal_the_row_ffn_at_the_full_shapes(name, routing):
    (t, e, k), x, w, w_rows, dz = _operands(name)
    sizes = _sizes(t, e, k, routing == "skewed")
    got = _step(True)(x, w, w_rows, sizes, dz)
    want = _step(False)(x, w, w_rows, sizes, dz)
    for what, a, b in zip(("z", "d x", "d wi_0", "d wo"), got, want, strict=True):
        assert a.dtype == b.dtype, what
        err, finite = max_rel_error(a, b)
        print(f"{name} {routing} {what}: max error {err:.2e} of the largest value")
        assert finite and err < 2e-2, (what, err)


@functools.cache
def _token_operands(name, skewed: bool):
    t, h, e, k, m = SHAPES[name][:5]
    ks = jax.random.split(jax.random.PRNGKey(2), 4)
    _, _, w, _, _ = _operands(name)
    logits = jax.random.normal(ks[0], (t, e))
    if skewed:  # expert 0 among the picks of 4x its mean share of the tokens
        logits = logits.at[: 4 * t * k // e, 0].add(100.0)
    idx = jnp.argsort(-logits, axis=1)[:, :k].astype(jnp.int32)
    return (jax.random.normal(ks[1], (t, h)).astype(jnp.bfloat16), idx,
            jax.random.uniform(ks[2], (t, k), jnp.float32), w, jax.random.normal(ks[3], (t, h), jnp.float32))


@functools.cache
def _token_step(slots: bool):
    kw = dict(wi_0_bias=None, wi_1_bias=None, wo_bias=None, activation=jax.nn.silu, dtype=jnp.bfloat16)

    def block(x, idx, wt, w):
        if slots:
            return slots_token_ffn(x, idx, wt, **kw, **w)
        probs = jnp.zeros((x.shape[0], w["wi_0"].shape[0]), jnp.float32).at[
            jnp.arange(x.shape[0])[:, None], idx].set(wt)
        xs, rows_e, sizes, w_rows, state = argsort_dispatch(x, probs, None, idx, w["wi_0"].shape[0])
        z = _expert_ffn(xs, rows_e, sizes, w_rows, **kw, **w, early=True, align_size=0,
                        grouped_matmul=batched_ragged_dot)
        return argsort_combine(z, state, False)

    def f(x, idx, wt, w, dout):
        out, vjp = jax.vjp(lambda x_, wt_, w_: block(x_, idx, wt_, w_), x, wt, w)
        dx, dwt, dw = vjp(dout)
        return out, dx, dwt, dw["wi_0"], dw["wo"]
    return jax.jit(f)


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_token_slots_equal_dispatch_ffn_combine_at_the_full_shapes(name, routing):
    """The block's slots from tokens to tokens (``slots_token_ffn``) against the
    argsort dispatch, the row FFN on ``batched_ragged_dot`` and the combine."""
    x, idx, wt, w, dout = _token_operands(name, routing == "skewed")
    got = _token_step(True)(x, idx, wt, w, dout)
    want = _token_step(False)(x, idx, wt, w, dout)
    for what, a, b in zip(("out", "d x", "d weights", "d wi_0", "d wo"), got, want, strict=True):
        assert a.dtype == b.dtype, what
        err, finite = max_rel_error(a, b)
        print(f"{name} {routing} tokens {what}: max error {err:.2e} of the largest value")
        assert finite and err < 2e-2, (what, err)


def test_auto_picks_the_slots_on_an_nvidia_gpu():
    """``grouped_matmul="auto"`` (the block's default) on an NVIDIA GPU is
    ``"slots"``: the default block's output and gradients are the slots
    block's, bit for bit (a small bf16 block, numba router)."""
    from gpurouter import moe as gmoe
    from gpurouter.reference.moe import auto_grouped_matmul

    assert jax.devices()[0].device_kind.upper().startswith("NVIDIA")
    assert auto_grouped_matmul(None) == "slots" and auto_grouped_matmul("ep") is batched_ragged_dot
    t, h, e, k, m = 256, 128, 16, 4, 64
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    x = jax.random.normal(ks[0], (t, h)).astype(jnp.bfloat16)
    g = (jax.random.normal(ks[1], (h, e)) / np.sqrt(h)).astype(jnp.bfloat16)
    w0, w1 = ((jax.random.normal(kk, (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16) for kk in ks[2:4])
    wo = (jax.random.normal(ks[4], (e, m, h)) / np.sqrt(m)).astype(jnp.bfloat16)

    def step(**extra):
        def loss(x_, w_):
            out, _ = gmoe.moe(x_, g, w_, w1, wo, num_experts=e, num_experts_per_tok=k, backend="numba", **extra)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w0)

    (v, (dx, dw)), (v_s, (dx_s, dw_s)) = step(), step(grouped_matmul="slots")
    assert float(v) == float(v_s)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_s, np.float32))
    np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(dw_s, np.float32))
