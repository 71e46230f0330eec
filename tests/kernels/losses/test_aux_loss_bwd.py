"""The aux loss's backward kernels (``kernels/losses/aux_loss_bwd.py``) through
``moe_aux_loss_bwd`` (GPU or the CUDA simulator): the grid-strided quad fill
and the element kernel, with and without a token mask."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

pytestmark = pytest.mark.cuda


def test_bwd_grid_strided_rows():
    """The backward's fill with fewer blocks than its rows need: each row lane
    writes several rows, ``grid * RL`` apart (``losses/tiling.fill_tiling``)."""
    from gpurouter.kernels.losses.tiling import fill_tiling

    tiling = K.AuxLossTiling(fill_blocks=2)
    assert fill_tiling(37, 2, tiling) == (2, tiling.fill_threads, 32)
    tpe = np.arange(8, dtype=np.int32)
    gp = K.moe_aux_loss_bwd(np.float32(0.25), tpe, np.float32(2.0), 37, tiling=tiling)
    want = np.broadcast_to(np.float32(0.5) * tpe.astype(np.float32), (37, 8))
    np.testing.assert_array_equal(gp, want)


@pytest.mark.parametrize("dtype,R", [(np.float32, 37), ("bfloat16", 37), ("bfloat16", 299), ("bfloat16", 32),
                                     (np.float16, 30), ("bfloat16", 5)])
def test_bwd_masked_quads_eight_rows_a_trip(dtype, R):
    """The masked quad fill: each thread writes 8 rows a trip, the next trip's 8
    flags loaded before this trip's stores, then the last trip's rows (fewer than
    8). One row lane of one warp a block, 2 blocks, so a lane writes rows 2 apart:
    R = 37: 18-19 rows (2 trips, a tail of 2-3); 299: 149-150 (18 trips, 5-6);
    32: 16 (2 trips, no tail); 30: 15 (1 trip, a tail of 7); 5: 2-3 (a tail only).
    The valid rows the unmasked kernel's bits, the masked ones +0.0 (all bits zero)."""
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    from gpurouter.kernels.losses.tiling import fill_tiling

    tiling = K.AuxLossTiling(fill_blocks=2, fill_threads=32)
    assert fill_tiling(R, 3, tiling) == (2, 32, 32)
    tpe = np.arange(12, dtype=np.int32) + 1
    mask = np.random.default_rng(5).random(R) >= 0.4
    g = np.asarray(2.0, dtype)
    gp = K.moe_aux_loss_bwd(np.float32(0.25), tpe, g, R, token_mask=mask, tiling=tiling)
    want = K.moe_aux_loss_bwd(np.float32(0.25), tpe, g, R, tiling=tiling)
    assert gp.dtype == np.dtype(dtype)
    words = np.uint32 if np.dtype(dtype) == np.float32 else np.uint16
    np.testing.assert_array_equal(gp[mask].view(words), want[mask].view(words))
    assert not gp[~mask].view(words).any() and want[~mask].view(words).all()


@pytest.mark.parametrize("C", [8, 6])  # quads (the grid-strided fill), elements (the column tiling)
def test_bwd_masked_rows_get_zero(C):
    """``has_mask`` builds: the valid rows the unmasked kernel's values, bit for
    bit, the masked rows 0; several blocks (and rows a lane) either way; the
    quads with 4 row lanes a block (each lane its own rows' flags)."""
    from gpurouter.kernels._base.plan import spec_for
    from gpurouter.kernels.losses import aux_loss_bwd as B

    tiling = K.AuxLossTiling(fill_blocks=2, column_threads=64, column_min_rows=8)
    tpe = np.arange(C, dtype=np.int32) + 1
    mask = np.arange(37) % 3 != 1
    gp = K.moe_aux_loss_bwd(np.float32(0.25), tpe, np.float32(2.0), 37, token_mask=mask, tiling=tiling)
    want = K.moe_aux_loss_bwd(np.float32(0.25), tpe, np.float32(2.0), 37, tiling=tiling)
    np.testing.assert_array_equal(gp[mask], want[mask])
    assert not gp[~mask].any()
    tpe_spec, g_spec = spec_for((C,), np.int32), spec_for((), np.float32)
    plan = K.moe_aux_loss_bwd_plan(tpe_spec, g_spec, 37, tiling, True)
    factory = B.aux_loss_bwd_quad_kernel if C % 4 == 0 else B.aux_loss_bwd_kernel
    assert plan.steps[0].kernel is factory(tpe_spec.kind, g_spec.kind, True)
    if C % 4 == 0:  # 4 row lanes of 32 quad lanes, 2 blocks, no shared memory (no staged flags)
        assert (plan.steps[0].grid, plan.steps[0].block, plan.steps[0].shared) == (2, 128, 0)
    assert K.moe_aux_loss_bwd_plan(tpe_spec, g_spec, 37, tiling).steps[0].kernel is factory(tpe_spec.kind,
                                                                                            g_spec.kind)
