"""Kernel vs float64 oracle: the grouped dbias / dscales launchers
(``gpurouter/kernels/moe/grouped_bias.py``), on the CUDA simulator at tiny
shapes with the tiling forced small (several chunks, groups spanning many
chunks, several column blocks), and on a GPU at a real shape (``gpu``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpurouter.testing import moe_oracle as orc

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda, float32  # noqa: E402  (module level: the simulator swaps a kernel's globals)

from gpurouter.kernels._base.launch import launch  # noqa: E402
from gpurouter.kernels.moe import grouped_bias as M  # noqa: E402
from gpurouter.kernels.moe.rows import lane_tree_sums  # noqa: E402

pytestmark = pytest.mark.cuda

BF16 = ml_dtypes.bfloat16


def small_tiles(rows=4, lanes=2, hold=2, batch=None):
    """A ``DbiasTiling`` of chunks of ``rows`` (with and without scales), at most ``lanes``
    lanes per block, ``hold`` partial rows per load batch of kernel 2 and, if given,
    ``batch`` rows per load batch of kernel 1."""
    knobs = {} if batch is None else dict(hold_rows=batch, hold_rows_dbias=batch)
    return M.DbiasTiling(chunk_rows=rows, chunk_rows_dbias=rows, max_lanes=lanes, group_hold=hold, **knobs)


def _case(rng, n, h, offsets, dtype):
    g = len(offsets) - 1
    dy = rng.standard_normal((n, h)).astype(np.float32)
    for i in range(n):  # rows no group owns hold NaN: nothing may read them
        if i < max(offsets[0], 0) or i >= offsets[-1]:
            dy[i] = np.nan
    return (dy.astype(dtype), rng.standard_normal(n).astype(dtype), rng.standard_normal((g, h)).astype(dtype),
            np.asarray(offsets, np.int32))


def _f32(a):
    return np.asarray(a).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("n,h,offsets", [
    (23, 8, [2, 3, 3, 17, 21]),   # quads, a group over four chunks, an empty one, head and tail rows
    (23, 6, [0, 23]),             # one group over every chunk, H % 4 != 0
    (9, 20, [0, 0, 0, 9]),        # empty groups first; H = 20: 5 units, 2 column blocks
    (5, 3, [0, 5, 5, 5]),         # one chunk... and empty groups after
])
def test_launchers_vs_oracle(dtype, n, h, offsets):
    tiling = small_tiles()
    rng = np.random.default_rng(n * h)
    dy, s, b, o = _case(rng, n, h, offsets, dtype)
    db_in = rng.standard_normal(b.shape).astype(np.float32)
    ds_in = rng.standard_normal(n).astype(np.float32)
    want_db, want_ds = orc.grouped_dbias_dscales(np.nan_to_num(_f32(dy)), _f32(s), _f32(b), o)
    db, ds = K.grouped_dbias_dscales(dy, s, b, o, tiling=tiling)
    assert db.dtype == np.float32 and ds.dtype == np.float32
    np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-5 * np.sqrt(n))
    np.testing.assert_allclose(ds, want_ds, rtol=1e-5, atol=1e-5 * np.sqrt(h))
    owned = [i for i in range(n) if o[0] <= i < o[-1]]
    assert all(ds[i] == 0 for i in range(n) if i not in owned)  # exactly 0, NaN never read
    for g in range(len(offsets) - 1):
        if o[g] == o[g + 1]:
            assert not db[g].any()  # an empty group: exactly 0
    # accumulators: added to, one fp32 add (the reference's order)
    db2, ds2 = K.grouped_dbias_dscales(dy, s, b, o, db_in, ds_in, tiling=tiling)
    np.testing.assert_array_equal(db2, db + db_in)
    np.testing.assert_array_equal(ds2, ds + ds_in)
    # without scales: the same kernels
    np.testing.assert_allclose(K.grouped_dbias(dy, o, tiling=tiling),
                               orc.grouped_dbias(np.nan_to_num(_f32(dy)), o, len(o) - 1),
                               rtol=1e-5, atol=1e-5 * np.sqrt(n))
    np.testing.assert_array_equal(K.grouped_dbias(dy, o, db_in, tiling=tiling),
                                  K.grouped_dbias(dy, o, tiling=tiling) + db_in)


@pytest.mark.parametrize("rows,lanes,batch,n,h,offsets", [
    (5, 1, 2, 19, 16, [1, 2, 2, 9, 10, 18]),  # bf16 units of 8 columns, 2 column blocks; chunks of 5 rows in
                                              # batches of 2 (the last batch half past the chunk); groups
                                              # changing mid-batch, one row long, empty; head and tail rows
    (7, 2, 3, 30, 24, [0, 4, 5, 29]),         # 3 units over 2 lanes (one idle); a group over 4 chunks
    (8, 4, 8, 8, 40, [0, 3, 8]),              # one chunk, one batch; 5 units, 2 column blocks of 4 lanes
    (6, 64, 4, 15, 320, [0, 5, 6, 14]),       # 40 units over 64 lanes: two warps (the second part idle),
                                              # each summing its lanes' dots, then the warps in order
])
def test_row_units_batches_and_column_blocks(rows, lanes, batch, n, h, offsets):
    """Kernel 1's tiling edges at bf16 (16-byte units of eight columns): load
    batches that cross group and chunk ends, a chunk not a multiple of the batch,
    lanes past the row's units, several column blocks."""
    tiling = small_tiles(rows=rows, lanes=lanes, hold=2, batch=batch)
    rng = np.random.default_rng(n + h)
    dy, s, b, o = _case(rng, n, h, offsets, BF16)
    want_db, want_ds = orc.grouped_dbias_dscales(np.nan_to_num(_f32(dy)), _f32(s), _f32(b), o)
    db, ds = K.grouped_dbias_dscales(dy, s, b, o, tiling=tiling)
    np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-5 * np.sqrt(n))
    np.testing.assert_allclose(ds, want_ds, rtol=1e-5, atol=1e-5 * np.sqrt(h))
    assert all(ds[i] == 0 for i in range(n) if not o[0] <= i < o[-1])
    # an fp32 bias with a bf16 dy: the bias read as two fp32 quads per unit
    db32, ds32 = K.grouped_dbias_dscales(dy, s, _f32(b), o, tiling=tiling)
    np.testing.assert_array_equal(db32, db)
    np.testing.assert_array_equal(ds32, ds)
    np.testing.assert_allclose(K.grouped_dbias(dy, o, tiling=tiling),
                               orc.grouped_dbias(np.nan_to_num(_f32(dy)), o, len(o) - 1),
                               rtol=1e-5, atol=1e-5 * np.sqrt(n))  # the no-scales kernel, same tiles


