"""The QB kernels' tiling and static checks (gpurouter/kernels/topk/qb_tiling.py):
grids that stay tiny on tiny shapes (the simulator), one wave at the Kimi-K2-like
shape, the shared budget, and the configuration errors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter.kernels._base.plan import spec_for  # noqa: E402
from gpurouter.kernels.topk import qb as kqb  # noqa: E402
from gpurouter.kernels.topk import qb_tiling  # noqa: E402


def test_plan_launches_few_blocks_on_tiny_shapes():
    t = qb_tiling.QB_TILING
    plan = kqb.qb_counts_plan(spec_for((64, 16), np.float32), False, 4, 8)
    # one slab: the cutoff, then the histogram storing every bin into the counts
    assert [st.grid for st in plan.steps] == [-(-64 // (t.cutoff_threads // t.cutoff_lanes)), 1]
    assert len(plan.tmps) == 1
    grouped = kqb.qb_counts_plan(spec_for((64, 16), np.float32), False, 4, 8, 4, 2)
    assert grouped.steps[0].grid == -(-64 // t.cutoff_threads)  # a thread a token
    empty = kqb.qb_counts_plan(spec_for((0, 16), np.float32), True, 4, 8)
    assert [st.kernel for st in empty.steps] == [kqb.qb_zero_kernel]  # only the zeroing


def test_plan_steps_by_slabs_and_budget():
    """Several slabs: cutoff, histogram into ``partial [slabs, E, B]``, the reduce (no
    zeroing: every bin stored); no shared budget: zero, cutoff, global atomics."""
    t = qb_tiling.QbTiling(slab_tokens=8, target_blocks=8)
    plan = kqb.qb_counts_plan(spec_for((20, 12), np.float32), True, 3, 7, tiling=t)
    grid, _, _, _, chunks, _ = qb_tiling.hist_tiling(20, 12, 7, t)
    slabs = grid // chunks
    assert slabs == 3 and [st.kernel for st in plan.steps][-1] is kqb.qb_reduce_kernel
    assert len(plan.steps) == 3 and plan.tmps[1].shape == (slabs * 12 * 7,)
    assert plan.steps[-1].args[2:] == (12 * 7, slabs)
    flat = kqb.qb_counts_plan(spec_for((20, 12), np.float32), True, 3, 7, tiling=qb_tiling.QbTiling(smem_bytes=0))
    assert flat.steps[0].kernel is kqb.qb_zero_kernel and len(flat.steps) == 3 and len(flat.tmps) == 1


def test_hist_tiling_kimi_shape_one_wave():
    """T = 65536, E = 384, B = 1000 on the GPU defaults: 12 experts a block (48 KiB),
    32 chunks x 8 slabs = 256 blocks <= target_blocks."""
    t = qb_tiling.QbTiling(hist_threads=1024, target_blocks=264)
    grid, threads, shared, chunk, chunks, slab = qb_tiling.hist_tiling(65536, 384, 1000, t)
    assert (chunk, chunks, grid, shared) == (12, 32, 256, 48000)
    assert threads % chunk == 0 and slab * (grid // chunks) >= 65536


def test_hist_tiling_no_shared_budget():
    grid, threads, shared, chunk, chunks, slab = qb_tiling.hist_tiling(20, 12, 7, qb_tiling.QbTiling(smem_bytes=0))
    assert shared == 0 and chunk == 12 and chunks == 1
    grid, threads, shared, chunk, chunks, slab = qb_tiling.hist_tiling(20, 12, 100_000)  # a row over 48 KiB
    assert shared == 0


def test_tiling_and_config_errors():
    with pytest.raises(ValueError, match="cutoff_lanes"):
        qb_tiling.QbTiling(cutoff_threads=32, cutoff_lanes=3)
    with pytest.raises(ValueError, match="hist_threads"):
        qb_tiling.QbTiling(hist_threads=0)
    with pytest.raises(ValueError, match="hist_unroll"):
        qb_tiling.QbTiling(hist_unroll=0)
    with pytest.raises(ValueError, match="reduce_threads"):
        qb_tiling.QbTiling(reduce_threads=2048)
    with pytest.raises(ValueError, match="reduce_blocks"):
        qb_tiling.QbTiling(reduce_blocks=0)
    x = np.zeros((4, 8), np.float32)
    bounds = np.array([-1, 1], np.float32)
    with pytest.raises(ValueError, match="topk"):
        kqb.qb_counts(x, np.zeros(8, np.float32), bounds, 4, 8)
    with pytest.raises(ValueError, match="num_bins"):
        kqb.qb_counts(x, np.zeros(8, np.float32), bounds, 0, 2)
    with pytest.raises(ValueError, match="expert_bias"):
        kqb.qb_counts(x, np.zeros(7, np.float32), bounds, 4, 2)
    with pytest.raises(ValueError, match="token_mask"):
        kqb.qb_counts(x, np.zeros(8, np.float32), bounds, 4, 2, token_mask=np.ones(3, bool))
    with pytest.raises(TypeError, match="token_mask"):
        kqb.qb_counts(x, np.zeros(8, np.float32), bounds, 4, 2, token_mask=np.ones(4, np.int32))
    with pytest.raises(ValueError, match="kept groups"):
        kqb.qb_counts(x, np.zeros(8, np.float32), bounds, 4, 2, num_groups=4, group_topk=1, group_score="max")
    with pytest.raises(ValueError, match="group_score"):
        kqb.qb_counts(x, np.zeros(8, np.float32), bounds, 4, 2, num_groups=4, group_topk=2, group_score="min")
