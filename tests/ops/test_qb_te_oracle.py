"""Quantile Balancing's counts against TE's own oracle, ported to jnp
(docs/contract.md section 12): TE #3395's test suite checks its kernels
against a PyTorch reference whose steps are ``raw = sigmoid(logits)``, the
top-(K+1) of ``raw + bias``, ``cutoff`` = their smallest value, a tie at the
cutoff dropping the highest expert id, and ``floor((cutoff - raw - lower) *
(B / (upper - lower)))`` clamped into ``[0, B - 1]``. The port below takes
those steps in jnp (``jax.nn.sigmoid``, eager); on random logits, with
nothing kept away from the bin edges, gpurouter's counts must equal it bit
for bit, on ``backend="jax"`` (eager and jitted) and on ``"numba"`` (the
CUDA simulator in CI: tiny shapes). The micro-batch and tie cases follow
TE's ``test_qb_histogram_accumulates_microbatches`` and
``test_qb_topk_plus_one_tie_and_bin_clamping``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpurouter as gr
from gpurouter import _backend

NUMBA = pytest.param("numba", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not _backend.numba_usable(),
                       reason="backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")])


def _te_port(logits, topk, bias, bounds, num_bins):
    """``(routing map [T, E], counts [E, B], cutoff [T])`` by TE's oracle's steps."""
    raw = jax.nn.sigmoid(jnp.asarray(logits, jnp.float32))
    vals, idx = jax.lax.top_k(raw + jnp.asarray(bias)[None, :], topk + 1)
    cutoff = vals[:, -1]  # the (K+1)-th largest: the smallest of the K+1
    at_cutoff = jnp.where(vals == cutoff[:, None], idx, -1)
    dropped = at_cutoff.max(axis=1)  # among the tied at the cutoff, the highest expert id drops
    kept = jnp.where(idx == dropped[:, None], raw.shape[1], idx)
    rows = jnp.arange(raw.shape[0])[:, None]
    rmap = jnp.zeros((raw.shape[0], raw.shape[1] + 1), bool).at[rows, kept].set(True)[:, :-1]
    lower, upper = bounds[0], bounds[1]
    bins = jnp.floor((cutoff[:, None] - raw - lower) * (num_bins / (upper - lower)))
    bins = jnp.clip(bins.astype(jnp.int32), 0, num_bins - 1)
    flat = (bins + (jnp.arange(raw.shape[1]) * num_bins)[None, :]).reshape(-1)
    counts = jnp.bincount(flat, length=raw.shape[1] * num_bins).reshape(raw.shape[1], num_bins)
    return np.asarray(rmap), np.asarray(counts, np.int32), np.asarray(cutoff)


def _route(logits, topk, bias, bounds, hist, backend, jit=False):
    def call(x, b, bd, h):
        return gr.fused_topk_with_score_function(x, topk, score_function="sigmoid", expert_bias=b,
                                                 qb_histogram=h, qb_bin_bounds=bd, backend=backend)
    fn = jax.jit(call) if jit else call
    return fn(jnp.asarray(logits), jnp.asarray(bias), jnp.asarray(bounds), jnp.asarray(hist))


@pytest.mark.parametrize("backend,shape,topk,seed", [
    ("jax", (257, 128), 8, 0), ("jax", (257, 128), 16, 1),
    pytest.param("jax", (257, 896), 8, 2, marks=pytest.mark.slow),  # TE's test shape
    pytest.param(*NUMBA.values, (9, 64), 8, 3, marks=NUMBA.marks),
])
def test_counts_equal_te_oracle_on_random_logits(backend, shape, topk, seed):
    t, e = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, e)).astype(np.float32)
    bias = np.linspace(-0.2, 0.2, e).astype(np.float32)
    bounds = np.array([bias.min() - 1, bias.max() + 1], np.float32)
    want_map, want, _ = _te_port(x, topk, bias, bounds, 1000)
    for jit in ((False, True) if backend == "jax" else (False,)):
        _, rmap, hist = _route(x, topk, bias, bounds, np.zeros((e, 1000), np.int32), backend, jit)
        np.testing.assert_array_equal(np.asarray(rmap), want_map)
        np.testing.assert_array_equal(np.asarray(hist), want)
    assert int(want.sum()) == t * e


@pytest.mark.parametrize("backend", ["jax", NUMBA])
def test_counts_accumulate_over_micro_batches(backend):
    """Two calls of different T threaded through one histogram: the sum of both
    calls' counts."""
    e, topk = 64, 8
    bias = np.linspace(-0.1, 0.1, e).astype(np.float32)
    bounds = np.array([bias.min() - 1, bias.max() + 1], np.float32)
    rng = np.random.default_rng(7)
    hist, want = np.zeros((e, 1000), np.int32), np.zeros((e, 1000), np.int32)
    for t in ((127, 193) if backend == "jax" else (5, 7)):
        x = rng.standard_normal((t, e)).astype(np.float32)
        hist = _route(x, topk, bias, bounds, hist, backend)[-1]
        want = want + _te_port(x, topk, bias, bounds, 1000)[1]
    np.testing.assert_array_equal(np.asarray(hist), want)


@pytest.mark.parametrize("backend", ["jax", NUMBA])
def test_tie_at_the_cutoff_and_end_bins(backend):
    """Three equal logits with K = 2: experts 0 and 1 route, 2 drops; with bounds
    [-0.05, 0.05] and 8 bins both end bins catch counts."""
    x = np.array([[3.0, 3.0, 3.0, -1.0, -2.0, -3.0, -4.0, -5.0],
                  [5.0, 4.0, 3.0, 2.0, -2.0, -3.0, -4.0, -5.0]], np.float32)
    bias, bounds = np.zeros(8, np.float32), np.array([-0.05, 0.05], np.float32)
    want_map, want, _ = _te_port(x, 2, bias, bounds, 8)
    _, rmap, hist = _route(x, 2, bias, bounds, np.zeros((8, 8), np.int32), backend)
    assert np.asarray(rmap)[0, :3].tolist() == [True, True, False]
    np.testing.assert_array_equal(np.asarray(rmap), want_map)
    np.testing.assert_array_equal(np.asarray(hist), want)
    assert want[:, 0].sum() > 0 and want[:, -1].sum() > 0
