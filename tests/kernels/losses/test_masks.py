"""The loss kernels' ``token_mask`` (``kernels/losses/masks.py``: the aux-loss
and z-loss kernels compiled with ``has_mask``), on the CUDA simulator or a GPU:
a masked launch equals the unmasked one on the rows zeroed (aux loss) or made
all ``-inf`` (z-loss) with ``T`` the valid count, bit for bit; masked rows get
exactly 0 gradient whatever they hold (NaN, inf)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

pytestmark = pytest.mark.cuda


def _mask(T, seed=1, frac=0.3):
    m = np.random.default_rng(seed).random(T) >= frac
    m[0] = False  # the first row masked whatever the draw
    return m


def _probs(T, C, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((T, C)).astype(np.float32).astype(dtype), rng.integers(0, 64, C).astype(np.int32)


@pytest.mark.parametrize("dtype,T,C,E", [
    (np.float32, 40, 36, None),  # fp32 column quads, 5 blocks of 8 rows, 2 row lanes
    (np.float32, 30, 38, None),  # fp32 elements, 4 blocks (the last of 6 rows)
    (ml_dtypes.bfloat16, 9, 16, 8),  # bf16, sequence aux loss (C = 2E), 2 blocks
    (np.float16, 7, 5, None),  # fp16, C % 4 != 0 (the element backward)
])
def test_aux_loss_masked(dtype, T, C, E):
    tiling = K.AuxLossTiling(column_threads=64, column_min_rows=8, fill_threads=64)  # several small blocks
    probs, tpe = _probs(T, C, dtype)
    mask = _mask(T)
    junk = probs.copy()
    junk[~mask] = np.asarray(np.nan, dtype)  # masked rows are never read into the sums
    zeroed = np.where(mask[:, None], probs, np.zeros((), dtype))
    n = int(mask.sum())
    want, want_c = K.moe_aux_loss_fwd(zeroed, tpe, 2, 0.01, n, E, tiling=tiling)
    loss, c = K.moe_aux_loss_fwd(junk, tpe, 2, 0.01, None, E, token_mask=mask, tiling=tiling)  # T counted by the kernel
    assert loss.dtype == np.dtype(dtype) and c.dtype == np.float32
    assert c == want_c == K.aux_loss_coeff(C if E is None else E, 0.01, 2, n)
    assert loss.tobytes() == want.tobytes()
    again, c2 = K.moe_aux_loss_fwd(junk, tpe, 2, 0.01, None, E, token_mask=mask, tiling=tiling)  # count word left 0
    assert again.tobytes() == want.tobytes() and c2 == c
    # uint8 mask, T given (a number): the same bits
    loss8, _ = K.moe_aux_loss_fwd(junk, tpe, 2, 0.01, n, E, token_mask=mask.astype(np.uint8), tiling=tiling)
    assert loss8.tobytes() == want.tobytes()
    g = np.asarray(1.5, dtype)
    gp = K.moe_aux_loss_bwd(c, tpe, g, T, token_mask=mask, tiling=tiling)
    full = K.moe_aux_loss_bwd(c, tpe, g, T, tiling=tiling)
    np.testing.assert_array_equal(gp[mask].astype(np.float32), full[mask].astype(np.float32))
    assert not np.any(gp[~mask].astype(np.float32))


@pytest.mark.parametrize("dtype,C", [(np.float32, 36), (ml_dtypes.bfloat16, 20), (ml_dtypes.bfloat16, 22)])
# column quads (fp32, bf16: C % 4 == 0), elements (bf16, C = 22)
def test_aux_loss_masked_rows_add_nothing(dtype, C):
    """The masked forward (each row's mask byte loaded with its values: 12 rows
    a row lane, so an unrolled trip and a tail) gives the unmasked kernel's bits
    on the zeroed rows, NaN and inf in the masked rows included, T counted or
    given; the plan launches the masked kernel with no shared bytes."""
    from gpurouter.kernels._base.plan import spec_for
    from gpurouter.kernels.losses import aux_loss as A

    T = 70  # 3 blocks of 24 rows (the last 22), 2 row lanes of 32 column lanes
    tiling = K.AuxLossTiling(column_threads=64, column_min_rows=32)
    probs, tpe = _probs(T, C, dtype, seed=3)
    mask = _mask(T, seed=4)
    junk = probs.copy()
    junk[~mask, 1] = np.asarray(np.nan, dtype)
    junk[~mask, 2] = np.asarray(np.inf, dtype)
    n = int(mask.sum())
    want = K.moe_aux_loss_fwd(np.where(mask[:, None], probs, np.zeros((), dtype)), tpe, 2, 0.01, n,
                              tiling=tiling)[0]
    spec_p, spec_t = spec_for(probs.shape, probs.dtype), spec_for(tpe.shape, tpe.dtype)
    step = A.moe_aux_loss_fwd_plan(spec_p, spec_t, np.float32(1), tiling, True, True).steps[0]
    quads = C % 4 == 0
    grid, threads, cl, rows = A.column_tiling(T, C // 4 if quads else C, tiling)
    assert (grid, threads, rows) == (3, 64, 24)
    assert step.kernel is A.aux_loss_fwd_kernel(spec_p.kind, spec_t.kind, spec_p.kind, quads, True, True)
    assert step.shared == 0
    counted = K.moe_aux_loss_fwd(junk, tpe, 2, 0.01, token_mask=mask, tiling=tiling)[0]
    given = K.moe_aux_loss_fwd(junk, tpe, 2, 0.01, n, token_mask=mask, tiling=tiling)[0]
    assert counted.tobytes() == want.tobytes() and given.tobytes() == want.tobytes()


def test_aux_loss_all_masked():
    """No valid row: T = max(0, 1) = 1, the loss 0 and the gradient 0."""
    probs, tpe = _probs(5, 8, np.float32)
    mask = np.zeros(5, bool)
    loss, c = K.moe_aux_loss_fwd(probs, tpe, 2, 0.01, token_mask=mask)
    assert loss == 0.0 and c == K.aux_loss_coeff(8, 0.01, 2, 1)
    assert not np.any(K.moe_aux_loss_bwd(c, tpe, np.float32(1), 5, token_mask=mask))


def test_aux_loss_device_count():
    """T as a device scalar (float32 as it is, an int converted): C on the device
    in aux_loss_coeff's order, the same bits as the host's."""
    from numba import cuda

    probs, tpe = _probs(12, 12, np.float32)
    mask = _mask(12)
    for t in (np.float32(1000), np.int32(1000)):
        loss, c = K.moe_aux_loss_fwd(cuda.to_device(probs), tpe, 3, 0.5, cuda.to_device(np.asarray(t)),
                                     token_mask=cuda.to_device(mask))
        assert hasattr(loss, "copy_to_host")
        assert c.copy_to_host() == K.aux_loss_coeff(12, 0.5, 3, 1000)
        want = K.moe_aux_loss_fwd(np.where(mask[:, None], probs, 0), tpe, 3, 0.5, 1000)[0]
        assert loss.copy_to_host().tobytes() == want.tobytes()


def test_mask_errors():
    probs, tpe = _probs(4, 8, np.float32)
    with pytest.raises(TypeError, match="moe_aux_loss_fwd: token_mask must be bool or uint8"):
        K.moe_aux_loss_fwd(probs, tpe, 2, 0.01, token_mask=np.ones(4, np.int32))
    with pytest.raises(ValueError, match=r"moe_aux_loss_fwd: token_mask shape \(5,\) must be \(4,\)"):
        K.moe_aux_loss_fwd(probs, tpe, 2, 0.01, token_mask=np.ones(5, bool))
    with pytest.raises(ValueError, match=r"moe_aux_loss_bwd: token_mask shape \(4, 1\) must be \(4,\)"):
        K.moe_aux_loss_bwd(np.float32(1), tpe, np.float32(1), 4, token_mask=np.ones((4, 1), bool))


def test_unmasked_kernels_unchanged():
    """Without a mask the plans launch the kernels built without ``has_mask``
    (their factories' cache keys as before); with one, the masked builds."""
    from gpurouter.kernels._base.plan import spec_for
    from gpurouter.kernels.losses import aux_loss as A

    spec_p, spec_t = spec_for((8, 12), np.float32), spec_for((12,), np.int32)
    plain = A.moe_aux_loss_fwd_plan(spec_p, spec_t, np.float32(1))
    masked = A.moe_aux_loss_fwd_plan(spec_p, spec_t, np.float32(1), None, True)
    assert plain.steps[0].kernel is A.aux_loss_fwd_kernel(spec_p.kind, spec_t.kind, spec_p.kind, True)
    assert masked.steps[0].kernel is not plain.steps[0].kernel
    assert len(masked.ins) == 4 and len(plain.ins) == 2


def _logits(T, E, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, E)) * 3).astype(np.float32).astype(dtype)


