"""The lane-an-expert QB histogram (gpurouter/kernels/topk/qb_lanes.py): its
counts bit for bit the reference's (``reference._route.qb_call_counts``) over
garbage outputs and scratch, on the CUDA simulator with tiny shapes (a partial
last chunk of experts, several slabs, masked rows in the unrolled steps and the
tail, bins over two reduce tiles); where ``qb_counts_plan`` takes it; and a
``gpu`` test at T = 3001, E = 384, B = 1000 with the GPU's opt-in shared
memory."""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

import ml_dtypes  # noqa: E402

from gpurouter._ops import qb as op_qb  # noqa: E402
from gpurouter.kernels._base.plan import spec_for  # noqa: E402
from gpurouter.kernels.topk import qb as kqb  # noqa: E402
from gpurouter.kernels.topk import qb_lanes, qb_tiling  # noqa: E402

from .test_qb import _plan_counts_poisoned, _ref  # noqa: E402

#: the lanes on, whatever the simulator's default (off there)
BIG = 1 << 20


@pytest.mark.parametrize("case", ["bf16 masked, 3 slabs", "f32, one slab, 2 bin tiles"])
def test_counts_over_garbage(case):
    """E = 40 (a chunk of 32 experts and one of 8), every bin of the counts and
    of the scratch starting as -7: the counts equal the reference's."""
    rng = np.random.default_rng(21)
    if case.startswith("bf16"):
        T, B, dtype, mask = 23, 5, ml_dtypes.bfloat16, np.arange(23) % 5 != 2
        # one warp a block, rows two at a time: steps of 2 rows, then the tail; slabs of 8, 8, 7 tokens
        tiling = kqb.QbTiling(lanes_smem_bytes=BIG, slab_tokens=8, lanes_target_blocks=6, hist_unroll=2)
    else:
        T, B, dtype, mask = 9, 33, np.float32, None
        tiling = kqb.QbTiling(lanes_smem_bytes=BIG, lanes_target_blocks=2, hist_unroll=4)
    x = (rng.standard_normal((T, 40)) * 2).astype(dtype)
    bias = rng.standard_normal(40) * 0.1
    bounds = [-0.9, 0.8]
    plan, got = _plan_counts_poisoned(x, bias, bounds, B, 3, mask, tiling)
    assert qb_lanes.qb_reduce_lanes_kernel in [st.kernel for st in plan.steps]
    assert plan.steps[1].shared == qb_lanes.lanes_shared_bytes(B)
    want = _ref(x, bias, bounds, B, 3, mask)
    np.testing.assert_array_equal(got.reshape(40, B), want)
    assert (want.sum(axis=1) == (T if mask is None else mask.sum())).all()


def test_lanes_tiling():
    """Where the lanes run: E >= 32, tokens, the bins within the budget; the
    Kimi-K2-like shape on an H100/H200's 227 KiB: 12 chunks x 11 slabs = 132
    blocks of 1024 threads, 128,000 bytes of shared counts each."""
    h200 = qb_tiling.QbTiling(lanes_smem_bytes=232448, lanes_threads=1024)
    grid, threads, shared, chunks, slab, slabs = qb_tiling.lanes_tiling(65536, 384, 1000, h200)
    assert (grid, threads, shared, chunks, slabs) == (132, 1024, 128000, 12, 11)
    assert slab * slabs >= 65536 > slab * (slabs - 1)
    assert qb_tiling.lanes_tiling(65536, 384, 1817, h200) is None  # 232,576 bytes of bins
    assert qb_tiling.lanes_tiling(65536, 16, 1000, h200) is None  # fewer experts than lanes
    assert qb_tiling.lanes_tiling(0, 384, 1000, h200) is None
    assert qb_tiling.lanes_tiling(65536, 384, 1000, qb_tiling.QbTiling(lanes_smem_bytes=0)) is None
    # the plan: the lanes' histogram and reduce (always through the partials), no zeroing
    plan = kqb.qb_counts_plan(spec_for((20, 64), np.float32), True, 3, 7,
                              tiling=kqb.QbTiling(lanes_smem_bytes=BIG, slab_tokens=8))
    kernels = [st.kernel for st in plan.steps]
    assert kernels[-1] is qb_lanes.qb_reduce_lanes_kernel and kqb.qb_zero_kernel not in kernels
    assert plan.steps[-1].args[2:] == (64, 7, 3, 2)  # E, B, slabs, tiles along E
    assert plan.tmps[-1].shape == (3 * 64 * 7,)


def test_tiling_errors():
    with pytest.raises(ValueError, match="lanes_threads"):
        qb_tiling.QbTiling(lanes_threads=48)
    with pytest.raises(ValueError, match="lanes_threads"):
        qb_tiling.QbTiling(lanes_reduce_threads=16)


@pytest.mark.gpu
def test_lanes_on_gpu():
    """On a GPU: T = 3001, E = 384, B = 1000, bf16, every 7th token masked, the
    library's tiling (the lanes, 128,000 bytes of opted-in shared memory a
    block) counts the reference's bits over garbage, through the plan's pointer
    executor and numba's launch alike."""
    from gpurouter.kernels._base.context import optin_shared_bytes

    mode = op_qb.kernel_exp_mode()
    assert mode is not None, "no exp mode matches jax.nn.sigmoid on this GPU"
    if optin_shared_bytes() < qb_lanes.lanes_shared_bytes(1000):
        pytest.skip(f"this GPU opts in to {optin_shared_bytes()} bytes a block, fewer than B = 1000's bins")
    rng = np.random.default_rng(39)
    x = rng.standard_normal((3001, 384)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(384) * 0.05
    bounds = [-1.1, 1.05]
    mask = np.arange(3001) % 7 != 3
    plan, got = _plan_counts_poisoned(x, bias, bounds, 1000, 8, mask, kqb.QB_TILING, mode)  # numba's launch
    assert qb_lanes.qb_reduce_lanes_kernel in [st.kernel for st in plan.steps]
    want = _ref(x, bias, bounds, 1000, 8, mask)
    np.testing.assert_array_equal(got.reshape(384, 1000), want)
    got2 = kqb.qb_counts(x, np.asarray(bias, np.float32), np.asarray(bounds, np.float32), 1000, 8,
                         token_mask=mask, exp_mode=mode)  # plan.execute: the pointer executor
    np.testing.assert_array_equal(got2, want)
