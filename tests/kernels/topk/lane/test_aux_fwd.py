"""The W-lane aux-score forward (``gpurouter/kernels/topk/lane/aux_fwd.py``)
against the reference, W forced by the ``tiling`` fixture.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import random_cotangent  # noqa: E402
from gpurouter.testing.tolerances import assert_close  # noqa: E402

from ..._helpers import host  # noqa: E402
from ..test_aux_plans import _check_specials, _tie_free  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("lanes,threads,E,k", [(4, 8, 13, 3), (32, 32, 12, 12), (8, 16, 16, 1)])
def test_lanes(tiling, sf, lanes, threads, E, k):
    K = tiling(lanes, threads)  # partial last tile (3 tokens), E not a multiple of W
    x = _tie_free(3, E, E + 1)
    sc, m, sv = K.score_for_aux_loss_fwd(x, k, sf)
    rsc, rm, rsv = (host(a) for a in ref.score_for_aux_loss_fwd(x, k, sf))
    np.testing.assert_array_equal(m, rm)
    assert_close(sc, rsc, "probs", np.float32, err_msg="aux scores")
    assert_close(sv, rsv, "probs", np.float32, err_msg="aux saved")
    g = random_cotangent(9, x.shape)
    dx = K.score_for_aux_loss_bwd(sv, g, sf)
    rdx = host(ref.score_for_aux_loss_bwd(sv, g, sf))
    assert_close(dx, rdx, "grads", np.float32, E=E, err_msg="aux grad")


def test_lanes_ties_and_specials(tiling):
    K = tiling(4, 8)
    x = np.array([[1.0, 2.0, 2.0, 2.0, 0.0, 2.0, 1.0],
                  [-np.inf, 0.5, -np.inf, 0.5, np.nan, 0.5, 0.5],
                  [-np.inf] * 7], np.float32)
    _check_specials(x, 3, [1, 2, 3], K)