def _z_tilings():
    from gpurouter.kernels.losses.tiling import ZLossTiling

    # vec: TB = 4 rows, prefetch on (3 groups a block, 2 blocks); unit: the vector kernels off
    return {"vec": ZLossTiling(vec_fwd=(8, 1, 2, True, True), vec_bwd=(8, 1, 2, True, True)),
            "vec-no-prefetch": ZLossTiling(vec_fwd=(8, 1, 2, False, True), vec_bwd=(8, 1, 2, False, True)),
            "unit": ZLossTiling(vec_max_hold=0, threads=4, bwd_threads=4)}  # 4 rows a block: 2-3 blocks


@pytest.mark.parametrize("dtype,T,E,path", [
    (ml_dtypes.bfloat16, 19, 16, "vec"),  # the vector kernels, 2 blocks (one ends past T)
    (np.float32, 11, 12, "vec"),  # fp32 vectors, a lane's second vector past the row
    (ml_dtypes.bfloat16, 19, 16, "vec-no-prefetch"),  # the library's default walk: a group, then its refetch
    (np.float16, 9, 8, "unit"),  # the unit kernels on quads, then the final kernel
    (np.float32, 6, 5, "unit"),  # units of masked elements (E % 4 != 0)
])
def test_z_loss_masked(dtype, T, E, path):
    """The masked kernels == the unmasked ones on the rows made all -inf (which
    add 0), N the valid count: the loss and the valid rows' gradient bit for
    bit; the masked rows' gradient exactly 0 even where they hold +inf or NaN."""
    tiling = _z_tilings()[path]
    x = _logits(T, E, dtype)
    mask = _mask(T)
    junk = x.copy()
    junk[~mask, 0] = np.asarray(np.inf, dtype)
    junk[~mask, -1] = np.asarray(np.nan, dtype)
    dead = np.where(mask[:, None], x, np.asarray(-np.inf, dtype))
    n = int(mask.sum())
    want, wsaved = K.router_z_loss_fwd(dead, 0.01, n, tiling=tiling)
    loss, saved = K.router_z_loss_fwd(junk, 0.01, token_mask=mask, tiling=tiling)  # N counted by the kernels
    assert loss.tobytes() == want.tobytes()
    again = K.router_z_loss_fwd(junk, 0.01, token_mask=mask, return_count=True, tiling=tiling)
    assert again[0].tobytes() == want.tobytes() and again[2] == n  # the count word was left 0
    given = K.router_z_loss_fwd(junk, 0.01, n, token_mask=mask, tiling=tiling)[0]  # N given: the same bits
    assert given.tobytes() == want.tobytes()
    from numba import cuda

    outs = (cuda.device_array((), np.float32), cuda.device_array((2 * T,), np.float32))
    words = junk.view(np.uint16) if junk.dtype.itemsize == 2 and junk.dtype != np.float16 else junk  # bf16 as words
    res = K.router_z_loss_fwd(cuda.to_device(words), 0.01, token_mask=mask, tiling=tiling, out=outs)
    assert res[0] is outs[0] and outs[0].copy_to_host().tobytes() == want.tobytes()
    keep = np.concatenate([mask, mask])
    np.testing.assert_array_equal(saved[keep], wsaved[keep])
    wgrad = K.router_z_loss_bwd(dead, wsaved, np.float32(1.5), 0.01, n, tiling=tiling)
    grad = K.router_z_loss_bwd(junk, saved, np.float32(1.5), 0.01, token_mask=mask, tiling=tiling)
    assert grad.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(grad[mask].astype(np.float32), wgrad[mask].astype(np.float32))
    assert not np.any(grad[~mask].astype(np.float32))
    assert not np.any(np.isnan(grad[~mask].astype(np.float32)))


