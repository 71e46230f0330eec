"""The warp-per-token top-k backward (``gpurouter/kernels/topk/warp/bwd.py``): the
dispatch to it, its gradients against the reference (from the forward's own saved
state) and against a float64 oracle (any map a caller passes: more than K experts,
none, a lane's every expert), both map formats with the same bits, the special
values, the grid-strided token loop.  Tiny shapes: the simulator runs them (a block
of one warp there; four on a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter.kernels._base import launch as L  # noqa: E402
from gpurouter.kernels._base import plan as _plan  # noqa: E402
from gpurouter.kernels.topk import bwd_plans  # noqa: E402
from gpurouter.kernels.topk.warp import bwd as warp_topk_bwd  # noqa: E402
from gpurouter.kernels.topk.warp.lanes import warp_auto  # noqa: E402
from gpurouter.testing.strategies import np_dtype  # noqa: E402
from gpurouter.testing.tolerances import assert_close  # noqa: E402

from ..._helpers import cast, check_topk_bwd, host  # noqa: E402

pytestmark = pytest.mark.cuda

SF = ("sigmoid", "sqrtsoftplus", "softmax")


def _module_of(plan):
    return plan.steps[0].kernel.py_func.__module__.removeprefix("gpurouter.kernels.topk.")  # e.g. "warp.fwd"


def _bwd(m, s, g, k, sf, path="warp", scale=1.0, tiling=None):
    return host(K.topk_with_score_function_bwd(m, s, g, k, scaling_factor=scale, score_function=sf, path=path,
                                               tiling=tiling))


def _oracle(m, s, g, k, sf, scale):
    """The VJP (docs/contract.md section 3) in float64 from the saved scores, any map."""
    m = np.asarray(m, bool)
    s = np.asarray(s, np.float64)
    g = np.asarray(g, np.float32).astype(np.float64) * scale
    if sf == "softmax":  # saved: the probs over the selected
        d = np.sum(np.where(m, g * s, 0), -1, keepdims=True)
        return np.where(m, s * (g - d), 0)
    if sf == "sigmoid":
        a, da = s, s * (1 - s)
    else:
        sp = np.where(s > 20, s, np.log1p(np.exp(np.minimum(s, 20))))
        a = np.sqrt(sp)
        da = np.where(s > 20, 1.0, 1 / (1 + np.exp(-s))) / (2 * a + 1e-20)
    if k > 1:
        S = np.sum(np.where(m, a, 0), -1, keepdims=True) + 1e-20
        D = np.sum(np.where(m, g * a, 0), -1, keepdims=True)
        g = g / S - D / S**2
    return np.where(m, g * da, 0)


def test_dispatch():
    """A map outside softmax-pre, E % 128 == 0 up to 512 takes the warp kernel
    (``path="auto"`` on a GPU only); other shapes and ``path="quad"`` the quad or
    streaming kernels; a bad ``path`` names the op and the argument."""

    def plan(E, fn=L.SIGMOID, pre=False, path="auto", T=5):
        return bwd_plans.topk_with_score_function_bwd_plan(_plan.spec_of((T, E), L.BF16), 8, pre, np.float32(1), fn,
                                                      0, path)

    auto = "bwd_quad" if L.simulator_enabled() else "warp.bwd"  # (never on the simulator)
    for E, fn in ((128, L.SIGMOID), (256, L.SQRTSOFTPLUS), (384, L.SOFTMAX), (512, L.SIGMOID)):
        assert _module_of(plan(E, fn)) == auto
        assert _module_of(plan(E, fn, path="warp")) == "warp.bwd"
        assert _module_of(plan(E, fn, path="quad")) == "bwd_quad"
    assert warp_auto(simulator=False) and not warp_auto(simulator=True)  # the forward's rule too
    for E, fn, pre in ((256, L.SOFTMAX, True), (640, L.SIGMOID, False), (260, L.SIGMOID, False),
                       (64, L.SIGMOID, False)):
        assert _module_of(plan(E, fn, pre)) in ("bwd_quad", "bwd_stream")
        with pytest.raises(ValueError, match="topk_with_score_function_bwd: path='warp' needs"):
            plan(E, fn, pre, path="warp")
    assert _module_of(plan(130, path="quad")) == "bwd_stream"
    with pytest.raises(ValueError, match="topk_with_score_function_bwd: path must be"):
        plan(256, path="token")
    with pytest.raises(ValueError, match="path must be"):  # an empty batch too
        plan(256, path="fast", T=0)


# Several quads a lane (E = 256, 384: an odd count, 512 with K = 22; ~3, ~5 and ~10 s each on the
# simulator): sqrtsoftplus (the longest walk) in the fast suite, sigmoid and softmax under slow;
# E = 128 runs every score function (K = 1 and K > 1), and E = 512 with every score function stays
# in the fast suite in test_any_map_float16_and_both_formats (a lane's 16 experts, many experts, fp16).
CASES = [pytest.param(sf, E, k, marks=pytest.mark.slow if E >= 256 and sf != "sqrtsoftplus" else ())
         for sf in SF for E, k in ((128, 1), (128, 6), (256, 8), (384, 8), (512, 22))]


@pytest.mark.parametrize("sf,E,k", CASES)
def test_against_reference(E, k, sf):
    """Gradients of the forward's own state, fp32 and bf16, a scale, K = 1 (no
    normalisation) and K > 1; the quad kernel on the same inputs agrees too."""
    rng = np.random.default_rng(E + k)
    x = rng.standard_normal((2, E)).astype(np.float32)
    for dtype in ("float32", "bfloat16"):
        kw = dict(topk=k, score_function=sf, scaling_factor=2.5 if sf != "softmax" else 1.0)
        _, m, s = K.topk_with_score_function_fwd(cast(x, dtype), **kw)
        g = cast(rng.standard_normal(x.shape), dtype)
        dx = _bwd(m, s, g, k, sf, scale=kw["scaling_factor"])
        want = check_topk_bwd(K, m, s, g, dtype, kw)  # the default path against the reference
        assert_close(dx, host(want), "grads", np_dtype(dtype), E=E, err_msg=f"warp vs default {kw} {dtype}")
        assert_close(dx, _oracle(m, s, g, k, sf, kw["scaling_factor"]), "grads", np_dtype(dtype), E=E,
                     check_dtype=False, err_msg=f"warp vs oracle {kw} {dtype}")


@pytest.mark.parametrize("sf", SF)
def test_any_map_float16_and_both_formats(sf):
    """Maps a caller passes: a lane's every expert (16 at E = 512: the sqrtsoftplus
    loop's longest walk), no expert (zeros), many experts; fp16 gradients; the
    BITMAP_U8 map gives the same bits."""
    E = 512
    rng = np.random.default_rng(7)
    m = np.zeros((4, E), bool)
    m[0, [4 * 3 + i + 128 * q for q in range(4) for i in range(4)]] = True  # lane 3's 16 experts
    m[2] = rng.random(E) < 0.3
    m[3, [0, 1, 2, 511]] = True
    s = (rng.random((4, E)) * 0.9 + 0.05).astype(np.float32) if sf != "sqrtsoftplus" else \
        rng.standard_normal((4, E)).astype(np.float32) * 4
    g = rng.standard_normal((4, E)).astype(np.float16)
    dx = _bwd(m, s, g, 3, sf, scale=1.5)
    assert dx.dtype == np.float16
    assert not dx[1].any()
    assert_close(dx, _oracle(m, s, g, 3, sf, 1.5), "grads", np.float16, E=E, check_dtype=False,
                 err_msg=f"oracle {sf}")
    packed = np.packbits(m, axis=-1, bitorder="little")
    assert _bwd(packed, s, g, 3, sf, scale=1.5).tobytes() == dx.tobytes()
    assert _bwd(m, s, g, 3, sf, scale=1.5).tobytes() == dx.tobytes()  # the same bits every run


@pytest.mark.parametrize("sf", ("sigmoid", "sqrtsoftplus"))
def test_special_values(sf):
    """A NaN saved score at a selected expert makes the token's selected gradients
    NaN (as the reference); at an unselected one it is never read; +inf gradients
    reach only the selected experts."""
    E = 128
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, E)).astype(np.float32)
    _, m, s = K.topk_with_score_function_fwd(x, 4, score_function=sf)
    s = s.copy()
    sel0 = np.flatnonzero(m[0])
    s[0, sel0[1]] = np.nan
    s[1, np.flatnonzero(~m[1])[:5]] = np.nan
    g = rng.standard_normal((3, E)).astype(np.float32)
    g[2, np.flatnonzero(m[2])[0]] = np.inf
    dx = _bwd(m, s, g, 4, sf)
    want = host(K.topk_with_score_function_bwd(m, s, g, 4, score_function=sf, path="quad"))
    np.testing.assert_array_equal(np.isnan(dx), np.isnan(want))
    assert np.isnan(dx[0, sel0]).all() and not np.isnan(dx[0, ~m[0]]).any() and not dx[0, ~m[0]].any()
    assert np.isfinite(dx[1]).all()
    assert not dx[2, ~m[2]].any()
    ok = ~np.isnan(want)
    assert_close(dx[ok], want[ok], "grads", np.float32, E=E, err_msg=sf)


def test_grid_strided_tokens():
    """Fewer blocks than tokens: each block walks the token loop (a partial last trip;
    two blocks of four warps on a GPU, of one on the simulator), each token's map words
    loaded the trip before."""
    tiling = K.TopkTiling(bwd=K.BwdTiling(warp_max_blocks=2))
    warps = warp_topk_bwd.warp_bwd_launch(1)[1] // 32  # tokens a block a trip
    T = 2 * 2 * warps + 1  # three trips, the last one partial (13 tokens until 2026-11-28)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, 256)).astype(np.float32)
    _, m, s = K.topk_with_score_function_fwd(x, 6, score_function="sqrtsoftplus")
    g = rng.standard_normal(x.shape).astype(np.float32)
    assert bwd_plans.topk_with_score_function_bwd_plan(_plan.spec_of(x.shape, L.F32), 6, False, np.float32(1),
                                                  L.SQRTSOFTPLUS, 0, "warp", tiling).steps[0].grid == 2
    dx = _bwd(m, s, g, 6, "sqrtsoftplus", tiling=tiling)
    assert_close(dx, _oracle(m, s, g, 6, "sqrtsoftplus", 1.0), "grads", np.float32, E=256,
                 check_dtype=False, err_msg="strided")


def test_kernel_takes_only_its_shapes():
    with pytest.raises(ValueError, match="warp_topk_bwd_kernel: E must be a multiple of 128"):
        warp_topk_bwd.warp_topk_bwd_kernel(L.F32, 192, L.SIGMOID)