def _tree_order(part):
    """NumPy float32 emulation of ``moe/rows.lane_tree_sums``' order: per warp
    (``min(W, 32)`` lanes) a butterfly, lanes paired by their highest bit first,
    then the warps in order.  ``part [W, hold]`` -> ``[hold]``."""
    lanes, hold = part.shape
    wl = min(lanes, 32)
    out = np.zeros(hold, np.float32)
    for k in range(hold):
        for w in range(lanes // wl):
            v = part[w * wl:(w + 1) * wl, k].astype(np.float32).copy()
            span = wl // 2
            while span:
                v[:span] = v[:span] + v[span:2 * span]
                span //= 2
            out[k] = v[0] if w == 0 else np.float32(out[k] + v[0])
    return out


@pytest.mark.parametrize("hold,lanes", [(1, 1), (3, 1), (8, 2), (2, 4), (3, 8), (8, 32), (8, 64), (4, 96), (40, 64)])
def test_lane_tree_sums_fixed_order(hold, lanes):
    """``lane_tree_sums`` gives the bits of its documented tree (warp shuffles on
    a GPU, shared memory on the simulator), for two calls in a row (the two
    halves of ``red``)."""
    publish, total, words = lane_tree_sums(hold, lanes)

    @cuda.jit
    def probe_lane_tree_sums(parts, out):  # parts [2, W, hold], out [2, hold]
        red = cuda.shared.array(words, float32)
        mine = cuda.local.array(hold, float32)
        lane = cuda.threadIdx.x
        for call in range(2):
            for k in range(hold):
                mine[k] = parts[call, lane, k]
            publish(red, mine, lane, call)
            for k in range(lane, hold, lanes):
                out[call, k] = total(red, k, call)

    rng = np.random.default_rng(hold * lanes)
    parts = (rng.standard_normal((2, lanes, hold)) * 10.0 ** rng.integers(-3, 4, (2, lanes, hold))).astype(np.float32)
    out = cuda.to_device(np.full((2, hold), np.nan, np.float32))
    launch(probe_lane_tree_sums, 1, lanes, 0, 0, cuda.to_device(parts), out)
    got = out.copy_to_host()
    for call in range(2):
        np.testing.assert_array_equal(got[call], _tree_order(parts[call]))


def test_bit_identical_and_independent_of_device_placement():
    tiling = small_tiles(rows=8, lanes=4, hold=3)
    rng = np.random.default_rng(1)
    dy, s, b, o = _case(rng, 40, 24, [0, 1, 30, 31, 40], np.float32)
    dy = dy * np.float32(1e3)
    first = K.grouped_dbias_dscales(dy, s, b, o, tiling=tiling)
    for _ in range(2):
        for a, f in zip(K.grouped_dbias_dscales(dy, s, b, o, tiling=tiling), first, strict=True):
            np.testing.assert_array_equal(a, f)
    dev = K.grouped_dbias_dscales(*(cuda.to_device(a) for a in (dy, s, b, o)), tiling=tiling)
    for a, f in zip(dev, first, strict=True):
        np.testing.assert_array_equal(a.copy_to_host(), f)


def test_plan_layout():
    from gpurouter.kernels._base.plan import spec_for

    dy = spec_for((65536, 2048), np.uint16)
    plan = K.grouped_dbias_dscales_plan(dy, spec_for((65536,), np.float32), spec_for((128, 2048), np.float32),
                                        spec_for((129,), np.int32))
    chunks = 65536 // M.DBIAS_TILING.chunk_rows
    assert [st.grid for st in plan.steps] == [chunks, 128 * 4]  # 4 blocks of kernel 2 per group
    assert plan.steps[0].block == 256  # 256 units of eight bf16 columns (16 bytes), one per lane
    assert plan.tmps[0].shape == (2 * chunks, 2048)  # two partial rows per chunk
    wide = K.grouped_dbias_dscales_plan(spec_for((32768, 7168), np.uint16), spec_for((32768,), np.float32),
                                        spec_for((256, 7168), np.float32), spec_for((257,), np.int32))
    # 896 units a row in 2 column blocks of 448 lanes (DbiasTiling.max_lanes = 512)
    assert wide.steps[0].grid == (32768 // M.DBIAS_TILING.chunk_rows) * 2 and wide.steps[0].block == 448
    assert len(wide.steps) == 3  # + the dscales of the column blocks summed in order


@pytest.mark.gpu
def test_gpu_qwen3_like_shape_vs_oracle_and_repeats():
    """N = T K = 65536 rows of H = 2048 bf16, 128 groups of uneven sizes (on a GPU)."""
    rng = np.random.default_rng(0)
    n, h, g = 65536, 2048, 128
    sizes = rng.multinomial(n - 1000, np.ones(g) / g)
    sizes[5] = 0
    o = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    dy = rng.standard_normal((n, h)).astype(BF16)
    s = rng.random(n).astype(np.float32)
    b = rng.standard_normal((g, h)).astype(BF16)
    db, ds = K.grouped_dbias_dscales(dy, s, b, o)
    dyf = np.nan_to_num(_f32(dy)).astype(np.float64)
    rows = np.repeat(np.arange(g), sizes)
    want_db = np.zeros((g, h))
    np.add.at(want_db, rows, dyf[: o[-1]] * s[: o[-1], None])
    want_ds = np.zeros(n)
    want_ds[: o[-1]] = np.einsum("ih,ih->i", dyf[: o[-1]], _f32(b).astype(np.float64)[rows])
    np.testing.assert_allclose(db, want_db, rtol=1e-4, atol=1e-5 * np.sqrt(n))
    np.testing.assert_allclose(ds, want_ds, rtol=1e-4, atol=1e-5 * np.sqrt(h))
    for a, f in zip(K.grouped_dbias_dscales(dy, s, b, o), (db, ds), strict=True):
        np.testing.assert_array_equal(a, f)