def test_z_loss_all_masked_and_device_count():
    """No valid row: the loss 0, the gradient 0 (N = 1); N a device scalar: the
    same bits as the number."""
    from numba import cuda

    x = _logits(6, 16, np.float32, seed=2)
    none = np.zeros(6, bool)
    loss, saved = K.router_z_loss_fwd(x, 0.01, token_mask=none)
    assert loss == 0.0
    assert not np.any(K.router_z_loss_bwd(x, saved, np.float32(1), 0.01, token_mask=none))
    mask = _mask(6)
    host_loss = K.router_z_loss_fwd(x, 0.01, 100, token_mask=mask)[0]
    dev = K.router_z_loss_fwd(cuda.to_device(x), 0.01, cuda.to_device(np.asarray(100, np.int32)),
                              token_mask=cuda.to_device(mask.astype(np.uint8)))[0]
    assert dev.copy_to_host().tobytes() == host_loss.tobytes()
    with pytest.raises(ValueError, match="router_z_loss_fwd: total_num_tokens"):
        K.router_z_loss_fwd(x, 0.01, 0, token_mask=mask)
    with pytest.raises(TypeError, match="router_z_loss_bwd: token_mask must be bool or uint8"):
        K.router_z_loss_bwd(x, saved, np.float32(1), 0.01, token_mask=np.ones(6, np.float32))


