"""Kernel vs reference: ``moe_aux_loss_fwd/_bwd`` (GPU or the CUDA simulator)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.tolerances import assert_close  # noqa: E402

from .._helpers import host  # noqa: E402

pytestmark = pytest.mark.cuda

TPE_DTYPES = {"int32": np.int32, "int64": np.int64, "float32": np.float32,
              "bfloat16": ml_dtypes.bfloat16}


def _inputs(T, C, dtype, tpe_dtype, seed=0):
    rng = np.random.default_rng(seed)
    probs = rng.random((T, C)).astype(np.float32).astype(dtype)
    tpe = rng.integers(0, 64, C).astype(TPE_DTYPES[tpe_dtype])
    return probs, tpe


#: blocks of at least 20 rows (the library's: 64), so that a T of about 50 gives 3 blocks: the
#: forward's row and column lanes, unrolled bodies and tails, at a third of the rows
#: (the simulator runs each of a block's threads; 150 and 130 rows until 2026-11-28)
SMALL_BLOCKS = K.AuxLossTiling(column_min_rows=20)


@pytest.mark.parametrize("dtype,tpe_dtype,T,C,E,total,tiling", [
    (np.float32, "int32", 4, 8, None, None, None),
    (np.float32, "int64", 70, 6, 3, 1000, None),  # sequence aux loss (C = 2E), 2 partial blocks
    (ml_dtypes.bfloat16, "float32", 3, 16, None, 7, None),  # bf16, C % 4 == 0: column quads (uint64 words)
    (ml_dtypes.bfloat16, "int32", 5, 10, None, None, None),  # bf16, C % 4 != 0: elements
    (np.float16, "bfloat16", 2, 5, None, None, None),
    (np.float16, "int32", 9, 12, None, None, None),  # fp16, a quad of columns per store
    # fp32, C % 4 == 0: column quads (74 of them on 96 column lanes, 4 row lanes),
    # 3 blocks of 17, 17, 16 rows (a lane's 4-row unrolled body + its tail; the last
    # block's lanes the body alone)
    (np.float32, "int32", 50, 296, None, None, SMALL_BLOCKS),
    # fp32, C % 4 != 0: elements, two column chunks (256 + 46 columns), 3 blocks
    # of 18, 18, 16 rows, 2 row lanes (the 8-row unrolled body + its tail; the last
    # block's lanes the body alone)
    (np.float32, "int32", 52, 302, None, None, SMALL_BLOCKS),
])
def test_fwd_bwd(dtype, tpe_dtype, T, C, E, total, tiling):
    from gpurouter.kernels.losses.tiling import column_tiling

    if tiling is not None:  # the shapes the comments above describe
        quads = dtype == np.float32 and C % 4 == 0
        grid, threads, cl, rows = column_tiling(T, C // 4 if quads else C, tiling)
        assert (grid, rows, cl, threads // cl) == ((3, 17, 96, 4) if quads else (3, 18, 256, 2))
    probs, tpe = _inputs(T, C, dtype, tpe_dtype)
    loss, coeff = K.moe_aux_loss_fwd(probs, tpe, 2, 0.01, total, E, tiling=tiling)
    rloss, rcoeff = (host(a) for a in ref.moe_aux_loss_fwd(probs, tpe, 2, 0.01, total, E))
    assert loss.shape == coeff.shape == ()
    assert loss.dtype == np.dtype(dtype) and coeff.dtype == np.float32
    # the exact fp32 chain on the host; the reference agrees to an ulp (XLA:GPU's
    # fp32 division is not correctly rounded, so its C may differ in the last bit)
    assert coeff == K.aux_loss_coeff(C if E is None else E, 0.01, 2, T if total is None else total)
    np.testing.assert_allclose(coeff, rcoeff, rtol=3e-7)
    assert_close(loss, rloss, "aux_loss", dtype, err_msg="aux loss")
    g = np.asarray(1.5, dtype)
    gp = K.moe_aux_loss_bwd(coeff, tpe, g, T)
    rgp = host(ref.moe_aux_loss_bwd(rcoeff, tpe, g, T))
    assert gp.shape == (T, C) and gp.dtype == np.dtype(dtype)
    assert_close(gp, rgp, "probs", dtype, err_msg="aux loss grad")


def test_coeff_order():
    # C = f32(E) * f32(coeff) / f32(topk) / f32(T) / f32(T), in that order
    f = np.float32
    want = f(f(f(f(f(64) * f(0.1)) / f(6)) / f(9)) / f(9))
    assert K.aux_loss_coeff(64, 0.1, 6, 9) == want


def test_deterministic():
    # 3 blocks (44, 44, 42 rows) of 4 row lanes x 32 column lanes: 3 partials, added by
    # the last block; run twice (the library's 512-thread blocks, 200 rows and three runs
    # until 2026-11-28: the simulator runs every thread; test_fwd_bwd runs 512-thread blocks)
    tiling = K.AuxLossTiling(column_threads=128)
    probs, tpe = _inputs(130, 40, np.float32, "float32", seed=3)
    first = K.moe_aux_loss_fwd(probs, tpe, 4, 1.0, tiling=tiling)[0]
    again = K.moe_aux_loss_fwd(probs, tpe, 4, 1.0, tiling=tiling)[0]
    assert again.tobytes() == first.tobytes()


def test_device_scalars():
    from numba import cuda

    probs, tpe = _inputs(3, 4, np.float32, "int32")
    loss, coeff = K.moe_aux_loss_fwd(cuda.to_device(probs), cuda.to_device(tpe), 1, 1.0)
    assert hasattr(loss, "copy_to_host") and loss.shape == ()
    hloss, hcoeff = K.moe_aux_loss_fwd(probs, tpe, 1, 1.0)
    assert loss.copy_to_host() == hloss and coeff.copy_to_host() == hcoeff
    two = cuda.to_device(np.asarray(2.0, np.float32))
    gp = K.moe_aux_loss_bwd(coeff, cuda.to_device(tpe), two, 3)
    np.testing.assert_array_equal(gp.copy_to_host(), K.moe_aux_loss_bwd(hcoeff, tpe, 2.0, 3))


def test_out_and_int_stream():
    from numba import cuda

    probs, tpe = _inputs(5, 4, np.float32, "int32")
    s = cuda.stream()
    h = getattr(s, "handle", None)  # the simulator's streams have none
    handle = 12345 if h is None else int(getattr(h, "value", h))
    outs = (cuda.device_array((), np.float32), cuda.device_array((), np.float32))
    loss, coeff = K.moe_aux_loss_fwd(cuda.to_device(probs), tpe, 2, 0.5, out=outs, stream=handle)
    assert loss is outs[0]
    s.synchronize()
    hloss, hcoeff = K.moe_aux_loss_fwd(probs, tpe, 2, 0.5)
    assert outs[0].copy_to_host() == hloss and outs[1].copy_to_host() == hcoeff
    assert coeff.copy_to_host() == hcoeff
    gout = cuda.device_array((5, 4), np.float32)
    assert K.moe_aux_loss_bwd(outs[1], tpe, outs[0], 5, out=gout, stream=handle) is gout
    s.synchronize()
    np.testing.assert_array_equal(gout.copy_to_host(), K.moe_aux_loss_bwd(hcoeff, tpe, hloss, 5))


def test_empty_rows():
    probs, tpe = _inputs(0, 4, np.float32, "int32")
    loss, _ = K.moe_aux_loss_fwd(probs, tpe, 1, 1.0, total_num_tokens=5)
    assert loss == 0.0
    assert K.moe_aux_loss_bwd(np.float32(0.5), tpe, 1.0, 0).shape == (0, 4)


@pytest.mark.parametrize("masked", [False, True])
def test_fwd_fp16_quads_subnormal_probs(masked):
    """fp16 probs with C % 4 == 0 are summed as uint64 quad words
    (``access.f16_quad_load4``): subnormal probs (2^-24 .. 2^-15) count at their
    value, not as zero, against a float64 oracle; masked, the mask's rows alone."""
    rng = np.random.default_rng(3)
    T, C, topk = 6, 8, 2
    probs = (rng.integers(1, 1024, (T, C)) * 2.0 ** -24).astype(np.float16)
    assert np.all(np.abs(probs) < np.finfo(np.float16).smallest_normal)
    tpe = rng.integers(500, 1000, C).astype(np.int32)
    mask = np.array([True, False, True, True, False, True]) if masked else np.ones(T, bool)
    n = int(mask.sum())
    loss, _ = K.moe_aux_loss_fwd(probs, tpe, topk, 1.0, token_mask=mask if masked else None)
    want = C * 1.0 / topk / n / n * (probs[mask].astype(np.float64) * tpe).sum()
    assert loss.dtype == np.float16 and want > 1e-3
    np.testing.assert_allclose(np.float64(loss), want, rtol=1e-3)
