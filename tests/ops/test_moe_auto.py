"""``moe(..., grouped_matmul="auto")``, the block's default: the measured rule
(``gpurouter.reference.moe.auto_grouped_matmul``), the default block as its
choice bit for bit, the blocks of no tokens, and the slots (what "auto" runs on
an NVIDIA GPU) against ``batched_ragged_dot`` (what it runs elsewhere) over
drawn blocks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpurouter import moe as gmoe
from gpurouter import reference as ref

from .test_moe import KW, H, _call, _params


class _Device:
    def __init__(self, kind):
        self.device_kind = kind


@pytest.mark.parametrize("platform,kind,ep_axis,want", [
    ("gpu", "NVIDIA H200", None, "slots"),  # measured faster on an H200 at every shape tried
    ("gpu", "NVIDIA H200", "ep", "batched"),  # under EP the slots' rows path was no faster (2 x H200)
    ("gpu", "AMD Instinct MI300X", None, "batched"),  # no measurement on other GPUs
    ("cpu", "cpu", None, "batched"),  # jax.lax.ragged_dot 26-44x slower on a CPU, out of memory at DeepSeek-V3
])
def test_auto_grouped_matmul_is_the_measured_choice(monkeypatch, platform, kind, ep_axis, want):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device(kind)])
    got = ref.moe.auto_grouped_matmul(ep_axis)
    assert got == ("slots" if want == "slots" else gmoe.batched_ragged_dot)


@pytest.mark.parametrize("gmm", ["auto", "slots", "batched", "ragged_dot"])
def test_a_block_of_no_tokens(gmm):
    """``x`` with no tokens (``[0, H]``, and ``[2, 0, H]``): an empty output in x's
    dtype, an aux loss of 0 and zero gradients, on every grouped GEMM (the
    slots had none to gather, and "auto" picks them on a GPU)."""
    fn = {"batched": gmoe.batched_ragged_dot, "ragged_dot": jax.lax.ragged_dot}.get(gmm, gmm)
    p = _params(seed=6, dtype=jnp.bfloat16)
    for shape in ((0, H), (2, 0, H)):
        q = dict(p, x=jnp.zeros(shape, jnp.bfloat16))
        out, aux = _call(gmoe.moe, q, dict(KW, aux_loss_coeff=1e-2), grouped_matmul=fn)
        assert out.shape == shape and out.dtype == jnp.bfloat16 and float(aux) == 0.0
        g = jax.grad(lambda w, q=q: jnp.sum(_call(gmoe.moe, dict(q, wi_0=w), dict(KW), grouped_matmul=fn)[0]
                                            .astype(jnp.float32)))(p["wi_0"])
        assert g.shape == p["wi_0"].shape and not np.asarray(g, np.float32).any()


def test_the_default_block_is_the_auto_choice():
    """``moe``'s default grouped GEMM is ``"auto"``: the block on its choice here
    (``batched_ragged_dot`` on a CPU, ``"slots"`` on an NVIDIA GPU), the same
    values and gradients bit for bit."""
    choice = ref.moe.auto_grouped_matmul(None)
    nvidia = jax.default_backend() == "gpu" and jax.devices()[0].device_kind.upper().startswith("NVIDIA")
    assert choice == ("slots" if nvidia else gmoe.batched_ragged_dot)
    p = _params(seed=5)

    def loss(w, **extra):
        out, _ = _call(gmoe.moe, dict(p, wi_0=w), dict(KW), **extra)
        return jnp.sum(out ** 2), out

    (_, out), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(p["wi_0"])
    (_, out_b), g_b = jax.jit(jax.value_and_grad(functools.partial(loss, grouped_matmul=choice),
                                                 has_aux=True))(p["wi_0"])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_b))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_b))


@settings(max_examples=5, deadline=None)  # each example compiles both blocks: ~10 s on a CI core
@given(t=st.integers(1, 40), e=st.sampled_from([1, 2, 4, 8]), k_frac=st.floats(0, 1), m=st.integers(1, 7),
       early=st.booleans(), biases=st.booleans(), score=st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]),
       skew=st.floats(0, 6), seed=st.integers(0, 2**16))
def test_slots_equal_batched_on_drawn_blocks(t, e, k_frac, m, early, biases, score, skew, seed):
    """The block on ``"slots"`` against ``batched_ragged_dot``, float64, any T,
    E, K <= E, M, early or late weighting, biases or none, a score function and
    a skew towards expert 0 (its rows past the slots' 1.5x cap go to tiles):
    the same output and gradients (x, the weights) to float64 rounding."""
    k = 1 + int(k_frac * (e - 1))
    kw = dict(num_experts=e, num_experts_per_tok=k, apply_topk_weights_early=early, score_function=score)
    with jax.enable_x64(True):
        ks = jax.random.split(jax.random.PRNGKey(seed), 8)
        x = jax.random.normal(ks[0], (t, H), jnp.float64)
        g = jax.random.normal(ks[1], (H, e), jnp.float64).at[:, 0].add(skew)
        w0, w1 = (jax.random.normal(kk, (e, H, m), jnp.float64) * 0.4 for kk in ks[2:4])
        wo = jax.random.normal(ks[4], (e, m, H), jnp.float64) * 0.4
        b = [jax.random.normal(kk, s, jnp.float64) * 0.3 for kk, s in zip(ks[5:], ((e, m), (e, m), (e, H)),
                                                                       strict=True)] if biases else [None] * 3

        def grads(gmm):
            def loss(x_, w0_, wo_):
                out, _ = gmoe.moe(x_, g, w0_, w1, wo_, *b, None, grouped_matmul=gmm, backend="jax", **kw)
                return jnp.sum(out ** 2), out
            (_, out), d = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w0, wo)
            return (out, *d)

        for got, want in zip(grads("slots"), grads(gmoe.batched_ragged_dot), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, atol=1e-9)