@pytest.mark.gpu
def test_masked_kernels_at_the_issue_shape_on_the_gpu():
    """T = 65536, E = 384, bf16, every 10th token masked: the counting kernels
    over their full grids (hundreds of blocks adding their counts) against the
    unmasked kernels on the dead / zeroed rows, bit for bit, twice (the count
    word left 0). GPU only: far too big for the simulator."""
    T, E = 65536, 384
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((T, E)) * 3).astype(ml_dtypes.bfloat16)
    p = rng.random((T, E)).astype(ml_dtypes.bfloat16)
    tpe = rng.integers(0, 2048, E).astype(np.int32)
    mask = np.arange(T) % 10 != 0
    n = int(mask.sum())
    dead = np.where(mask[:, None], x, np.asarray(-np.inf, ml_dtypes.bfloat16))
    want, wsaved = K.router_z_loss_fwd(dead, 1e-3, n)
    zeroed = np.where(mask[:, None], p, np.zeros((), ml_dtypes.bfloat16))
    want_aux = K.moe_aux_loss_fwd(zeroed, tpe, 8, 1e-2, n)[0]
    for _ in range(2):
        loss, saved, got_n = K.router_z_loss_fwd(x, 1e-3, token_mask=mask, return_count=True)
        assert loss.tobytes() == want.tobytes() and got_n == n
        assert K.moe_aux_loss_fwd(p, tpe, 8, 1e-2, token_mask=mask)[0].tobytes() == want_aux.tobytes()
    # T given (the axis_name / traced path): the device-scalar builds, the same bits
    assert K.router_z_loss_fwd(x, 1e-3, n, token_mask=mask)[0].tobytes() == want.tobytes()
    assert K.moe_aux_loss_fwd(p, tpe, 8, 1e-2, n, token_mask=mask)[0].tobytes() == want_aux.tobytes()
    grad = K.router_z_loss_bwd(x, saved, np.float32(1), 1e-3, token_mask=mask)
    wgrad = K.router_z_loss_bwd(dead, wsaved, np.float32(1), 1e-3, n)
    np.testing.assert_array_equal(grad[mask].view(np.uint16), wgrad[mask].view(np.uint16))
    assert not grad[~mask].astype(np.float32).any()
    print("masked loss kernels at T=65536 E=384: PASS")


