"""The thread-per-token forward kernels (``token_rows.py``) against the reference:
specials, fillers, ties, groups, quads in every dtype, several blocks with a
partial last tile.  Tiny shapes (E a multiple of 4, K <= 16): the simulator
runs them; the TE shapes are in test_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from numba import cuda  # noqa: E402
from strategies import random_cotangent, tie_free_rows_np  # noqa: E402

from gpurouter import reference as ref  # noqa: E402

from ._helpers import (  # noqa: E402
    FWD_MODES,
    check_special_rows,
    check_topk_bwd,
    check_topk_fwd,
    host,
)
from .test_topk import _bias, _cfg, _sel  # noqa: E402

pytestmark = pytest.mark.cuda


def _kernel_of(plan):
    """True when the plan's kernel is one of token_rows.py's."""
    return plan.steps[0].kernel.py_func.__module__ == "gpurouter.kernels.token_rows"


def test_dispatch():
    """E % 4 == 0 and K <= 16 take the token kernels, the rest the W-lane ones."""
    from gpurouter.kernels import _launch as L
    from gpurouter.kernels import _plan, aux_scores, topk

    def fwd(E, k, G=-1, Kg=-1):
        return topk.topk_with_score_function_fwd_plan(_plan.spec_of((5, E), L.BF16), False, k, False,
                                                      G, Kg, np.float32(1), 1)

    assert _kernel_of(fwd(256, 8, 8, 4)) and _kernel_of(fwd(8, 2)) and _kernel_of(fwd(32, 16))
    assert not _kernel_of(fwd(10, 4)) and not _kernel_of(fwd(64, 17))
    assert _kernel_of(aux_scores.score_for_aux_loss_fwd_plan(_plan.spec_of((5, 12), L.F32), 3, 0))
    assert not _kernel_of(aux_scores.score_for_aux_loss_fwd_plan(_plan.spec_of((5, 13), L.F32), 3, 0))


@pytest.mark.parametrize("sf,pre", FWD_MODES)
def test_specials_fillers_partial_tile(token_tiling, sf, pre):
    # 2 tokens per block: 5 rows give 3 blocks, the last one partial
    token_tiling(2)
    ninf, nan = -np.inf, np.nan
    x = np.array([
        [ninf] * 12,                                                       # all -inf
        [ninf, 1.0, ninf, ninf, ninf, ninf, ninf, 2.0, ninf, ninf, ninf, ninf],  # 2 finite < K
        [nan, 0.5, 0.25, 0.75, ninf, -1.0, nan, 3.0, 0.5, nan, 0.1, -0.0],  # NaN as -inf
        [0.5, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan],      # mostly NaN
        [0.1, 0.9, -0.3, 0.7, 0.2, -0.8, 0.4, 0.6, -0.5, 0.3, 0.0, -0.1],  # plain
    ], np.float32)
    check_special_rows(K, x, 4, pre, sf, [[0, 1, 2, 3], [0, 1, 2, 7]])


@pytest.mark.parametrize("sf", ["softmax", "sigmoid"])
def test_ties_and_signed_zeros(token_tiling, sf):
    token_tiling(2)
    x = np.zeros((3, 12), np.float32)
    x[1] = [1, 2, 2, 0, 2, 2, 1, 0, 2, 2, 1, 2]
    x[2] = [-0.0, 0.0, 0.0, -0.0, -1, -0.0, 3, 3, 0.0, -2, 3, -0.0]
    p, m, _ = K.topk_with_score_function_fwd(x, 5, score_function=sf)
    rp, rm, _ = (host(a) for a in ref.topk_with_score_function_fwd(x, 5, score_function=sf))
    assert _sel(m) == [[0, 1, 2, 3, 4], [1, 2, 4, 5, 8], [0, 1, 6, 7, 10]]
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(p, rp, atol=1e-6, rtol=1e-5)


def test_group_ties_and_dropped_fillers(token_tiling):
    token_tiling(1)
    x = np.zeros((2, 16), np.float32)
    p, m, _ = K.topk_with_score_function_fwd(x, 4, num_groups=4, group_topk=2,
                                             score_function="sigmoid")
    assert _sel(m) == [[0, 1, 2, 3]] * 2
    # group 2 holds the only finite values; groups 0, 1, 3 tie at -inf (row 1:
    # a NaN group score, as -inf): groups 0 and 2 kept, fillers from group 0 only
    x = np.full((2, 16), -np.inf, np.float32)
    x[:, 8:10] = [1.0, 2.0]
    x[1, 0] = np.nan
    p, m, _ = K.topk_with_score_function_fwd(x, 4, num_groups=4, group_topk=2)
    rm = host(ref.topk_with_score_function_fwd(x, 4, num_groups=4, group_topk=2)[1])
    assert _sel(m) == [[0, 1, 8, 9]] * 2
    np.testing.assert_array_equal(m, rm)


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "groups"])
def test_ties_across_the_threshold(token_tiling, sf, pre, grouped):
    """Coarse-grid rows (ties everywhere, as bf16 logits give), a bias with
    repeated values, rows with fewer than K finite scores, all in one block
    with tie-free rows: the threshold way with and without a tie cutoff and
    the bit way side by side, maps exact against the reference."""
    token_tiling(8)
    rng = np.random.default_rng(21)
    T, E, k = 12, 32, 6
    x = (rng.integers(-6, 7, (T, E)) / 4).astype(np.float32)
    x[3] = rng.permutation(E) / 8  # tie-free
    x[5, :] = -np.inf
    x[5, [4, 9, 30]] = [1.0, 1.0, 0.5]  # 3 finite < K: -inf fillers
    x[7, ::3] = np.nan
    x[9, :] = 0.25  # one value everywhere
    if sf != "softmax":
        x = np.where(np.isneginf(x), np.float32(-30.0), x)
    kw = dict(topk=k, use_pre_softmax=pre, score_function=sf, scaling_factor=1.5)
    if grouped:
        kw.update(num_groups=4, group_topk=2)
    bias = None
    if sf != "softmax":
        bias = (np.arange(E) % 3 / 8).astype(np.float32)
    p, m, s = K.topk_with_score_function_fwd(x, expert_bias=bias, **kw)
    rp, rm, rs = (host(a) for a in ref.topk_with_score_function_fwd(x, expert_bias=bias, **kw))
    assert (m.sum(-1) == k).all()
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_array_equal(np.isnan(p), np.isnan(rp))
    np.testing.assert_allclose(p, rp, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(s, rs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_infinite_rows(token_tiling, sf):
    """+inf logits: sqrtsoftplus makes the row's sum inf, so every score is 0
    or NaN (inf / inf); softmax gives NaN at the infs; the map is the
    reference's (NaN as -inf, ties to the lower index)."""
    token_tiling(2)
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
    token_tiling(4)
    rng = np.random.default_rng(22)
    x = (rng.integers(-4, 5, (9, 16)) / 4).astype(np.float32)
    x[2] = rng.permutation(16) / 8
    x[4] = 0.5
    sc, m, sv = K.score_for_aux_loss_fwd(x, 5, sf)
    rsc, rm, rsv = (host(a) for a in ref.score_for_aux_loss_fwd(x, 5, sf))
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_allclose(sc, rsc, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(sv, rsv, atol=1e-6, rtol=1e-5)


# (T, E, K, G, Kg): K = E = 16 (the largest list); K = 1; per-group top 4;
# eight groups of 4 keeping 4 (DeepSeek's split, scaled down); K = 3, K = 5;
# odd G and odd Kg (the last group of the pair scans, the last kept group
# alone), Kg = 1.
SHAPES = [
    (5, 24, 3, 3, 3),
    (5, 20, 2, 5, 1),
    (5, 28, 6, 7, 3),
    (5, 16, 16, -1, -1),
    (5, 8, 1, -1, -1),
    (5, 16, 8, 4, 2),
    (5, 32, 8, 8, 4),
    (5, 20, 3, -1, -1),
    (5, 24, 5, -1, -1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}E{}K{}G{}Kg{}".format(*s))
@pytest.mark.parametrize("sf", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_shapes_fwd_bwd(token_tiling, shape, sf):
    token_tiling(2)
    T, E, k, G, Kg = shape
    cfg = _cfg(T, E, k, sf, False, G, Kg, 2.5, sf != "softmax")
    bias = _bias(E, 7) if cfg.has_bias else None
    x = tie_free_rows_np(11, cfg, bias)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(4, x.shape), "float32", cfg.kwargs())


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_half_quads(token_tiling, sf, pre, dtype):
    """bf16 rows travel as uint64 quads, fp16 element by element: both against the reference."""
    token_tiling(2)
    cfg = _cfg(5, 16, 4, sf, pre, 4, 2, 2.5, sf != "softmax", dtype)
    bias = _bias(16, 5) if cfg.has_bias else None
    x = tie_free_rows_np(6, cfg, bias)
    _, m, s = check_topk_fwd(K, x, dtype, cfg.kwargs(), bias)
    check_topk_bwd(K, m, s, random_cotangent(8, x.shape, dtype), dtype, cfg.kwargs())


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_aux_scores(token_tiling, sf, dtype):
    token_tiling(2)
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


def test_layouts_fit_shared_memory():
    """Every token-path config up to the limits fits the 48 KiB budget (host code)."""
    from gpurouter.kernels import _launch as L
    from gpurouter.kernels._limits import MAX_EXPERTS, SMEM_BUDGET

    for E in (4, 8, 128, 256, 1024, 4096, MAX_EXPERTS):
        for G in (0, 8, 64):
            for bias in (False, True):
                if not L.token_path(E, 8, G, bias):
                    assert (E, bias) == (MAX_EXPERTS, True)  # the W-lane kernels take it
                    with pytest.raises(NotImplementedError, match="does not fit"):
                        L.token_layout(1, E, G, bias)
                    continue
                for T in (1, 7, 65536):
                    lay = L.token_layout(T, E, G, bias)
                    assert lay.shared <= SMEM_BUDGET, (E, G, lay)
                    assert lay.threads >= lay.tb and lay.threads % 32 == 0
                    assert lay.stride % 2 == 1 and lay.grid * lay.tb >= T
    lay = L.token_layout(65536, 256, 8, True)
    assert (lay.tb, lay.threads) == (32, 256)  # DeepSeek-V3


@pytest.fixture(params=[1, 4], ids=["hold1", "hold4"])
def quad_lanes(monkeypatch, request):
    """Forces the quad backwards to W = 2 lanes per token and 4 tokens per block
    (several quads per lane, a partial last block), a lane holding 1 of its
    quads in registers (the others loaded again in pass 2) or all of them,
    plans forgotten around it."""
    from gpurouter.kernels import _launch as L
    from gpurouter.kernels import aux_scores, topk

    def clear():
        topk.topk_with_score_function_bwd_plan.cache_clear()
        aux_scores.score_for_aux_loss_bwd_plan.cache_clear()

    monkeypatch.setattr(L, "QUAD_LANES_SPARSE", 2)
    monkeypatch.setattr(L, "QUAD_LANES_DENSE", 2)
    monkeypatch.setattr(L, "QUAD_THREADS", 8)
    monkeypatch.setattr(L, "QUAD_HOLD", request.param)
    clear()
    yield
    monkeypatch.undo()
    clear()


@pytest.mark.parametrize("sf,pre", FWD_MODES)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_quad_bwd_several_quads_per_lane(quad_lanes, sf, pre, dtype):
    cfg = _cfg(5, 20, 3, sf, pre, -1, -1, 2.5 if sf != "softmax" else 1.0, False, dtype)
    x = tie_free_rows_np(12, cfg, None)
    _, m, s = check_topk_fwd(K, x, dtype, cfg.kwargs())
    check_topk_bwd(K, m, s, random_cotangent(13, x.shape, dtype), dtype, cfg.kwargs())


@pytest.mark.parametrize("sf", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_quad_aux_bwd_several_quads_per_lane(quad_lanes, sf):
    from strategies import np_dtype
    from tolerances import assert_close

    x = (np.random.default_rng(3).permutation(100).reshape(5, 20) / 16 - 3).astype(np.float32)
    _, _, sv = K.score_for_aux_loss_fwd(x, 3, sf)
    g = random_cotangent(9, x.shape)
    for dtype in ("float32", "bfloat16"):
        dx = K.score_for_aux_loss_bwd(sv, g, sf, np_dtype(dtype))
        rdx = host(ref.score_for_aux_loss_bwd(sv, g, sf, np_dtype(dtype)))
        assert_close(dx, rdx, "grads", np_dtype(dtype), E=20, err_msg=f"aux grad {sf} {dtype}")


def test_misaligned_word_views_are_refused():
    """A device array the kernels read as wider words (the bool map as uint32
    quads) that does not start on a word boundary is a ValueError, not a
    fault in the kernel."""
    x = cuda.to_device(np.zeros((2, 8), np.float32))
    probs = cuda.device_array((2, 8), np.float32)
    saved = cuda.device_array((2, 8), np.float32)
    rmap = cuda.device_array(17, np.bool_)[1:].reshape(2, 8)
    with pytest.raises(ValueError, match=r"topk_with_score_function_fwd: a device output array .* not a "
                                         r"multiple of 4 bytes"):
        K.topk_with_score_function_fwd(x, 2, out=(probs, rmap, saved))


def _quad_copy_kernel(variant="checked"):
    """(Kernels name ``cuda`` as a module global: the simulator swaps globals, not closures.)
    ``variant``: ``checked`` (``quad_f32``'s load and store) or ``unchecked``
    (``quad_f32_unchecked``'s load where the source is aligned, else the
    checked one; ``quad_store_once_f32``'s store)."""
    from gpurouter.kernels import _vec

    load, store = _vec.quad_f32()
    if variant == "unchecked":
        aligned, load_aligned = _vec.quad_f32_unchecked()
        store_once = _vec.quad_store_once_f32()

        @cuda.jit
        def copy_quads_unchecked(src, dst, n):
            w = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
            if w < n:
                if aligned(src):
                    a, b, c, d = load_aligned(src, w)
                else:
                    a, b, c, d = load(src, w)
                store_once(dst, w, d, c, b, a)

        return copy_quads_unchecked

    @cuda.jit
    def copy_quads(src, dst, n):
        w = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if w < n:
            a, b, c, d = load(src, w)
            store(dst, w, d, c, b, a)

    return copy_quads


@pytest.mark.parametrize("variant", ["checked", "unchecked"])
def test_quad_access_aligned_and_misaligned(variant):
    """``_vec.quad_f32`` (and ``quad_f32_unchecked``, ``quad_store_once_f32``):
    on a GPU 16-byte loads and stores on aligned arrays and the element
    fallback on views whose base is not 16-byte aligned (on the simulator,
    elements throughout): every quad moved, nothing outside."""
    from gpurouter.kernels import _launch as L

    copy_quads = _quad_copy_kernel(variant)
    host_src = np.arange(4 * 8 + 3, dtype=np.float32) + np.float32(0.5)
    for off_src, off_dst in ((0, 0), (1, 0), (0, 3), (2, 1)):
        src = cuda.to_device(host_src)
        dst = cuda.to_device(np.full(4 * 8 + 3, -7.0, np.float32))
        L.launch(copy_quads, 1, 8, 0, 0, src[off_src:off_src + 32], dst[off_dst:off_dst + 32], 8)
        got = dst.copy_to_host()
        want = host_src[off_src:off_src + 32].reshape(8, 4)[:, ::-1].reshape(-1)
        np.testing.assert_array_equal(got[off_dst:off_dst + 32], want)
        assert (np.delete(got, np.s_[off_dst:off_dst + 32]) == -7.0).all(), "wrote outside the view"
