"""The thread-per-token aux-score forward (``gpurouter/kernels/topk/token/aux_fwd.py``)
against the reference: infinite rows, ties across the threshold, every score
function in fp32 and bf16, several blocks with a partial last tile.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")


from gpurouter import reference as ref  # noqa: E402

from ..._helpers import host  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_infinite_rows(token_tiling, sf):
    """+inf logits: sqrtsoftplus makes the row's sum inf, so every score is 0
    or NaN (inf / inf); softmax gives NaN at the infs; the map is the
    reference's (NaN as -inf, ties to the lower index)."""
    K = token_tiling(2)
    x = np.zeros((4, 8), np.float32)
    x[0] = [np.inf, np.inf, np.inf, np.inf, np.inf, np.inf, 1.0, 2.0]  # more infs than K
    x[1] = [0.5, np.inf, -1.0, 3.0, 0.25, np.inf, 2.0, -2.0]
    x[2] = [np.inf] * 8
    x[3] = np.arange(8) / 4
    sc, m, sv = K.score_for_aux_loss_fwd(x, 5, sf)
    rsc, rm, rsv = (host(a) for a in ref.score_for_aux_loss_fwd(x, 5, sf))
    assert (m.sum(-1) == 5).all()
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_array_equal(np.isnan(sc), np.isnan(rsc))
    np.testing.assert_allclose(sc, rsc, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_ties_across_the_threshold(token_tiling, sf):
    K = token_tiling(4)
    rng = np.random.default_rng(22)
    x = (rng.integers(-4, 5, (9, 16)) / 4).astype(np.float32)
    x[2] = rng.permutation(16) / 8
    x[4] = 0.5
    sc, m, sv = K.score_for_aux_loss_fwd(x, 5, sf)
    rsc, rm, rsv = (host(a) for a in ref.score_for_aux_loss_fwd(x, 5, sf))
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(sc, rsc, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(sv, rsv, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_aux_scores(token_tiling, sf, dtype):
    K = token_tiling(2)
    ninf, nan = -np.inf, np.nan
    x = np.array([
        [1.0, 2.0, 2.0, 2.0, 0.0, -1.0, 0.5, 2.0],  # ties: the lower indices
        [ninf, 0.5, ninf, 0.5, nan, ninf, 0.25, ninf],
        [ninf] * 8,
        [0.3, -0.2, 0.9, 0.1, -0.7, 0.4, 0.6, -0.1],
        [nan] * 8,
    ], np.float32)
    if sf != "softmax":
        x = np.where(np.isneginf(x), np.float32(-30.0), x)
    x = x.astype(np.dtype(dtype) if dtype == "float32" else __import__("ml_dtypes").bfloat16)
    sc, m, sv = K.score_for_aux_loss_fwd(x, 3, sf)
    rsc, rm, rsv = (host(a) for a in ref.score_for_aux_loss_fwd(x, 3, sf))
    assert (m.sum(-1) == 3).all()
    np.testing.assert_array_equal(m, rm)
    assert np.flatnonzero(m[0]).tolist() == [1, 2, 3]
    np.testing.assert_array_equal(np.isnan(sc), np.isnan(rsc))
    np.testing.assert_allclose(sc, rsc, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(sv, rsv, atol=1e-6, rtol=1e-5)