@pytest.mark.gpu
def test_masked_kernels_other_paths_on_the_gpu():
    """The masked paths the issue-shape test does not take, compiled for the
    GPU: the z-loss unit kernels (fp16, E = 100) counting (the final kernel
    takes the count) and with N given, the aux loss on fp32 column quads and
    its element backward (C = 102), each against the unmasked kernels on the
    dead / zeroed rows, bit for bit (T = 8192, every 7th token masked)."""
    T = 8192
    rng = np.random.default_rng(12)
    mask = np.arange(T) % 7 != 3
    n = int(mask.sum())
    x = (rng.standard_normal((T, 100)) * 3).astype(np.float16)
    dead = np.where(mask[:, None], x, np.asarray(-np.inf, np.float16))
    want, wsaved = K.router_z_loss_fwd(dead, 1e-3, n)
    loss, saved, got_n = K.router_z_loss_fwd(x, 1e-3, token_mask=mask, return_count=True)
    assert loss.tobytes() == want.tobytes() and got_n == n
    assert K.router_z_loss_fwd(x, 1e-3, n, token_mask=mask)[0].tobytes() == want.tobytes()
    grad = K.router_z_loss_bwd(x, saved, np.float32(1), 1e-3, token_mask=mask)
    wgrad = K.router_z_loss_bwd(dead, wsaved, np.float32(1), 1e-3, n)
    np.testing.assert_array_equal(grad[mask], wgrad[mask])
    assert not grad[~mask].any()
    for C in (384, 102):
        p = rng.random((T, C)).astype(np.float32)
        tpe = rng.integers(0, 512, C).astype(np.int32)
        want_aux, c = K.moe_aux_loss_fwd(np.where(mask[:, None], p, 0), tpe, 8, 1e-2, n)
        got_aux, got_c = K.moe_aux_loss_fwd(p, tpe, 8, 1e-2, token_mask=mask)
        assert got_aux.tobytes() == want_aux.tobytes() and got_c == c
        gp = K.moe_aux_loss_bwd(c, tpe, np.float32(1), T, token_mask=mask)
        np.testing.assert_array_equal(gp[mask], K.moe_aux_loss_bwd(c, tpe, np.float32(1), T)[mask])
        assert not gp[~mask].any()
    print("masked loss kernels, unit / quad / element paths: PASS")


@pytest.mark.gpu
@pytest.mark.parametrize("E", [256, 384])
def test_masked_aux_loss_at_scale_on_the_gpu(E):
    """DeepSeek-V3's E = 256 and Kimi-K2's 384, bf16, T = 65536, every 10th token
    masked (a NaN in the masked rows): the forward (its bf16 kernels under
    their register cap, 4 rows' loads in flight a trip), T counted and given,
    against the unmasked kernel on the zeroed rows, bit for bit; the masked
    quad fill's 8-row trips against the unmasked fill. GPU only: too big for
    the simulator."""
    T = 65536
    rng = np.random.default_rng(13)
    p = rng.random((T, E)).astype(ml_dtypes.bfloat16)
    p[9::10, 3] = np.asarray(np.nan, ml_dtypes.bfloat16)  # masked rows: never added
    tpe = rng.integers(0, 4096, E).astype(np.int32)
    mask = np.arange(T) % 10 != 9
    n = int(mask.sum())
    want, c = K.moe_aux_loss_fwd(np.where(mask[:, None], p, np.zeros((), ml_dtypes.bfloat16)), tpe, 8, 1e-2, n)
    for total in (None, n):
        got, got_c = K.moe_aux_loss_fwd(p, tpe, 8, 1e-2, total, token_mask=mask)
        assert got.tobytes() == want.tobytes() and got_c == c, total
    g = np.asarray(1.0, ml_dtypes.bfloat16)
    gp = K.moe_aux_loss_bwd(c, tpe, g, T, token_mask=mask)
    np.testing.assert_array_equal(gp[mask].view(np.uint16), K.moe_aux_loss_bwd(c, tpe, g, T)[mask].view(np.uint16))
    assert not gp[~mask].view(np.uint16).any()
