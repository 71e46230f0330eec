"""Kernel vs reference: ``score_for_aux_loss_fwd/_bwd`` (GPU or the CUDA simulator)."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import np_dtype, random_cotangent  # noqa: E402
from gpurouter.testing.tolerances import assert_close  # noqa: E402

from .._helpers import cast, host  # noqa: E402

pytestmark = pytest.mark.cuda


def _tie_free(T, E, seed):
    rng = np.random.default_rng(seed)
    return np.stack([(rng.permutation(E) - E // 2) / 8 for _ in range(T)]).astype(np.float32)


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("dtype,E,k", [("float32", 20, 3), ("bfloat16", 16, 1),
                                       ("float16", 8, 8)])
def test_fwd_bwd(sf, dtype, E, k):
    x = cast(_tie_free(3, E, E), dtype)
    sc, m, sv = K.score_for_aux_loss_fwd(x, k, sf)
    rsc, rm, rsv = (host(a) for a in ref.score_for_aux_loss_fwd(x, k, sf))
    assert sc.dtype == sv.dtype == np.float32 and m.dtype == np.bool_
    assert (m.sum(-1) == k).all()
    np.testing.assert_array_equal(m, rm)
    assert_close(sc, rsc, "probs", np.float32, err_msg="aux scores")
    assert_close(sv, rsv, "probs", np.float32, err_msg="aux saved")
    g = random_cotangent(7, x.shape)
    dx = K.score_for_aux_loss_bwd(sv, g, sf, np_dtype(dtype))
    rdx = host(ref.score_for_aux_loss_bwd(sv, g, sf, np_dtype(dtype)))
    assert_close(dx, rdx, "grads", np_dtype(dtype), E=E, err_msg="aux grad")


def _check_specials(x, k, first_row_selected, kern=K):
    """Ties, -inf, NaN and all -inf rows: map, NaN pattern and scores equal the
    reference's, exactly K per row, ties of row 0 to the lower indices (``kern``:
    ``gpurouter.kernels`` or a tiling fixture's ``Tiled``)."""
    for sf in ("softmax", "sigmoid"):
        sc, m, _ = kern.score_for_aux_loss_fwd(x, k, sf)
        rsc, rm, _ = (host(a) for a in ref.score_for_aux_loss_fwd(x, k, sf))
        assert (m.sum(-1) == k).all()
        np.testing.assert_array_equal(m, rm)
        np.testing.assert_array_equal(np.isnan(sc), np.isnan(rsc))
        np.testing.assert_allclose(sc, rsc, atol=1e-6, rtol=1e-5)
        assert np.flatnonzero(m[0]).tolist() == first_row_selected


def test_ties_and_specials():
    x = np.array([[1.0, 2.0, 2.0, 2.0, 0.0],
                  [-np.inf, 0.5, -np.inf, 0.5, np.nan],
                  [-np.inf] * 5], np.float32)
    _check_specials(x, 2, [1, 2])


def test_empty_tokens():
    sc, m, sv = K.score_for_aux_loss_fwd(np.zeros((0, 4), np.float32), 2)
    assert sc.shape == m.shape == sv.shape == (0, 4)
    assert K.score_for_aux_loss_bwd(sv, sc).shape == (0, 4)
