"""TE's BITMAP_U8 routing map (TE #3009) through the public op, every backend.

The bitmap must equal ``np.packbits(bytemap, axis=-1, bitorder="little")`` of
the same call's bool map, and probs and gradients must be the same bits in
both formats (the backward reads the map in the format the forward wrote).
Kernels run through the pure_callback transport on the CUDA simulator in CI
(tiny shapes) and zero-copy on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from public_helpers import BACKENDS
from public_helpers import backend_kw as _backend_kw
from public_helpers import tie_free_logits as _tie_free_logits

import gpurouter as gr
from gpurouter import reference as ref

BITMAP = gr.RoutingMapFormat.BITMAP_U8


def _same(a, b):
    """Equal values, NaN where NaN (compared as float32: NumPy does not match bf16 NaNs)."""
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _packbits(m) -> np.ndarray:
    return np.packbits(np.asarray(m), axis=-1, bitorder="little")


# (name, E, router kwargs): every score function, pre/post softmax, groups,
# bias, K = 1, E a multiple of 8 and not (12, 20: a half last byte).
CASES = [
    ("softmax-post", 12, dict(topk=3, score_function="softmax")),
    ("softmax-pre", 16, dict(topk=4, score_function="softmax", use_pre_softmax=True, scaling_factor=1.5)),
    ("sigmoid-groups-bias", 16, dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
                                     scaling_factor=2.5, bias=True)),
    ("sqrtsoftplus-bias", 20, dict(topk=5, score_function="sqrtsoftplus", bias=True)),
    ("sigmoid-k1", 8, dict(topk=1, score_function="sigmoid")),
    ("aux-scores-sigmoid", 12, dict(topk=3, score_function="sigmoid", compute_aux_scores=True)),
    ("aux-scores-softmax", 16, dict(topk=2, score_function="softmax", compute_aux_scores=True)),
]


def _router(backend, kw, fmt):
    kw = dict(kw)
    bias = None
    if kw.pop("bias", False):
        bias = jnp.linspace(0.3, -0.3, 20, dtype=jnp.float32)
    kw.update(_backend_kw(backend))

    def route(x):
        b = None if bias is None else bias[: x.shape[-1]]
        return gr.fused_topk_with_score_function(x, expert_bias=b, routing_map_format=fmt, **kw)

    return route


def _special_rows(x):
    """Row 0 all -inf, row 1 -inf and NaN with two finite entries: filler selections."""
    e = x.shape[-1]
    x = x.at[0].set(-jnp.inf)
    row = jnp.full((e,), -jnp.inf, x.dtype).at[1::3].set(jnp.nan).at[e - 1].set(1).at[e - 2].set(0.5)
    return x.at[1].set(row)


# Each case in one dtype in the fast suite (float32 and bfloat16 by turns: every backend
# runs both, and every score function mode in one or the other); the other dtype under
# slow (``make test-slow``).  The kernels' bf16 bitmap stores: tests/kernels/topk/test_map_format.py.
DTYPE_CASES = [
    pytest.param(dtype, *case, id=f"{dtype}-{case[0]}",
                 marks=() if dtype == ("float32", "bfloat16")[i % 2] else pytest.mark.slow)
    for dtype in ("float32", "bfloat16") for i, case in enumerate(CASES)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,name,e,kw", DTYPE_CASES)
def test_bitmap_equals_packed_bytemap(backend, name, e, kw, dtype):
    x = _special_rows(_tie_free_logits((2, 3, e), dtype, seed=e))
    by = jax.jit(_router(backend, kw, "bytemap"))
    bit = jax.jit(_router(backend, kw, BITMAP))
    probs_by, map_by = by(x)
    probs_bit, map_bit = bit(x)
    assert map_by.dtype == jnp.bool_ and map_by.shape == x.shape
    assert map_bit.dtype == jnp.uint8 and map_bit.shape == x.shape[:-1] + (-(-e // 8),)
    np.testing.assert_array_equal(np.asarray(map_bit), _packbits(map_by))
    _same(probs_bit, probs_by)
    np.testing.assert_array_equal(np.asarray(gr.unpack_routing_map(map_bit, e)), np.asarray(map_by))
    np.testing.assert_array_equal(np.asarray(gr.tokens_per_expert(map_bit, e)),
                                  np.asarray(gr.tokens_per_expert(map_by)))

    def loss(route, x):
        p = route(x)[0].astype(jnp.float32)
        return jnp.sum(jnp.where(jnp.isfinite(p), p, 0) * jnp.arange(e, dtype=jnp.float32)[None, None])

    g_by = jax.jit(jax.grad(functools.partial(loss, _router(backend, kw, "bytemap"))))(x)
    g_bit = jax.jit(jax.grad(functools.partial(loss, _router(backend, kw, BITMAP))))(x)
    _same(g_bit, g_by)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitmap_under_vmap_matches_the_reference(backend):
    x = _tie_free_logits((2, 4, 20), jnp.float32, seed=3)
    f = functools.partial(gr.fused_topk_with_score_function, topk=3, score_function="sigmoid",
                          routing_map_format="BITMAP_U8", **_backend_kw(backend))
    probs, bits = jax.jit(jax.vmap(f))(x)
    want_p, want_m = ref.fused_topk_with_score_function(x, 3, score_function="sigmoid")
    assert bits.shape == (2, 4, 3)
    np.testing.assert_array_equal(np.asarray(bits), _packbits(want_m))
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want_p), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitmap_of_zero_tokens(backend):
    probs, bits = gr.fused_topk_with_score_function(jnp.zeros((0, 12), jnp.float32), 2,
                                                    routing_map_format=1, **_backend_kw(backend))
    assert probs.shape == (0, 12) and bits.shape == (0, 2) and bits.dtype == jnp.uint8


def test_aux_loss_from_a_bitmap_count():
    """What a caller of fused_moe_aux_loss does with either format: the same loss."""
    x = _tie_free_logits((6, 12), jnp.float32, seed=9)
    scores, bits = gr.fused_topk_with_score_function(x, 3, score_function="sigmoid",
                                                     compute_aux_scores=True, routing_map_format=BITMAP)
    _, bools = gr.fused_topk_with_score_function(x, 3, score_function="sigmoid", compute_aux_scores=True)
    loss_bits = gr.fused_moe_aux_loss(scores, gr.tokens_per_expert(bits, 12), 3, 1e-2)
    loss_bools = gr.fused_moe_aux_loss(scores, jnp.sum(bools, axis=0, dtype=jnp.int32), 3, 1e-2)
    assert float(loss_bits) == float(loss_bools)
