"""The thread-per-token top-k forward (``gpurouter/kernels/topk/token/fwd.py``)
against the reference: the dispatch to it, specials, fillers, ties, groups,
quads in every dtype, several blocks with a partial last tile.  Tiny shapes
(E a multiple of 4, K <= 64): the simulator runs them; the TE shapes are in
test_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import random_cotangent, tie_free_rows_np  # noqa: E402

from ..._helpers import FWD_MODES, check_special_rows, check_topk_bwd, check_topk_fwd, host  # noqa: E402
from ..._helpers import bias as _bias  # noqa: E402
from ..._helpers import cfg as _cfg  # noqa: E402
from ..._helpers import sel as _sel  # noqa: E402

pytestmark = pytest.mark.cuda


def _kernel_of(plan):
    """True when the plan's kernel is a thread-per-token one (``token_topk_fwd.py``,
    ``token_aux_scores_fwd.py``)."""
    return plan.steps[0].kernel.py_func.__module__.startswith("gpurouter.kernels.topk.token.")


#: the selections of the token forward (``token_tiling``'s ``lanes``; ``token_lanes``'s mode)
FLAT_LANES, GROUP_LANES = ["chunk", "row"], ["chunk", "group", "row"]
_MODE = {"chunk": 2, "group": 1, "row": 0}


def _assert_lanes(K, lanes, T, E, k, G=0, has_bias=False):
    """The forced selection is the one the plan of ``K`` (a ``Tiled``) takes for this shape."""
    from gpurouter.kernels.topk.token.tiling import token_lanes

    assert token_lanes(T, E, k, max(G, 0), has_bias, K.tiling.token)[0] == _MODE[lanes]


def test_dispatch():
    """E % 4 == 0 and K <= 64 take the token kernels, the rest the W-lane ones (softmax-pre:
    the warp kernel, which ``path="auto"`` takes on a GPU, never does)."""
    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as _plan
    from gpurouter.kernels.topk import aux_plans as aux_scores
    from gpurouter.kernels.topk import plans as topk

    def fwd(E, k, G=-1, Kg=-1):
        return topk.topk_with_score_function_fwd_plan(_plan.spec_of((5, E), L.BF16), False, k, True,
                                                      G, Kg, np.float32(1), L.SOFTMAX)

    assert _kernel_of(fwd(256, 8, 8, 4)) and _kernel_of(fwd(8, 2)) and _kernel_of(fwd(32, 16))
    assert _kernel_of(fwd(64, 17)) and _kernel_of(fwd(512, 22)) and _kernel_of(fwd(68, 64))
    assert not _kernel_of(fwd(10, 4)) and not _kernel_of(fwd(68, 65))
    assert _kernel_of(aux_scores.score_for_aux_loss_fwd_plan(_plan.spec_of((5, 12), L.F32), 3, 0))
    assert not _kernel_of(aux_scores.score_for_aux_loss_fwd_plan(_plan.spec_of((5, 13), L.F32), 3, 0))


@pytest.mark.parametrize("lanes", FLAT_LANES)
@pytest.mark.parametrize("sf,pre", FWD_MODES)
def test_specials_fillers_partial_tile(token_tiling, sf, pre, lanes):
    # 2 tokens per block: 5 rows give 3 blocks, the last one partial
    K = token_tiling(2, lanes=lanes)
    _assert_lanes(K, lanes, 5, 12, 4)
    ninf, nan = -np.inf, np.nan
    x = np.array([
        [ninf] * 12,                                                       # all -inf
        [ninf, 1.0, ninf, ninf, ninf, ninf, ninf, 2.0, ninf, ninf, ninf, ninf],  # 2 finite < K
        [nan, 0.5, 0.25, 0.75, ninf, -1.0, nan, 3.0, 0.5, nan, 0.1, -0.0],  # NaN as -inf
        [0.5, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan],      # mostly NaN
        [0.1, 0.9, -0.3, 0.7, 0.2, -0.8, 0.4, 0.6, -0.5, 0.3, 0.0, -0.1],  # plain
    ], np.float32)
    check_special_rows(K, x, 4, pre, sf, [[0, 1, 2, 3], [0, 1, 2, 7]])


@pytest.mark.parametrize("lanes", FLAT_LANES)
@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
def test_ties_and_signed_zeros(token_tiling, sf, lanes):
    K = token_tiling(2, lanes=lanes)
    _assert_lanes(K, lanes, 3, 12, 5)
    x = np.zeros((3, 12), np.float32)
    x[1] = [1, 2, 2, 0, 2, 2, 1, 0, 2, 2, 1, 2]
    x[2] = [-0.0, 0.0, 0.0, -0.0, -1, -0.0, 3, 3, 0.0, -2, 3, -0.0]
    p, m, _ = K.topk_with_score_function_fwd(x, 5, score_function=sf)
    rp, rm, _ = (host(a) for a in ref.topk_with_score_function_fwd(x, 5, score_function=sf))
    assert _sel(m) == [[0, 1, 2, 3, 4], [1, 2, 4, 5, 8], [0, 1, 6, 7, 10]]
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(p, rp, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lanes", GROUP_LANES)
def test_group_ties_and_dropped_fillers(token_tiling, lanes):
    K = token_tiling(1, lanes=lanes)
    _assert_lanes(K, lanes, 2, 16, 4, 4)
    x = np.zeros((2, 16), np.float32)
    p, m, _ = K.topk_with_score_function_fwd(x, 4, num_groups=4, group_topk=2,
                                             score_function="sigmoid")
    assert _sel(m) == [[0, 1, 2, 3]] * 2
    # group 2 holds the only finite values; groups 0, 1, 3 tie at -inf (row 1:
    # a NaN group score, as -inf): groups 0 and 2 kept, fillers from group 0 only
    x = np.full((2, 16), -np.inf, np.float32)
    x[:, 8:10] = [1.0, 2.0]
    x[1, 0] = np.nan
    p, m, _ = K.topk_with_score_function_fwd(x, 4, num_groups=4, group_topk=2)
    rm = host(ref.topk_with_score_function_fwd(x, 4, num_groups=4, group_topk=2)[1])
    assert _sel(m) == [[0, 1, 8, 9]] * 2
    np.testing.assert_array_equal(m, rm)


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("grouped,lanes", [(False, la) for la in FLAT_LANES] + [(True, la) for la in GROUP_LANES],
                         ids=[f"flat-{la}" for la in FLAT_LANES] + [f"groups-{la}" for la in GROUP_LANES])
def test_ties_across_the_threshold(token_tiling, sf, pre, grouped, lanes):
    """Coarse-grid rows (ties everywhere, as bf16 logits give), a bias with
    repeated values, rows with fewer than K finite scores, all in one block
    with tie-free rows: the threshold way with and without a tie cutoff and
    the bit way side by side, maps exact against the reference."""
    K = token_tiling(8, lanes=lanes)
    _assert_lanes(K, lanes, 12, 32, 6, 4 if grouped else 0, sf != "softmax")
    rng = np.random.default_rng(21)
    T, E, k = 12, 32, 6
    x = (rng.integers(-6, 7, (T, E)) / 4).astype(np.float32)
    x[3] = rng.permutation(E) / 8  # tie-free
    x[5, :] = -np.inf
    x[5, [4, 9, 30]] = [1.0, 1.0, 0.5]  # 3 finite < K: -inf fillers
    x[7, ::3] = np.nan
    x[9, :] = 0.25  # one value everywhere
    if sf != "softmax":
        x = np.where(np.isneginf(x), np.float32(-30.0), x)
    kw = dict(topk=k, use_pre_softmax=pre, score_function=sf, scaling_factor=1.5)
    if grouped:
        kw.update(num_groups=4, group_topk=2)
    bias = None
    if sf != "softmax":
        bias = (np.arange(E) % 3 / 8).astype(np.float32)
    p, m, s = K.topk_with_score_function_fwd(x, expert_bias=bias, **kw)
    rp, rm, rs = (host(a) for a in ref.topk_with_score_function_fwd(x, expert_bias=bias, **kw))
    assert (m.sum(-1) == k).all()
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_array_equal(np.isnan(p), np.isnan(rp))
    np.testing.assert_allclose(p, rp, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(s, rs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lanes", FLAT_LANES)
@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
def test_large_k_ties_and_fillers(token_tiling, sf, lanes):
    """K = 20 of E = 32 (a 21-slot register list): bf16-like ties across the
    threshold, a row of one value, fewer than K finite scores; maps exact
    against the reference."""
    K = token_tiling(4, lanes=lanes)
    _assert_lanes(K, lanes, 6, 32, 20, 0, sf != "softmax")
    rng = np.random.default_rng(5)
    T, E, k = 6, 32, 20
    x = (rng.integers(-4, 5, (T, E)) / 4).astype(np.float32)
    x[1] = 0.5
    x[2, :] = -np.inf
    x[2, 3:30:2] = np.arange(14) / 16  # 14 finite < K
    x[4, ::5] = np.nan
    if sf != "softmax":
        x = np.where(np.isneginf(x), np.float32(-30.0), x)
    bias = (np.arange(E) % 4 / 8).astype(np.float32) if sf != "softmax" else None
    kw = dict(topk=k, score_function=sf, scaling_factor=1.5)
    p, m, _ = K.topk_with_score_function_fwd(x, expert_bias=bias, **kw)
    rp, rm, _ = (host(a) for a in ref.topk_with_score_function_fwd(x, expert_bias=bias, **kw))
    assert (m.sum(-1) == k).all()
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(p, rp, atol=1e-6, rtol=1e-5)


SHAPES = [
    (5, 24, 3, 3, 3),
    (5, 20, 2, 5, 1),
    (5, 28, 6, 7, 3),
    (5, 16, 16, -1, -1),
    (5, 8, 1, -1, -1),
    (5, 16, 8, 4, 2),
    (5, 32, 8, 8, 4),
    (5, 20, 3, -1, -1),
    (5, 24, 5, -1, -1),
    (5, 48, 22, -1, -1),  # large K (Nemotron-3 Super's 22): a 23-slot register list
    (5, 64, 24, 8, 4),
    (5, 40, 33, -1, -1),
]


#: the score function each shape runs with in the fast suite (four shapes each: every one meets
#: flat and grouped shapes and a large K); the other two run under ``slow`` (``make test-slow``).
#: The score functions themselves, flat and grouped, on every selection, are run in the fast suite
#: by test_ties_across_the_threshold, test_large_k_ties_and_fillers and test_half_quads.
FAST_SF = {
    (5, 24, 3, 3, 3): "sigmoid",
    (5, 20, 2, 5, 1): "softmax",
    (5, 28, 6, 7, 3): "sqrtsoftplus",
    (5, 16, 16, -1, -1): "sigmoid",
    (5, 8, 1, -1, -1): "sqrtsoftplus",
    (5, 16, 8, 4, 2): "softmax",
    (5, 32, 8, 8, 4): "sigmoid",
    (5, 20, 3, -1, -1): "sqrtsoftplus",
    (5, 24, 5, -1, -1): "softmax",
    (5, 48, 22, -1, -1): "sigmoid",
    (5, 64, 24, 8, 4): "softmax",
    (5, 40, 33, -1, -1): "sqrtsoftplus",
}
SHAPE_CASES = [
    pytest.param(sf, shape, id="{}-T{}E{}K{}G{}Kg{}".format(sf, *shape),
                 marks=() if FAST_SF[shape] == sf else pytest.mark.slow)
    for sf in ("sigmoid", "softmax", "sqrtsoftplus") for shape in SHAPES
]


@pytest.mark.parametrize("lanes", FLAT_LANES)
@pytest.mark.parametrize("sf,shape", SHAPE_CASES)
def test_shapes_fwd_bwd(token_tiling, shape, sf, lanes):
    K = token_tiling(2, lanes=lanes)
    T, E, k, G, Kg = shape
    cfg = _cfg(T, E, k, sf, False, G, Kg, 2.5, sf != "softmax")
    bias = _bias(E, 7) if cfg.has_bias else None
    x = tie_free_rows_np(11, cfg, bias)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(4, x.shape), "float32", cfg.kwargs())


@pytest.mark.parametrize("shape,sf", [((6, 64, 6, -1, -1), "softmax"), ((6, 64, 8, 8, 4), "sigmoid")],
                         ids=["flat", "groups"])
def test_chunk_lanes_at_the_library_min_blocks(library_lane_blocks, shape, sf):
    """A GPU's ``lanes_min_blocks`` (the library's default under the simulator is smaller:
    ``topk/token/tiling.py``): on a tiny T the chunk lanes' tile shrinks to one token a block;
    the forward (and the backward on its saved scores) against the reference."""
    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as _plan
    from gpurouter.kernels.topk.token.tiling import token_lanes

    K = library_lane_blocks
    T, E, k, G, Kg = shape
    cfg = _cfg(T, E, k, sf, False, G, Kg, 2.5, sf != "softmax")
    assert token_lanes(T, E, k, max(G, 0), cfg.has_bias, K.tiling.token)[0] == 2  # the chunk lanes
    plan = K.topk_with_score_function_fwd_plan(_plan.spec_of((T, E), L.F32), cfg.has_bias, k, False, G, Kg,
                                               np.float32(2.5), L.score_function_code(sf, "test"))
    assert _kernel_of(plan) and (plan.steps[0].grid, plan.steps[0].args[10]) == (T, 1)  # T blocks of 1 token
    bias = _bias(E, 3) if cfg.has_bias else None
    x = tie_free_rows_np(12, cfg, bias)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(5, x.shape), "float32", cfg.kwargs())


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_half_quads(token_tiling, sf, pre, dtype):
    """bf16 rows travel as uint64 quads, fp16 element by element: both against the reference."""
    K = token_tiling(2)
    cfg = _cfg(5, 16, 4, sf, pre, 4, 2, 2.5, sf != "softmax", dtype)
    bias = _bias(16, 5) if cfg.has_bias else None
    x = tie_free_rows_np(6, cfg, bias)
    _, m, s = check_topk_fwd(K, x, dtype, cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(8, x.shape, dtype), dtype, cfg.kwargs())


def test_misaligned_word_views_are_refused():
    """A device array the kernels read as wider words (the bool map as uint32
    quads) that does not start on a word boundary is a ValueError, not a
    fault in the kernel."""
    x = cuda.to_device(np.zeros((2, 8), np.float32))
    probs = cuda.device_array((2, 8), np.float32)
    saved = cuda.device_array((2, 8), np.float32)
    rmap = cuda.device_array(17, np.bool_)[1:].reshape(2, 8)
    with pytest.raises(ValueError, match=r"topk_with_score_function_fwd: a device output array .* not a "
                                         r"multiple of 4 bytes"):
        K.topk_with_score_function_fwd(x, 2, out=(probs, rmap, saved))
