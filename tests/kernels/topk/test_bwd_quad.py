"""The quad backward (``gpurouter/kernels/topk/bwd_quad.py``, E a multiple of 4) of
the top-k and aux-score ops against the reference, several quads per lane
(the ``quad_lanes`` fixture of conftest.py); its BITMAP_U8 map: test_map_format.py.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import random_cotangent, tie_free_rows_np  # noqa: E402

from .._helpers import FWD_MODES, check_topk_bwd, check_topk_fwd, host  # noqa: E402
from .test_plans import _cfg  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_quad_bwd_several_quads_per_lane(quad_lanes, sf, pre, dtype):
    K = quad_lanes
    cfg = _cfg(5, 20, 3, sf, pre, -1, -1, 2.5 if sf != "softmax" else 1.0, False, dtype)
    x = tie_free_rows_np(12, cfg, None)
    _, m, s = check_topk_fwd(K, x, dtype, cfg.kwargs())
    check_topk_bwd(K, m, s, random_cotangent(13, x.shape, dtype), dtype, cfg.kwargs())


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_quad_aux_bwd_several_quads_per_lane(quad_lanes, sf):
    from gpurouter.testing.strategies import np_dtype
    from gpurouter.testing.tolerances import assert_close

    K = quad_lanes
    x = (np.random.default_rng(3).permutation(100).reshape(5, 20) / 16 - 3).astype(np.float32)
    _, _, sv = K.score_for_aux_loss_fwd(x, 3, sf)
    g = random_cotangent(9, x.shape)
    for dtype in ("float32", "bfloat16"):
        dx = K.score_for_aux_loss_bwd(sv, g, sf, np_dtype(dtype))
        rdx = host(ref.score_for_aux_loss_bwd(sv, g, sf, np_dtype(dtype)))
        assert_close(dx, rdx, "grads", np_dtype(dtype), E=20, err_msg=f"aux grad {sf} {dtype}")


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("k", (3, 20))
def test_quad_bwd_sqrtsoftplus_list(quad_lanes, dtype, k):
    """The sqrtsoftplus backward's list of selected experts (``listed``): with
    room for every lane's experts (W = 2 lanes, at most 3 selected per lane at
    K = 3) bit for bit the unlisted kernel; with room for one (most lanes
    overflow; K = E: every expert) or two, still the reference."""
    import dataclasses

    cfg = _cfg(5, 20, k, "sqrtsoftplus", False, -1, -1, 2.5, False, dtype)
    x = tie_free_rows_np(21, cfg, None)
    _, m, s = check_topk_fwd(quad_lanes, x, dtype, cfg.kwargs())
    g = random_cotangent(22, x.shape, dtype)
    out = {}
    for cap in (0, 1, 2, 4):
        listed = quad_lanes.replace(bwd=dataclasses.replace(quad_lanes.tiling.bwd, quad_list=cap))
        out[cap] = check_topk_bwd(listed, m, s, g, dtype, cfg.kwargs())
    if k == 3:
        np.testing.assert_array_equal(host(out[4]).view(np.uint8), host(out[0]).view(np.uint8))


def test_quad_bwd_list_is_for_sqrtsoftplus_top_k():
    with pytest.raises(ValueError, match="listed is for the sqrtsoftplus top-k"):
        K.topk.bwd_quad.quad_bwd_kernel("float32", "float32", True, 0, False, 0, False, 4)
    with pytest.raises(ValueError, match="listed is for the sqrtsoftplus top-k"):
        K.topk.bwd_quad.quad_bwd_kernel("float32", "float32", False, 2, False, 0, False, 4)
