"""Kernel vs float64 oracle: the token_combine launchers
(``gpurouter/kernels/moe/permute.py``), forward and the one-pass backward, on
the CUDA simulator at tiny shapes (several lanes per token, more experts than
a bit word, rows outside the output) and on a GPU at a real shape (``gpu``)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpurouter.testing import moe_oracle as orc

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter.kernels.moe import permute as C  # noqa: E402
from gpurouter.kernels.moe import plans as P  # noqa: E402

pytestmark = pytest.mark.cuda

BF16 = ml_dtypes.bfloat16


def lanes(n, hold=None):
    """A ``CombineTiling`` of at most ``n`` lanes per token (one unit each) and ``hold`` rows
    per load batch, three rows per block of the zero-row kernel."""
    knobs = {} if hold is None else dict(hold=hold, bwd_hold=hold)
    return K.CombineTiling(threads=n, lane_units=1, zero_rows=3, **knobs)


def _f32(a):
    return np.asarray(a).astype(np.float32)


def _case(rng, t, e, h, density, align, dtype):
    m = rng.random((t, e)) < density
    m[0] = False  # a token routed nowhere
    num_out = max(int(m.sum()), 1)
    _, _, rid, _, _ = orc.dispatch(np.zeros((t, 1)), m, num_out, None, align)
    rows = ((num_out + e * (align - 1)) // align) * align if align else num_out
    held = {int(r) for r in rid.ravel() if r >= 0}
    z = rng.standard_normal((rows, h)).astype(np.float32)
    z[[r for r in range(rows) if r not in held]] = np.nan  # rows no pair points to: never read
    w = np.where(m, rng.random((t, e)), 0.0)
    return z.astype(dtype), rid.astype(np.int32), w.astype(dtype), rng.standard_normal((t, h)).astype(dtype)


def _tol(dtype, n):
    if dtype == np.float32:
        return dict(rtol=1e-5, atol=1e-5 * np.sqrt(n))
    return dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("t,e,h,density,align,nl,hold", [
    (6, 40, 8, 0.4, 3, 2, 2),    # two bit words, padding rows, two lanes, batches of 2 rows
    (5, 4, 6, 0.7, None, 1, 3),  # H % 4 != 0, one lane
    (3, 33, 16, 1.0, None, 4, None),  # every expert routed (K = E), four lanes
    (4, 70, 24, 0.2, 2, 2, 3),   # bf16: 3 units of 8 columns over 2 lanes; E = 70: a 128-expert list
])
def test_fwd_bwd_vs_oracle(dtype, t, e, h, density, align, nl, hold):
    tiling = lanes(nl, hold)
    rng = np.random.default_rng(t * e + h)
    z, rid, w, dy = _case(rng, t, e, h, density, align, dtype)
    zc = np.nan_to_num(_f32(z))
    for ww in (w, None):
        wf = None if ww is None else _f32(ww)
        y = K.token_combine_fwd(z, rid, ww, tiling=tiling)
        assert y.dtype == z.dtype and y.shape == (t, h)
        np.testing.assert_allclose(_f32(y), orc.combine(zc, rid, wf), **_tol(dtype, e))
        d_z, d_w = K.token_combine_bwd(dy, z, rid, ww, tiling=tiling)
        want_dz, want_dw = orc.combine_bwd(_f32(dy), zc, rid, wf)
        assert d_z.dtype == z.dtype and not np.isnan(_f32(d_z)).any()
        np.testing.assert_allclose(_f32(d_z), want_dz, **_tol(dtype, 1))
        if ww is None:
            assert d_w is None
        else:
            assert d_w.dtype == w.dtype
            np.testing.assert_allclose(_f32(d_w), want_dw, **_tol(dtype, h))
            assert not _f32(d_w)[rid < 0].any()  # not routed: exactly 0


def test_rows_outside_the_output_are_not_routed_and_results_repeat():
    tiling = lanes(2)
    rng = np.random.default_rng(7)
    z = rng.standard_normal((5, 4)).astype(np.float32)
    rid = np.array([[0, 9, -1], [1, -3, 4], [2, 3, 5]], np.int32)  # 9, 5: past R = 5; -3: none
    w = rng.random((3, 3)).astype(np.float32)
    y = K.token_combine_fwd(z, rid, w, tiling=tiling)
    ok = np.where((rid >= 0) & (rid < 5), rid, -1)
    np.testing.assert_allclose(y, orc.combine(z, ok, w), rtol=1e-6)
    d_z, d_w = K.token_combine_bwd(y, z, rid, w, tiling=tiling)
    want_dz, want_dw = orc.combine_bwd(y, z, ok, w)
    np.testing.assert_allclose(d_z, want_dz, rtol=1e-6)
    np.testing.assert_allclose(d_w, want_dw, rtol=1e-6, atol=1e-6)
    for a, f in zip(K.token_combine_bwd(y, z, rid, w, tiling=tiling), (d_z, d_w), strict=True):
        np.testing.assert_array_equal(a, f)
    np.testing.assert_array_equal(K.token_combine_fwd(z, rid, w, tiling=tiling), y)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("h", [6, 16])  # 16: bf16 in 16-byte units of eight columns
def test_dispatch_row_copy_vs_oracle(dtype, h):
    """``token_dispatch_fwd``: the unweighted combine backward's kernels copying
    each token into its rows; padding rows exactly 0."""
    tiling = lanes(2, 2)
    rng = np.random.default_rng(3)
    t, e, align = 7, 35, 4
    m = rng.random((t, e)) < 0.3
    x = rng.standard_normal((t, h)).astype(dtype)
    num_out = max(int(m.sum()), 1)
    w_out, _, rid, _, _ = orc.dispatch(_f32(x), m, num_out, None, align)
    out = K.token_dispatch_fwd(x, rid.astype(np.int32), w_out.shape[0], tiling=tiling)
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(_f32(out), w_out)  # a copy: exact
    # its backward is the unweighted combine forward: the K copies summed
    g = rng.standard_normal(w_out.shape).astype(np.float32)
    np.testing.assert_allclose(K.token_combine_fwd(g, rid.astype(np.int32), tiling=tiling),
                               orc.dispatch_bwd(g, None, rid)[0], rtol=1e-5, atol=1e-5 * np.sqrt(e))


def test_plan_layout():
    from gpurouter.kernels._base.plan import spec_for

    z, rid, w = spec_for((65536, 2048), np.uint16), spec_for((8192, 128), np.int32), spec_for((8192, 128), np.float32)
    fwd = K.token_combine_fwd_plan(z, rid, w)
    # a block per token; 256 units of eight bf16 columns (16 bytes), two per lane
    assert [(st.grid, st.block) for st in fwd.steps] == [(8192, 128)]
    bwd = K.token_combine_bwd_plan(spec_for((8192, 2048), np.uint16), z, rid, w)
    assert len(bwd.steps) == 4 and (bwd.steps[-1].grid, bwd.steps[-1].block) == (8192, 128)
    assert C.combine_tiling(7168, "bf16") == (224, 896, "oct")  # DeepSeek-V3's H: 4 units per lane (256 at most)
    assert C.combine_tiling(6, "bf16") == (1, 2, "grid")  # H % 4 != 0: 2-D, two units of four columns
    assert bwd.tmps[0].shape == (65536,)  # a flag per row of inp


@pytest.mark.gpu
def test_gpu_qwen3_like_shape_vs_oracle():
    """T = 4096 tokens, E = 128, K = 8, H = 2048 bf16 (on a GPU)."""
    rng = np.random.default_rng(0)
    t, e, k, h = 4096, 128, 8, 2048
    m = np.zeros((t, e), bool)
    for row in range(t):
        m[row, rng.permutation(e)[:k]] = True
    _, _, rid, _, _ = orc.dispatch(np.zeros((t, 1)), m, t * k, None, None)
    rid = rid.astype(np.int32)
    z = rng.standard_normal((t * k, h)).astype(BF16)
    w = np.where(m, rng.random((t, e)), 0).astype(np.float32)
    dy = rng.standard_normal((t, h)).astype(BF16)
    zf = _f32(z).astype(np.float64)
    safe = np.where(rid >= 0, rid, 0)
    want = np.einsum("te,teh->th", np.where(rid >= 0, w, 0), zf[safe])
    y = K.token_combine_fwd(z, rid, w)
    np.testing.assert_allclose(_f32(y), want, rtol=1e-2, atol=1e-2)
    d_z, d_w = K.token_combine_bwd(dy, z, rid, w)
    want_dw = np.where(rid >= 0, np.einsum("teh,th->te", zf[safe], _f32(dy).astype(np.float64)), 0)
    np.testing.assert_allclose(d_w, want_dw, rtol=1e-4, atol=1e-3)
    want_dz = np.zeros_like(zf)
    tt, ee = np.nonzero(rid >= 0)
    want_dz[rid[tt, ee]] = w[tt, ee, None] * _f32(dy)[tt]
    np.testing.assert_allclose(_f32(d_z), want_dz, rtol=1e-2, atol=1e-2)
    for a, f in zip(K.token_combine_bwd(dy, z, rid, w), (d_z, d_w), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(f))


def test_index_inputs_are_checked_and_made_int32():
    """The launchers' index arrays (``moe_plans._int32_input``): a float or
    wrong-rank ``row_id_map`` / ``offsets`` is a TypeError naming it; host
    rows past int32 count as not routed, offsets past int32 clip to its max."""
    from numba import cuda

    z = np.ones((2, 4), np.float32)
    with pytest.raises(TypeError, match="token_combine_fwd: row_id_map must be integers \\[T, E\\]"):
        P.token_combine_fwd(z, np.zeros((1, 2), np.float32))
    with pytest.raises(TypeError, match="a device row_id_map must be int32 \\[T, E\\]"):
        P.token_combine_fwd(z, cuda.to_device(np.zeros((1, 2), np.int64)))
    with pytest.raises(TypeError, match="offsets must be integers of rank 1"):
        P.grouped_dbias(z, np.zeros((2, 1), np.int32))
    rid = np.array([[0, 2**40]], np.int64)  # the second pair: past int32, not routed
    np.testing.assert_array_equal(P.token_combine_fwd(z, rid), z[:1])
    db = P.grouped_dbias(z, np.array([0, 2**40], np.int64))  # clipped: every row in the group
    np.testing.assert_array_equal(np.asarray(db)[0], z.sum(0))
