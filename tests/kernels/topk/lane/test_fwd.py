"""The W-lane top-k forward (``gpurouter/kernels/topk/lane/fwd.py``) against
the reference, W forced by the ``tiling`` fixture (the thread-per-token
kernel switched off): ties across lanes, specials, fillers, partial tiles, E
not a multiple of W, group splits that differ from the lane split, K = E,
K = 1.  Tiny shapes: the simulator runs a thread per lane.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import random_cotangent, tie_free_rows_np  # noqa: E402

from ..._helpers import FWD_MODES, check_special_rows, check_topk_bwd, check_topk_fwd, host  # noqa: E402
from ..._helpers import bias as _bias  # noqa: E402
from ..._helpers import cfg as _cfg  # noqa: E402
from ..._helpers import sel as _sel  # noqa: E402

pytestmark = pytest.mark.cuda


def _both(K, x, k, **kw):
    """Kernel and reference forward on the same logits: (kernel map, probs; ref map, probs)."""
    p, m, s = K.topk_with_score_function_fwd(x, k, **kw)
    rp, rm, rs = (host(a) for a in ref.topk_with_score_function_fwd(x, k, **kw))
    return (p, m, s), (rp, rm, rs)


@pytest.mark.parametrize("lanes", [4, 32])
@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
def test_lanes_ties_across_lanes(tiling, lanes, sf):
    K = tiling(lanes)
    # E = 13 (not a multiple of W); equal values owned by different lanes
    x = np.zeros((3, 13), np.float32)
    x[1] = [1, 2, 2, 0, 2, 2, 1, 0, 2, 2, 1, 2, 0]
    x[2] = [-0.0, 0.0, 0.0, -0.0, -1, -0.0, 3, 3, 0.0, -2, 3, -0.0, 0.0]
    (p, m, _), (rp, rm, _) = _both(K, x, 5, score_function=sf)
    assert _sel(m) == [[0, 1, 2, 3, 4], [1, 2, 4, 5, 8], [0, 1, 6, 7, 10]]
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(p, rp, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lanes,threads", [(4, 8), (32, 32)])
@pytest.mark.parametrize("sf,pre", FWD_MODES)
def test_lanes_specials_fillers_partial_tile(tiling, lanes, threads, sf, pre):
    # threads // lanes tokens per tile: 5 rows leave a partial last tile
    K = tiling(lanes, threads)
    ninf, nan = -np.inf, np.nan
    x = np.array([
        [ninf] * 10,                                               # all -inf
        [ninf, 1.0, ninf, ninf, ninf, ninf, ninf, 2.0, ninf, ninf],  # 2 finite < K: fillers
        [nan, 0.5, 0.25, 0.75, ninf, -1.0, nan, 3.0, 0.5, nan],      # NaN counts as -inf
        [0.5, nan, nan, nan, nan, nan, nan, nan, nan, nan],          # mostly NaN
        [0.1, 0.9, -0.3, 0.7, 0.2, -0.8, 0.4, 0.6, -0.5, 0.3],       # plain
    ], np.float32)
    _, m, s = check_special_rows(K, x, 4, pre, sf, [[0, 1, 2, 3], [0, 1, 2, 7]])
    g = random_cotangent(3, x.shape)
    bk = dict(use_pre_softmax=pre, score_function=sf)
    dx = K.topk_with_score_function_bwd(m, s, g, 4, **bk)
    rdx = host(ref.topk_with_score_function_bwd(m, s, g, 4, **bk))
    # rows whose reference gradient is finite (on NaN rows the reference also
    # spreads NaN to unselected experts, where the kernel writes 0, as before)
    rows = np.isfinite(rdx).all(-1)
    assert rows[[1, 4]].all()
    np.testing.assert_allclose(dx[rows], rdx[rows], atol=1e-5 * np.sqrt(10), rtol=1e-4)


# (lanes, threads, T, E, K, G, Kg): group lanes W/G > 1; G not dividing W
# (one lane per group); G > W (two groups per lane); W > E; K = E; K = 1.
LANE_SHAPES = [
    (8, 16, 3, 16, 4, 4, 2),
    (4, 8, 3, 24, 6, 3, 3),
    (2, 4, 3, 16, 4, 8, 4),
    (16, 16, 2, 8, 3, 2, 1),
    (32, 32, 2, 12, 12, -1, -1),
    (4, 8, 3, 11, 1, -1, -1),
    (8, 16, 3, 16, 16, 4, 4),
]


#: the score function each shape runs with in the fast suite (by turns: both meet groups, K = E
#: and W > E); the other under ``slow`` (``make test-slow``).  Both score functions on both lane
#: counts, specials and fillers, are run in the fast suite by test_lanes_specials_fillers_partial_tile
#: and test_lanes_ties_across_lanes.
SHAPE_CASES = [
    pytest.param(sf, shape, id="{}-W{}n{}T{}E{}K{}G{}Kg{}".format(sf, *shape),
                 marks=() if sf == ("sigmoid", "softmax")[i % 2] else pytest.mark.slow)
    for sf in ("sigmoid", "softmax") for i, shape in enumerate(LANE_SHAPES)
]


@pytest.mark.parametrize("sf,shape", SHAPE_CASES)
def test_lanes_groups_and_extremes(tiling, shape, sf):
    lanes, threads, T, E, k, G, Kg = shape
    K = tiling(lanes, threads)
    cfg = _cfg(T, E, k, sf, False, G, Kg, 2.5, sf != "softmax")
    bias = _bias(E, 7) if cfg.has_bias else None
    x = tie_free_rows_np(11, cfg, bias)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(4, x.shape), "float32", cfg.kwargs())


def test_lanes_group_ties_and_dropped_fillers(tiling):
    K = tiling(8, 16)
    # all equal: the lower groups and experts win
    x = np.zeros((2, 16), np.float32)
    (_, m, _), (_, rm, _) = _both(K, x, 4, num_groups=4, group_topk=2, score_function="sigmoid")
    assert _sel(m) == [[0, 1, 2, 3]] * 2
    np.testing.assert_array_equal(m, rm)
    # group 2 holds the only finite values; groups 0, 1, 3 tie at -inf (row 1:
    # NaN group score, as -inf): groups 0 and 2 kept, the fillers come from
    # group 0 only, never from the dropped groups
    x = np.full((2, 16), -np.inf, np.float32)
    x[:, 8:10] = [1.0, 2.0]
    x[1, 0] = np.nan
    (p, m, _), (rp, rm, _) = _both(K, x, 4, num_groups=4, group_topk=2)
    assert _sel(m) == [[0, 1, 8, 9]] * 2
    np.testing.assert_array_equal(m, rm)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_lanes_half(tiling, dtype):
    K = tiling(4, 8)
    cfg = _cfg(3, 16, 4, "sqrtsoftplus", False, 4, 2, 2.5, True, dtype)
    bias = _bias(16, 5)
    x = tie_free_rows_np(6, cfg, bias)
    _, m, s = check_topk_fwd(K, x, dtype, cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(8, x.shape, dtype), dtype, cfg.kwargs())
