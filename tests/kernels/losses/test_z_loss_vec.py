"""The z-loss vector kernels (``z_loss_vec.py``) through the z-loss launchers:
their tiling, and tiny shapes forced through several row groups a block, a
partial last group, lanes whose last vectors are past the row, with and
without the prefetch (GPU or the CUDA simulator).  The launchers' semantics
(special rows, NaN, N, outputs and streams) are ``test_z_loss.py``'s, which
runs bf16 and fp32 rows of whole vectors through these kernels too.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402
from numba import float32 as nb_f32  # noqa: E402

from gpurouter.kernels._base import launch as L  # noqa: E402
from gpurouter.kernels._base import plan as _plan  # noqa: E402
from gpurouter.kernels.losses import z_io as io  # noqa: E402
from gpurouter.kernels.losses import z_loss_vec as V  # noqa: E402
from gpurouter.kernels.losses.tiling import Z_LOSS_TILING, ZLossTiling, z_loss_vec_tiling  # noqa: E402

from ._z_helpers import _check, _logits, _lse_of  # noqa: E402

pytestmark = pytest.mark.cuda

BF16 = ml_dtypes.bfloat16


def vec_knobs(threads, hold, blocks, prefetch, hints=False):
    """A ``ZLossTiling`` whose vector kernels, both ways, take these knobs (tiny inputs,
    several groups a block)."""
    knobs = (threads, hold, blocks, prefetch, hints)
    return ZLossTiling(vec_fwd=knobs, vec_bwd=knobs)


def test_vec_tiling():
    # the shape: E = 256 bf16 is 32 vectors, W = 8 lanes of 4, TB = 32 rows a group
    threads, hold, blocks = Z_LOSS_TILING.vec_fwd[:3]
    grid, block, lanes, vecs, held, iters = z_loss_vec_tiling(65536, 256, 2)
    assert (vecs, lanes * held, block) == (32, 32, threads) and held <= hold
    assert grid <= blocks and grid * (block // lanes) * iters >= 65536 > (grid - 1) * (block // lanes) * iters
    assert z_loss_vec_tiling(5, 12, 4) == (1, 5, 1, 3, 3, 1)  # T < TB: 5 rows, one lane of 3
    assert z_loss_vec_tiling(5, 12, 2) is None  # 24 bytes: not whole vectors
    assert z_loss_vec_tiling(0, 256, 2) is None
    too_long = 32 * Z_LOSS_TILING.vec_max_hold * 16 // 2 + 8  # bf16 experts past 32 lanes x vec_max_hold
    assert z_loss_vec_tiling(4, too_long, 2) is None


def test_vec_plans_pick_the_vector_kernels():
    c = np.float32(0.01)
    for kind, E, vector in ((L.BF16, 256, True), (L.F32, 12, True), (L.BF16, 12, False), (L.F16, 256, True),
                           (L.F16, 12, False)):
        spec = _plan.spec_of((9, E), kind)
        fwd, bwd = K.router_z_loss_fwd_plan(spec, c, 9), K.router_z_loss_bwd_plan(spec, c, 9)
        names = (fwd.steps[0].kernel.py_func.__name__, bwd.steps[0].kernel.py_func.__name__)
        assert names == (("z_loss_vec_rows", "z_loss_vec_bwd") if vector else ("z_loss_rows", "z_loss_bwd"))
        assert fwd.tmps == (_plan.Spec((fwd.steps[0].grid,), np.float32, L.F32),)
        if vector:  # one launch: its last block sums the partials, told so by a counter
            assert len(fwd.steps) == 1 and _plan.plan_counters(fwd) == [fwd.steps[0].args[4]]
        else:
            assert fwd.steps[1].args[2] == fwd.steps[0].grid  # the final block sums every partial


@pytest.mark.parametrize("dtype,T,E,knobs,want", [
    # bf16 E=16: 2 vectors, W=2 lanes of 1; TB=4 rows, 3 groups a block, 2 blocks (the last partial)
    (BF16, 19, 16, (8, 1, 2, True), (2, 8, 2, 2, 1, 3)),
    # the same without the prefetch
    (BF16, 19, 16, (8, 1, 2, False), (2, 8, 2, 2, 1, 3)),
    # fp32 E=12: 3 vectors, W=2 lanes of 2 (lane 1's second is past the row); 2 groups a block
    (np.float32, 11, 12, (4, 2, 3, True), (3, 4, 2, 3, 2, 2)),
    # bf16 E=40: 5 vectors, W=4 lanes of 2; one group of 2 rows a block, no loop
    (BF16, 5, 40, (8, 2, 8, True), (3, 8, 4, 5, 2, 1)),
    # bf16 E=64: 8 vectors, exactly W=4 lanes of 2 (the exact kernel), a full warp a block
    # (constant shuffle mask), 3 groups a block (odd: the prefetch's last trip has one group;
    # the second block's last group partial). T small: the simulator runs every thread
    # (74 rows, 5 groups a block, until 2026-11-28)
    (BF16, 45, 64, (32, 2, 2, True), (2, 32, 4, 8, 2, 3)),
    (BF16, 45, 64, (32, 2, 2, False), (2, 32, 4, 8, 2, 3)),
    # loads and stores with cache hints: inline PTX on a GPU only (the simulator's accesses
    # with hints are its word accesses without, the two cases above: z_io.vector_io)
    pytest.param(BF16, 45, 64, (32, 2, 2, True, True), (2, 32, 4, 8, 2, 3), marks=pytest.mark.gpu),
    pytest.param(BF16, 45, 64, (32, 2, 2, False, True), (2, 32, 4, 8, 2, 3), marks=pytest.mark.gpu),
    # fp32 E=32: 8 vectors, exactly W=8 lanes of 1, two warps a block, 2 groups a block (even)
    (np.float32, 30, 32, (64, 1, 2, True), (2, 64, 8, 8, 1, 2)),
    # fp16 as bf16's E=40 and E=64 cases: two halves a word (access.f16_pair_ops), the exact
    # kernel with a full warp, a partial last group
    (np.float16, 5, 40, (8, 2, 8, True), (3, 8, 4, 5, 2, 1)),
    (np.float16, 45, 64, (32, 2, 2, False), (2, 32, 4, 8, 2, 3)),
])
def test_vec_groups(dtype, T, E, knobs, want):
    tiling = vec_knobs(*knobs)
    itemsize = np.dtype(dtype).itemsize
    assert z_loss_vec_tiling(T, E, itemsize, False, tiling) == want == z_loss_vec_tiling(T, E, itemsize, True, tiling)
    x = _logits(T, E, dtype, seed=T + E, masked=0.2)
    x[T // 2] = -np.inf  # a dead row mid-walk: lse 0, no gradient
    x[T - 1, : E // 2] = -np.inf  # half a row -inf, in the last (partial) group
    _, saved, grad = _check(x, total=T + 2, tiling=tiling)
    assert _lse_of(saved)[T // 2] == 0.0 and not np.asarray(grad[T // 2], np.float32).any()


@pytest.mark.parametrize("T,E,threads,hold", [(19, 16, 8, 1), (45, 64, 32, 2)])
def test_vec_same_bits_with_and_without_prefetch(T, E, threads, hold):
    x = _logits(T, E, BF16, seed=4)
    tiling = vec_knobs(threads, hold, 2, True)
    first = K.router_z_loss_fwd(x, 1.0, tiling=tiling)
    again = K.router_z_loss_fwd(x, 1.0, tiling=tiling)
    grad = K.router_z_loss_bwd(x, first[1], 0.5, 1.0, tiling=tiling)
    tiling = vec_knobs(threads, hold, 2, False)
    other = K.router_z_loss_fwd(x, 1.0, tiling=tiling)
    for a, b in ((first, again), (first, other)):
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    assert grad.tobytes() == K.router_z_loss_bwd(x, other[1], 0.5, 1.0, tiling=tiling).tobytes()


def _fixed_order_sum(partial, threads):
    """The single-kernel finish's order: thread i sums partials i, i + n, ...,
    then (whole warps) each warp's 32 in the pairwise tree of lane order and
    the warps in order, or the fixed-shape tree (pairs r, r + ceil(k/2))."""
    red = [np.float32(0)] * threads
    for i, p in enumerate(partial):
        red[i % threads] = np.float32(red[i % threads] + p)
    if threads % 32 == 0:
        total = np.float32(0)
        for w in range(0, threads, 32):
            vals = red[w:w + 32]
            while len(vals) > 1:
                vals = [np.float32(vals[i] + vals[i + 1]) for i in range(0, len(vals), 2)]
            total = np.float32(total + vals[0])
        return total
    k = threads
    while k > 1:
        half = (k + 1) // 2
        for r in range(k - half):
            red[r] = np.float32(red[r] + red[r + half])
        k = half
    return red[0]


@pytest.mark.parametrize("T,E,knobs", [(45, 64, (32, 2, 2, True)), (19, 16, (8, 1, 3, False)),
                                       (40, 16, (4, 1, 16, False))])  # 10 blocks of 4 threads: 2-3 partials a thread
def test_vec_single_kernel_finish(T, E, knobs):
    """The forward's one launch: the loss is the partials summed in the fixed
    order (whatever block is last), the counter is zero again after every
    launch, and launches repeat bit for bit."""
    tiling = vec_knobs(*knobs)
    x = _logits(T, E, BF16, seed=T, masked=0.1)
    c, total = np.float32(0.37), T + 3
    plan = K.router_z_loss_fwd_plan(_plan.spec_of((T, E), L.BF16), c, total, tiling)
    (step,) = plan.steps
    counter = step.args[4]
    assert isinstance(counter, _plan.Counter) and step.grid == plan.tmps[0].shape[0] > 1
    d_x = cuda.to_device(x.view(np.uint16))
    outs = [cuda.device_array(sp.shape, sp.dtype) for sp in plan.outs]
    part = cuda.device_array(plan.tmps[0].shape, np.float32)
    arrays = {"in": [d_x], "out": outs, "tmp": [part]}
    count = _plan.counter_array(counter, 0, _plan.counter_key(0))
    seen = []
    for _ in range(3):
        assert count.copy_to_host().tolist() == [0]
        L.launch(step.kernel, step.grid, step.block, 0, step.shared,
                 *(_plan._resolve(a, arrays, plan.op) for a in step.args))
        seen.append(outs[0].copy_to_host().tobytes())
    assert count.copy_to_host().tolist() == [0] and len(set(seen)) == 1
    want = np.float32(c * np.float32(_fixed_order_sum(part.copy_to_host(), step.block) / np.float32(total)))
    assert seen[0] == np.asarray(want, np.float32).tobytes()
    lse = _lse_of(outs[1].copy_to_host()).astype(np.float64)
    assert abs(float(want) - float(c) * np.sum(lse ** 2) / total) <= 1e-5 * abs(float(want))
    assert K.router_z_loss_fwd(x, float(c), total, tiling=tiling)[0].tobytes() == seen[0]  # the launcher: same bits


def test_word_view():
    assert V.word_view(_plan.spec_of((3, 16), L.BF16)) == _plan.Spec((24,), np.uint32)
    assert V.word_view(_plan.spec_of((3, 16), L.F16)) == _plan.Spec((24,), np.uint32)
    assert V.word_view(_plan.spec_of((3, 12), L.F32)) == _plan.Spec((36,), np.uint32)


@pytest.mark.parametrize("lanes,threads", [(8, 48), (4, 8), (32, 64), (1, 3), (8, 64)])
def test_lane_reducers_fixed_tree(lanes, threads):
    """Every lane of a row gets the row's max and its sum in the pairwise tree
    of lane order (values whose sum depends on the order), also in a block
    ending in a partial warp (GPU: the shfl butterfly; simulator: shared)."""
    all_max, all_sum = io.lane_reducers(lanes, threads % 32 == 0)

    @cuda.jit
    def reduce(x, out_max, out_sum):
        red = cuda.shared.array(0, nb_f32)
        tid = np.int32(cuda.threadIdx.x)
        n = np.int32(cuda.blockDim.x)
        first = np.int32(tid - tid % lanes)
        mask = io.warp_mask(tid, n)
        out_max[tid] = all_max(x[tid], red, tid, first, mask)
        out_sum[tid] = all_sum(x[tid], red, tid, first, mask)

    rng = np.random.default_rng(lanes)
    x = (rng.standard_normal(threads) * 10.0 ** rng.integers(-3, 8, threads)).astype(np.float32)
    d_x, d_max, d_sum = (cuda.to_device(a) for a in (x, np.zeros_like(x), np.zeros_like(x)))
    L.launch(reduce, 1, threads, 0, 4 * threads, d_x, d_max, d_sum)
    got_max, got_sum = d_max.copy_to_host(), d_sum.copy_to_host()
    for r in range(threads // lanes):
        vals = list(x[r * lanes:(r + 1) * lanes])
        while len(vals) > 1:
            vals = [np.float32(vals[i] + vals[i + 1]) for i in range(0, len(vals), 2)]
        row = slice(r * lanes, (r + 1) * lanes)
        assert (got_max[row] == x[row].max()).all()
        assert got_sum[row].tobytes() == np.full(lanes, vals[0], np.float32).tobytes()
