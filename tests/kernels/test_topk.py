"""Kernel vs reference: ``topk_with_score_function_fwd/_bwd`` (GPU or the CUDA simulator).

Tiny shapes (T <= 4, E <= 32): the simulator runs one OS thread per CUDA
thread.  The big TE shapes are in test_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from strategies import (  # noqa: E402
    RouterConfig,
    arbitrary_logits,
    biases,
    random_cotangent,
    router_configs,
    tie_free_logits,
    tie_free_rows_np,
)
from tolerances import assert_close  # noqa: E402

from gpurouter import reference as ref  # noqa: E402

from ._helpers import (  # noqa: E402
    FWD_MODES,
    check_special_rows,
    check_topk_bwd,
    check_topk_fwd,
    host,
)

pytestmark = pytest.mark.cuda

DTYPES = ("float32", "bfloat16", "float16")


def _cfg(T, E, k, sf="softmax", pre=False, G=-1, Kg=-1, scale=1.0, bias=False, dtype="float32"):
    return RouterConfig(num_tokens=T, num_experts=E, topk=k, use_pre_softmax=pre,
                        num_groups=G, group_topk=Kg, scaling_factor=scale,
                        score_function=sf, has_bias=bias, dtype=dtype)


def _bias(E, seed=0):
    return ((np.random.default_rng(seed).integers(-32, 33, E)) / 64).astype(np.float32)


# (T, E, K, G, Kg, scale, bias): plain with E not a multiple of 32, groups,
# K = 1, K = E, scaling.
SHAPES = [
    (3, 20, 3, -1, -1, 1.0, False),
    (4, 16, 4, 4, 2, 2.5, True),
    (2, 12, 1, -1, -1, 1.0, True),
    (2, 6, 6, -1, -1, 0.5, False),
]


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}E{}K{}G{}Kg{}s{}b{}".format(*s))
def test_fwd_bwd_fp32(sf, pre, shape):
    T, E, k, G, Kg, scale, with_bias = shape
    cfg = _cfg(T, E, k, sf, pre, G, Kg, scale, with_bias and sf != "softmax")
    bias = _bias(E) if cfg.has_bias else None
    x = tie_free_rows_np(1, cfg, bias)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(2, x.shape), "float32", cfg.kwargs())


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_fwd_bwd_half(sf, pre, dtype):
    cfg = _cfg(3, 16, 4, sf, pre, 4, 2, 2.5, sf != "softmax", dtype)
    bias = _bias(16, 3) if cfg.has_bias else None
    x = tie_free_rows_np(4, cfg, bias)
    _, m, s = check_topk_fwd(K, x, dtype, cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(5, x.shape, dtype), dtype, cfg.kwargs())


@settings(max_examples=6)
@given(data=st.data())
def test_matches_reference_hypothesis(data):
    cfg = data.draw(router_configs(max_tokens=3, max_experts=24))
    bias = data.draw(biases(cfg))
    x = data.draw(tie_free_logits(cfg, bias))
    _, m, s = check_topk_fwd(K, x, cfg.dtype, cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(0, x.shape, cfg.dtype), cfg.dtype, cfg.kwargs())


# ----------------------------------------------------------------------------
# Ties, -inf, NaN, signed zeros (docs/contract.md section 2: lower index wins; NaN is
# -inf for selection; exactly K per row)
# ----------------------------------------------------------------------------


def _sel(m):
    return [np.flatnonzero(r).tolist() for r in np.asarray(m)]


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_ties_lower_index_wins(sf):
    x = np.zeros((2, 8), np.float32)
    x[1] = [1, 2, 2, 0, 2, 2, 1, 0]
    p, m, _ = K.topk_with_score_function_fwd(x, 3, score_function=sf)
    assert _sel(m) == [[0, 1, 2], [1, 2, 4]]
    rp, rm, _ = ref.topk_with_score_function_fwd(x, 3, score_function=sf)
    np.testing.assert_array_equal(m, host(rm))


def test_group_ties_lower_group_wins():
    # 4 groups of 2, all equal: groups 0 and 1 kept, then experts 0, 1.
    x = np.zeros((1, 8), np.float32)
    _, m, _ = K.topk_with_score_function_fwd(x, 2, num_groups=4, group_topk=2,
                                             score_function="sigmoid")
    assert _sel(m) == [[0, 1]]
    # experts of dropped groups are never selected, even as fillers
    x = np.full((1, 8), -np.inf, np.float32)
    x[0, 6:] = [1.0, 2.0]  # group 3 scores 3; groups 0..2 tie at -inf: group 0 kept
    _, m, _ = K.topk_with_score_function_fwd(x, 4, num_groups=4, group_topk=2)
    assert _sel(m) == [[0, 1, 6, 7]]
    np.testing.assert_array_equal(m, host(ref.topk_with_score_function_fwd(
        x, 4, num_groups=4, group_topk=2)[1]))


def test_signed_zero_ties():
    x = np.array([[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0]], np.float32)
    _, m, _ = K.topk_with_score_function_fwd(x, 1)
    assert _sel(m) == [[0], [0]]


@pytest.mark.parametrize("sf,pre", FWD_MODES)
def test_neg_inf_and_nan_rows(sf, pre):
    ninf, nan = -np.inf, np.nan
    x = np.array([
        [ninf] * 6,                               # all -inf
        [ninf, 1.0, ninf, 2.0, ninf, ninf],       # 2 finite < K: fillers 0, 2
        [nan, 0.5, 0.25, 0.75, ninf, -1.0],       # NaN counts as -inf
        [0.5, nan, nan, nan, nan, nan],           # mostly NaN
    ], np.float32)
    check_special_rows(K, x, 4, pre, sf, [[0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 5]])


@settings(max_examples=4)
@given(data=st.data())
def test_exactly_k_per_row_any_input(data):
    cfg = data.draw(router_configs(max_tokens=3, max_experts=12, dtypes=("float32",)))
    x = data.draw(arbitrary_logits(cfg))
    p, m, s = K.topk_with_score_function_fwd(x, **cfg.kwargs())
    assert (m.sum(-1) == cfg.topk).all()
    assert (p[~m] == 0).all()
    if cfg.grouped:
        size = cfg.num_experts // cfg.num_groups
        groups = m.reshape(m.shape[0], cfg.num_groups, size).any(-1).sum(-1)
        assert (groups <= cfg.group_topk).all()


# ----------------------------------------------------------------------------
# Launcher contract: T == 0, float64, limits, device arrays, out=, streams
# ----------------------------------------------------------------------------


def test_empty_tokens():
    x = np.zeros((0, 8), np.float32)
    p, m, s = K.topk_with_score_function_fwd(x, 2)
    assert p.shape == m.shape == s.shape == (0, 8)
    assert (p.dtype, m.dtype, s.dtype) == (np.float32, np.bool_, np.float32)
    g = K.topk_with_score_function_bwd(m, s, p, 2)
    assert g.shape == (0, 8)


def test_float64_is_rejected():
    with pytest.raises(TypeError, match="float64"):
        K.topk_with_score_function_fwd(np.zeros((2, 4)), 2)


def test_limits():
    with pytest.raises(NotImplementedError, match="kernel limit"):
        K.check_limits("fused_topk_with_score_function", K.MAX_EXPERTS + 1, 1, 1)
    with pytest.raises(NotImplementedError, match="topk"):
        K.check_limits("fused_topk_with_score_function", 128, K.MAX_TOPK + 1, 1)
    with pytest.raises(NotImplementedError, match="num_groups"):
        K.check_limits("fused_topk_with_score_function", 128, 8, K.MAX_GROUPS + 1)


def test_device_arrays_out_and_stream():
    from numba import cuda

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 10)).astype(np.float32)
    hp, hm, hs = K.topk_with_score_function_fwd(x, 3, score_function=1)
    stream = cuda.stream()
    dx = cuda.to_device(x)
    outs = (cuda.device_array((2, 10), np.float32), cuda.device_array((2, 10), np.bool_),
            cuda.device_array((2, 10), np.float32))
    res = K.topk_with_score_function_fwd(dx, 3, score_function=1, out=outs, stream=stream)
    assert all(r is o for r, o in zip(res, outs, strict=True))
    stream.synchronize()
    np.testing.assert_array_equal(outs[0].copy_to_host(), hp)
    np.testing.assert_array_equal(outs[1].copy_to_host(), hm)
    g = K.topk_with_score_function_bwd(outs[1], outs[2], outs[0], 3)  # device in -> device out
    assert hasattr(g, "copy_to_host")
    np.testing.assert_array_equal(g.copy_to_host(), K.topk_with_score_function_bwd(hm, hs, hp, 3))


# ----------------------------------------------------------------------------
# Several lanes per token (W forced): ties across lanes, specials, fillers,
# partial tiles, E not a multiple of W, group splits that differ from the lane
# split, K = E, K = 1.  Tiny shapes: the simulator runs a thread per lane.
# ----------------------------------------------------------------------------


def _both(x, k, **kw):
    """Kernel and reference forward on the same logits: (kernel map, probs; ref map, probs)."""
    p, m, s = K.topk_with_score_function_fwd(x, k, **kw)
    rp, rm, rs = (host(a) for a in ref.topk_with_score_function_fwd(x, k, **kw))
    return (p, m, s), (rp, rm, rs)


@pytest.mark.parametrize("lanes", [4, 32])
@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
def test_lanes_ties_across_lanes(tiling, lanes, sf):
    tiling(lanes)
    # E = 13 (not a multiple of W); equal values owned by different lanes
    x = np.zeros((3, 13), np.float32)
    x[1] = [1, 2, 2, 0, 2, 2, 1, 0, 2, 2, 1, 2, 0]
    x[2] = [-0.0, 0.0, 0.0, -0.0, -1, -0.0, 3, 3, 0.0, -2, 3, -0.0, 0.0]
    (p, m, _), (rp, rm, _) = _both(x, 5, score_function=sf)
    assert _sel(m) == [[0, 1, 2, 3, 4], [1, 2, 4, 5, 8], [0, 1, 6, 7, 10]]
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(p, rp, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lanes,threads", [(4, 8), (32, 32)])
@pytest.mark.parametrize("sf,pre", FWD_MODES)
def test_lanes_specials_fillers_partial_tile(tiling, lanes, threads, sf, pre):
    # threads // lanes tokens per tile: 5 rows leave a partial last tile
    tiling(lanes, threads)
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


@pytest.mark.parametrize("shape", LANE_SHAPES, ids=lambda s: "W{}n{}T{}E{}K{}G{}Kg{}".format(*s))
@pytest.mark.parametrize("sf", ["sigmoid", "softmax"])
def test_lanes_groups_and_extremes(tiling, shape, sf):
    lanes, threads, T, E, k, G, Kg = shape
    tiling(lanes, threads)
    cfg = _cfg(T, E, k, sf, False, G, Kg, 2.5, sf != "softmax")
    bias = _bias(E, 7) if cfg.has_bias else None
    x = tie_free_rows_np(11, cfg, bias)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(4, x.shape), "float32", cfg.kwargs())


def test_lanes_group_ties_and_dropped_fillers(tiling):
    tiling(8, 16)
    # all equal: the lower groups and experts win
    x = np.zeros((2, 16), np.float32)
    (_, m, _), (_, rm, _) = _both(x, 4, num_groups=4, group_topk=2, score_function="sigmoid")
    assert _sel(m) == [[0, 1, 2, 3]] * 2
    np.testing.assert_array_equal(m, rm)
    # group 2 holds the only finite values; groups 0, 1, 3 tie at -inf (row 1:
    # NaN group score, as -inf): groups 0 and 2 kept, the fillers come from
    # group 0 only, never from the dropped groups
    x = np.full((2, 16), -np.inf, np.float32)
    x[:, 8:10] = [1.0, 2.0]
    x[1, 0] = np.nan
    (p, m, _), (rp, rm, _) = _both(x, 4, num_groups=4, group_topk=2)
    assert _sel(m) == [[0, 1, 8, 9]] * 2
    np.testing.assert_array_equal(m, rm)


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_lanes_half(tiling, dtype):
    tiling(4, 8)
    cfg = _cfg(3, 16, 4, "sqrtsoftplus", False, 4, 2, 2.5, True, dtype)
    bias = _bias(16, 5)
    x = tie_free_rows_np(6, cfg, bias)
    _, m, s = check_topk_fwd(K, x, dtype, cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(8, x.shape, dtype), dtype, cfg.kwargs())


def test_layouts_fit_shared_memory():
    """Every valid config up to the limits fits the 48 KiB budget (pure host code)."""
    from gpurouter.kernels import _launch as L
    from gpurouter.kernels._limits import SMEM_BUDGET

    for E in (1, 8, 20, 128, 256, 1000, 1024, 4096, 8192):
        for k in (1, 8, 64):
            if k > E:
                continue
            for G in (0, 8, 64):
                if G > E:
                    continue
                lay = L.select_layout(65536, E, k, G)
                assert lay.shared <= SMEM_BUDGET, (E, k, G, lay)
                assert lay.threads == lay.tb * lay.lanes and lay.lanes & (lay.lanes - 1) == 0
                assert lay.o_flag >= 4 * (lay.o_keep + lay.tb * G)
    lay = L.select_layout(65536, 256, 8, 8)
    assert (lay.lanes, lay.tb, lay.group_lanes) == (8, 16, 1)  # DeepSeek-V3
    assert L.row_stride(256, 8) % 32 == 8  # P / W odd: conflict-free lane scans


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("T,E,k", [(11, 40, 5), (37, 6, 2)])
def test_streaming_bwd_lanes_and_partial_blocks(sf, pre, T, E, k):
    """The streaming backwards: E=40 -> a warp per token, lanes wrapping past
    E, 8 tokens per block (a partial second block); E=6 -> 8 lanes per token,
    two of them idle, 32 tokens per block (a partial second block)."""
    from gpurouter.kernels import _launch as L

    grid, threads, lanes = L.stream_tiling(T, E)
    assert grid == 2 and threads % lanes == 0
    cfg = _cfg(T, E, k, sf, pre)
    x = tie_free_rows_np(8, cfg)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs())
    check_topk_bwd(K, m, s, random_cotangent(9, x.shape), "float32", cfg.kwargs())
    _, _, sv = K.score_for_aux_loss_fwd(x, k, sf)
    g = random_cotangent(10, x.shape)
    assert_close(K.score_for_aux_loss_bwd(sv, g, sf),
                 host(ref.score_for_aux_loss_bwd(sv, g, sf)), "grads", np.float32, E=E)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(topk=9), "topk_with_score_function_fwd: topk (9) must be <= num_experts (8)."),
    (dict(topk=2, num_groups=3, group_topk=1), "topk_with_score_function_fwd: num_experts (8) must be divisible "
                                               "by num_groups (3)."),
    (dict(topk=2, scaling_factor=float("inf")), "topk_with_score_function_fwd: scaling_factor (inf) must be finite."),
    (dict(topk=2, expert_bias=np.zeros(8, np.float32)), "topk_with_score_function_fwd: expert_bias (shape (8,)) "
                                                        "must be None with score_function ('softmax')"),
])
def test_launcher_config_errors_are_the_checks_module_s(kwargs, msg):
    """The kernel launchers apply the rules of gpurouter._checks (written once)."""
    import re

    with pytest.raises((ValueError, TypeError), match="^" + re.escape(msg)):
        K.topk_with_score_function_fwd(np.zeros((2, 8), np.float32), **kwargs)
    if "topk" in kwargs and len(kwargs) == 1:
        with pytest.raises(ValueError, match=re.escape("score_for_aux_loss_fwd: topk (9) must be <= num_experts (8).")):
            K.score_for_aux_loss_fwd(np.zeros((2, 8), np.float32), 9)
