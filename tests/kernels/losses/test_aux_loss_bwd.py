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


@pytest.mark.parametrize("dtype,R", [(np.float32, 37), ("bfloat16", 37), ("bfloat16", 299), (np.float16, 37),
                                     (np.float16, 299), (np.float16, 32), (np.float16, 30), (np.float16, 5)])
def test_bwd_masked_quads_eight_rows_a_trip(dtype, R):
    """The masked quad fill, 8 rows a trip. One row lane of one warp a block, 2 blocks,
    so a lane writes rows 2 apart: R = 37: 18-19 rows (2 trips, a tail of 2-3); 299:
    149-150 (18 trips, 5-6); 32: 16 (2 trips, no tail); 30: 15 (1 trip, a tail of 7); 5:
    2-3 (a tail only). bf16 and fp32 stage the block's flags in shared memory first
    (trips of four loads a thread, the last trip partial; R = 299: 150 bytes a lane,
    staged in two trips, 128 + 22), then read 8 shared flags a trip; fp16 loads each
    trip's 8 flags three trips ahead of its stores (``staged_fill``). The valid rows the
    unmasked kernel's bits, the masked ones +0.0 (all bits zero)."""
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    from gpurouter.kernels._base.plan import spec_for
    from gpurouter.kernels.losses.aux_loss_bwd import staged_fill, staged_flag_bytes
    from gpurouter.kernels.losses.tiling import fill_tiling

    tiling = K.AuxLossTiling(fill_blocks=2, fill_threads=32)
    assert fill_tiling(R, 3, tiling) == (2, 32, 32)
    assert staged_flag_bytes(R, 2, 1) == -(-R // 2)
    g_spec = spec_for((), dtype)
    assert staged_fill(g_spec.kind) == (np.dtype(dtype) != np.float16)
    step = K.moe_aux_loss_bwd_plan(spec_for((12,), np.int32), g_spec, R, tiling, True).steps[0]
    assert step.shared == (-(-R // 2) if staged_fill(g_spec.kind) else 0)
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
    quads with 4 row lanes a block (each lane's flags staged at its own offset)."""
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
    if C % 4 == 0:  # 4 row lanes of 32 quad lanes, 2 blocks: 5 staged flags a lane
        assert plan.steps[0].block == 128 and plan.steps[0].shared == B.staged_flag_bytes(37, 2, 4) == 20
        # a block's flags over mask_stage_bytes: more blocks (8 here: 2 flags a lane), the same values
        small = K.AuxLossTiling(fill_blocks=2, mask_stage_bytes=8)
        step = K.moe_aux_loss_bwd_plan(tpe_spec, g_spec, 37, small, True).steps[0]
        assert (step.grid, step.shared) == (8, B.staged_flag_bytes(37, 8, 4)) and step.shared <= 8
        gp8 = K.moe_aux_loss_bwd(np.float32(0.25), tpe, np.float32(2.0), 37, token_mask=mask, tiling=small)
        np.testing.assert_array_equal(gp8, gp)
    assert K.moe_aux_loss_bwd_plan(tpe_spec, g_spec, 37, tiling).steps[0].kernel is factory(tpe_spec.kind,
                                                                                            g_spec.kind)
