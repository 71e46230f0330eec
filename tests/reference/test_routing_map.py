"""The routing-map helpers against NumPy's packbits (the BITMAP_U8 layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpurouter import reference as ref


@given(st.data())
def test_pack_unpack_and_counts_match_numpy(data):
    e = data.draw(st.integers(1, 40), label="E")
    lead = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2), label="leading dims")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    m = np.random.default_rng(seed).random(tuple(lead) + (e,)) < 0.3
    bits = ref.pack_routing_map(jnp.asarray(m))
    want = np.packbits(m, axis=-1, bitorder="little")  # LSB first; padding bits 0
    assert bits.dtype == jnp.uint8 and bits.shape == want.shape == tuple(lead) + (-(-e // 8),)
    np.testing.assert_array_equal(np.asarray(bits), want)
    np.testing.assert_array_equal(np.asarray(ref.unpack_routing_map(bits, e)), m)
    counts = m.reshape(-1, e).sum(0)
    np.testing.assert_array_equal(np.asarray(ref.tokens_per_expert(bits, e)), counts)
    np.testing.assert_array_equal(np.asarray(ref.tokens_per_expert(jnp.asarray(m))), counts)
    assert ref.tokens_per_expert(bits, e).dtype == jnp.int32


def test_unpack_ignores_padding_bits_and_passes_a_bytemap_through():
    bits = jnp.array([[0xFF, 0xFF]], jnp.uint8)  # padding bits set (not what a router writes)
    assert ref.unpack_routing_map(bits, 9).tolist() == [[True] * 9]
    m = jnp.array([[True, False, True]])
    assert ref.unpack_routing_map(m, 3) is not None
    np.testing.assert_array_equal(np.asarray(ref.unpack_routing_map(m, 3)), np.asarray(m))


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("aux", [False, True])
def test_reference_bitmap_is_the_packed_bytemap(sf, aux):
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 13), jnp.float32)
    p0, m0 = ref.fused_topk_with_score_function(x, 3, score_function=sf, compute_aux_scores=aux)
    p1, m1 = ref.fused_topk_with_score_function(x, 3, score_function=sf, compute_aux_scores=aux,
                                                routing_map_format="bitmap_u8")
    np.testing.assert_array_equal(np.asarray(m1), np.packbits(np.asarray(m0), axis=-1, bitorder="little"))
    np.testing.assert_array_equal(np.asarray(p1), np.asarray(p0))


def test_low_level_pair_takes_either_map():
    x = jax.random.normal(jax.random.PRNGKey(2), (6, 12), jnp.float32)
    g = jax.random.normal(jax.random.PRNGKey(3), (6, 12), jnp.float32)
    probs, m, saved = ref.topk_with_score_function_fwd(x, 3, score_function="sigmoid", routing_map_format=0)
    probs1, bits, saved1 = ref.topk_with_score_function_fwd(x, 3, score_function="sigmoid",
                                                            routing_map_format=1)
    assert bits.shape == (6, 2) and bits.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(saved1), np.asarray(saved))
    dx = ref.topk_with_score_function_bwd(m, saved, g, 3, score_function="sigmoid")
    dx1 = ref.topk_with_score_function_bwd(bits, saved, g, 3, score_function="sigmoid")
    np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx))
    _, abits, _ = ref.score_for_aux_loss_fwd(x, 3, "softmax", routing_map_format="BITMAP_U8")
    _, amap, _ = ref.score_for_aux_loss_fwd(x, 3, "softmax")
    np.testing.assert_array_equal(np.asarray(abits), np.packbits(np.asarray(amap), axis=-1, bitorder="little"))
