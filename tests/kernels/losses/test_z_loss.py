"""Kernel vs reference: ``router_z_loss_fwd/_bwd`` (GPU or the CUDA simulator).

The reference is ``gpurouter.reference.router_z_loss`` (its T is the rows it
sees: a ``total_num_tokens`` N > T scales it by T / N) and ``jax.grad`` of it;
``lse`` against a float64 NumPy logsumexp.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter.kernels._base import launch as L  # noqa: E402
from gpurouter.kernels._base import plan as _plan  # noqa: E402
from gpurouter.kernels._base import pointer as _pointer  # noqa: E402
from gpurouter.kernels.losses.tiling import ZLossTiling, z_loss_tiling, z_loss_vec_tiling  # noqa: E402
from gpurouter.testing.tolerances import assert_close  # noqa: E402

from ._z_helpers import COEFF, _check, _logits, _lse64, _lse_of, _reference  # noqa: E402

pytestmark = pytest.mark.cuda

BF16 = ml_dtypes.bfloat16
@pytest.mark.parametrize("dtype,T,E,total", [
    (np.float32, 5, 8, None),  # quads, one block
    # masked units of elements: 2 forward blocks (32 + 4 rows), 3 backward ones (16 + 16 + 4):
    # a partial last tile each (70 rows until 2026-11-28: the simulator's cost)
    (np.float32, 36, 130, 1000),
    (np.float32, 1, 3, None),
    (BF16, 5, 3, 7),
    (BF16, 70, 12, None),  # one lane per row, 70 rows in one block
    (np.float16, 1, 1, None),
    (np.float16, 5, 130, None),
    (np.float32, 0, 12, None),
    (BF16, 0, 3, 4),
    (BF16, 70, 24, 90),  # the vector kernels: 3 vectors a row
    (np.float16, 9, 24, 11),  # fp16 on the vector kernels (since 2026-11-29)
])
def test_fwd_bwd(dtype, T, E, total):
    _check(_logits(T, E, dtype, seed=T + E), total)


def test_empty_tokens():
    x = np.zeros((0, 12), np.float32)
    loss, lse = K.router_z_loss_fwd(x, 1.0)
    assert loss == 0.0 and lse.shape == (0,)
    assert K.router_z_loss_bwd(x, lse, 1.0, 1.0).shape == (0, 12)


@pytest.mark.parametrize("dtype,E", [(np.float32, 8), (BF16, 3), (np.float16, 12), (BF16, 16), (np.float16, 16)])
def test_special_rows(dtype, E):
    """An all -inf row (lse 0, no contribution, zero gradient), rows with some
    -inf, a single finite entry, and a NaN row (NaN lse, loss and gradient row)."""
    x = _logits(6, E, np.float32, seed=E, masked=0.3)
    x[1] = -np.inf
    x[2, :] = -np.inf
    x[2, E - 1] = 0.0  # lse exactly 0: a zero gradient too
    x = x.astype(dtype)
    loss, saved = K.router_z_loss_fwd(x, COEFF)
    lse = _lse_of(saved)
    assert lse[1] == 0.0 and lse[2] == 0.0
    rloss, rgrad = _reference(x, COEFF, 6, 2.0)
    assert_close(loss, rloss, "aux_loss", np.float32)
    assert_close(lse, _lse64(x).astype(np.float32), "probs", np.float32, err_msg="lse")
    grad = K.router_z_loss_bwd(x, saved, 2.0, COEFF)
    assert (np.asarray(grad[1:3], np.float32) == 0).all()
    assert_close(grad, rgrad.astype(dtype), "grads", dtype, E=E)

    xn = np.array(x)
    xn[4, E // 2] = np.nan
    loss, saved = K.router_z_loss_fwd(xn, COEFF)
    lse = _lse_of(saved)
    assert np.isnan(loss) and np.isnan(lse[4]) and not np.isnan(np.delete(lse, 4)).any()
    grad = np.asarray(K.router_z_loss_bwd(xn, saved, 2.0, COEFF), np.float32)
    assert np.isnan(grad[4]).all() and not np.isnan(np.delete(grad, 4, 0)).any()
    _, rgrad = _reference(xn, COEFF, 6, 2.0)
    assert np.isnan(rgrad[4]).all()
    assert_close(np.delete(grad, 4, 0), np.delete(rgrad.astype(dtype), 4, 0).astype(np.float32),
                 "grads", dtype, E=E)

    xnan_dead = np.full((2, E), -np.inf, np.float32)
    xnan_dead[0, 0] = np.nan  # NaN among -inf only: still NaN, not a dead row
    lse = _lse_of(K.router_z_loss_fwd(xnan_dead.astype(dtype), COEFF)[1])
    assert np.isnan(lse[0]) and lse[1] == 0.0


def small_tiles(threads, hold, lanes):
    """A ``ZLossTiling`` whose unit kernels (both ways) take ``threads``, ``hold`` and
    at most ``lanes``, so that tiny inputs take several blocks, partial tiles, several
    steps per lane and many lanes."""
    return ZLossTiling(threads=threads, bwd_threads=threads, hold=hold, bwd_hold=hold, max_lanes=lanes)


@pytest.mark.parametrize("dtype,T,E,knobs,want", [
    # E=12: 3 units, 2 lanes x 1 held unit: lane 0 steps twice; 16 rows per block, 5 blocks
    (np.float32, 70, 12, (32, 1, 2), (5, 32, 2)),
    # E=130: 33 masked units, 4 lanes x 2 held: 5 steps for lane 0, the last units clamped
    (BF16, 9, 130, (16, 2, 4), (3, 16, 4)),
    # E=8, one lane per row x 2 held units: 8 rows per block, a partial last tile
    (np.float16, 13, 8, (8, 2, 32), (2, 8, 1)),
])
def test_small_tiles(dtype, T, E, knobs, want):
    tiling = small_tiles(*knobs)
    assert z_loss_tiling(T, E, tiling=tiling)[:3] == want == z_loss_tiling(T, E, True, tiling)[:3]
    _check(_logits(T, E, dtype, seed=3), total=T + 3, tiling=tiling)


def test_deterministic():
    tiling = small_tiles(16, 1, 4)  # 4 rows per block: 18 partials
    x = _logits(70, 12, np.float32, seed=5)
    first = K.router_z_loss_fwd(x, 1.0, tiling=tiling)
    again = K.router_z_loss_fwd(x, 1.0, tiling=tiling)
    assert first[0].tobytes() == again[0].tobytes() and first[1].tobytes() == again[1].tobytes()
    g1 = K.router_z_loss_bwd(x, first[1], 0.5, 1.0, tiling=tiling)
    assert g1.tobytes() == K.router_z_loss_bwd(x, first[1], 0.5, 1.0, tiling=tiling).tobytes()


def test_plans():
    spec = _plan.spec_of((70, 256), L.BF16)
    fwd = K.router_z_loss_fwd_plan(spec, np.float32(COEFF), 100)
    assert fwd is K.router_z_loss_fwd_plan(spec, np.float32(COEFF), 100)  # cached
    assert fwd.ins == (spec,)
    assert fwd.outs == (_plan.Spec((), np.float32, L.F32), _plan.Spec((140,), np.float32, L.F32))  # (m, log2 s) pairs
    grid = z_loss_vec_tiling(70, 256, 2)[0]  # bf16 E = 256: the vector kernels
    assert fwd.tmps == (_plan.Spec((grid,), np.float32, L.F32),) and len(fwd.steps) == 1  # the finish inside
    unit = K.router_z_loss_fwd_plan(_plan.spec_of((70, 260), L.F16), np.float32(COEFF), 100)  # 520 bytes a row
    assert len(unit.steps) == 2 and not _plan.plan_counters(unit)  # unit kernels: rows, then the final block
    bwd = K.router_z_loss_bwd_plan(spec, np.float32(COEFF), 100)
    assert bwd.ins == (spec, _plan.spec_of((140,), L.F32), _plan.spec_of((), L.F32))
    assert bwd.outs == (spec,) and bwd.tmps == () and len(bwd.steps) == 1
    empty = _plan.spec_of((0, 3), L.F32)
    assert len(K.router_z_loss_fwd_plan(empty, np.float32(1), 1).steps) == 1  # the final block only
    assert K.router_z_loss_bwd_plan(empty, np.float32(1), 1).steps == ()


def test_device_arrays_out_and_stream():
    from numba import cuda

    x = _logits(5, 8, np.float32, seed=7)
    hloss, hlse = K.router_z_loss_fwd(x, COEFF)
    s = cuda.stream()
    h = getattr(s, "handle", None)  # the simulator's streams have none
    handle = 12345 if h is None else int(getattr(h, "value", h))
    outs = (cuda.device_array((), np.float32), cuda.device_array((10,), np.float32))  # the (m, log2 s) pairs
    dx = cuda.to_device(x)
    loss, lse = K.router_z_loss_fwd(dx, COEFF, out=outs, stream=handle)
    assert loss is outs[0] and lse is outs[1]
    s.synchronize()
    assert loss.copy_to_host() == hloss and lse.copy_to_host().tobytes() == hlse.tobytes()
    gout = cuda.device_array((5, 8), np.float32)
    g = cuda.to_device(np.asarray(1.5, np.float32))
    assert K.router_z_loss_bwd(dx, lse, g, COEFF, out=gout, stream=handle) is gout
    s.synchronize()
    np.testing.assert_array_equal(gout.copy_to_host(), K.router_z_loss_bwd(x, hlse, 1.5, COEFF))
    dbf = cuda.to_device(x.astype(BF16).view(np.uint16))  # bf16 on the device: its words
    dgrad = K.router_z_loss_bwd(dbf, K.router_z_loss_fwd(dbf, COEFF)[1], 1.5, COEFF)
    assert dgrad.dtype == np.uint16
    want = K.router_z_loss_bwd(x.astype(BF16), K.router_z_loss_fwd(x.astype(BF16), COEFF)[1], 1.5, COEFF)
    np.testing.assert_array_equal(dgrad.copy_to_host(), want.view(np.uint16))


def test_bad_input():
    x = _logits(3, 4, np.float32)
    with pytest.raises(ValueError, match="coeff"):
        K.router_z_loss_fwd(x, float("nan"))
    with pytest.raises(ValueError, match="total_num_tokens"):
        K.router_z_loss_fwd(x, 1.0, 0)
    with pytest.raises(TypeError, match="logits"):
        K.router_z_loss_fwd(x.astype(np.float64), 1.0)
    with pytest.raises(ValueError, match="num_experts"):
        K.router_z_loss_fwd(np.zeros((3, 0), np.float32), 1.0)
    with pytest.raises(ValueError, match="saved_lse"):
        K.router_z_loss_bwd(x, np.zeros(3, np.float32), 1.0, 1.0)  # the pairs: 2T
    with pytest.raises(TypeError, match="grad_loss"):
        K.router_z_loss_bwd(x, np.zeros(6, np.float32), np.asarray(1.0, BF16), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,T,E", [(BF16, 7168, 256), (np.float32, 2048, 128),
                                       (np.float16, 1031, 130), (BF16, 333, 8192), (np.float16, 7168, 256)])
def test_gpu_pointer_launch(dtype, T, E):
    """The plans through ``_base/pointer.PointerLaunch`` (the zero-copy transport's
    executor) at model shapes, against the reference and the numba executor;
    the forward bit-identical over runs."""
    from numba import cuda

    x = _logits(T, E, dtype, seed=11, masked=0.02)
    c = np.float32(1e-3)
    loss, lse, grad = _check(x, total=2 * T, coeff=float(c))
    spec = _plan.spec_of((T, E), L.kind_of_dtype(x.dtype, "logits", "test"))
    fwd = _pointer.PointerLaunch(K.router_z_loss_fwd_plan(spec, c, 2 * T), 0)
    bwd = _pointer.PointerLaunch(K.router_z_loss_bwd_plan(spec, c, 2 * T), 0)
    words = x.view(np.uint16) if dtype == BF16 else x
    dx = cuda.to_device(words)
    dloss, dlse = cuda.device_array((), np.float32), cuda.device_array((2 * T,), np.float32)
    part = cuda.device_array(K.router_z_loss_fwd_plan(spec, c, 2 * T).tmps[0].shape, np.float32)
    g = cuda.to_device(np.asarray(1.5, np.float32))
    dgrad = cuda.device_array((T, E), words.dtype)

    def ptr(a):
        return int(a.__cuda_array_interface__["data"][0])

    losses = []
    for _ in range(3):
        fwd([ptr(dx), ptr(dloss), ptr(dlse), ptr(part)], 0)
        cuda.synchronize()
        losses.append(dloss.copy_to_host().tobytes())
    assert len(set(losses)) == 1 and losses[0] == loss.tobytes()
    assert dlse.copy_to_host().tobytes() == lse.tobytes()
    bwd([ptr(dx), ptr(dlse), ptr(g), ptr(dgrad)], 0)
    cuda.synchronize()
    assert dgrad.copy_to_host().tobytes() == np.asarray(grad).view(words.dtype).tobytes()


def _large_logits(T, E, dtype, scale, seed):
    """Logits within a few units of ``scale`` (multiples of its spacing in
    ``dtype``), a row of ties and a half-masked row: a spread softmax."""
    rng = np.random.default_rng(seed)
    ulp = float(np.spacing(np.asarray(scale, dtype).astype(np.float32)))
    x = (np.float64(scale) + max(ulp, 1.0) * rng.integers(-2, 3, (T, E))).astype(np.float32)
    x[0] = scale
    x[1, : E // 2] = -np.inf
    return x.astype(dtype)


def _check_large(x, coeff=1e-3):
    """The backward against the float64 oracle at the contract's rtol, its atol
    scaled by the gradient's size (which grows with lse); the loss's lse too."""
    from gpurouter.testing import oracle as oracles

    loss, saved = K.router_z_loss_fwd(x, coeff)
    x32 = np.asarray(x, np.float32)
    np.testing.assert_allclose(_lse_of(saved), _lse64(x32), rtol=1e-6)
    grad = np.asarray(K.router_z_loss_bwd(x, saved, 1.0, coeff), np.float64)
    want = oracles.z_loss_grad(x32, coeff)
    rtol = 1e-4 if x.dtype == np.float32 else 1e-2
    atol = 1e-5 * np.sqrt(x.shape[1]) * np.abs(want).max()
    if x.dtype == np.float16:  # gradients below 2^-14 are fp16 subnormals, 2^-24 apart: a step of rounding
        atol = max(atol, 2.0 ** -24)
    np.testing.assert_allclose(grad, want, rtol=rtol, atol=atol)
    return loss, grad


@pytest.mark.parametrize("dtype,E", [(np.float32, 16), (np.float32, 13), (BF16, 16), (BF16, 12)])
@pytest.mark.parametrize("scale", [1e4, 1e8, 1e30])
def test_large_logits(dtype, E, scale):
    """Issue 40's W1 on the simulator, unit and vector kernels: the backward's
    softmax from the saved (max, log2 sum), accurate at any magnitude."""
    _check_large(_large_logits(5, E, dtype, scale, seed=E))


@pytest.mark.parametrize("dtype,E", [(np.float16, 16), (np.float16, 12)])
@pytest.mark.parametrize("scale", [1e3, 6e4])
def test_large_fp16_logits(dtype, E, scale):
    """W1 for fp16 (its largest finite logit is 65504), vector (E = 16) and unit
    kernels, and fp16 subnormal logits: exp(x - lse) of a value near 0."""
    _check_large(_large_logits(5, E, dtype, scale, seed=E))
    x = np.zeros((3, E), np.float32)
    x[0, 0] = 2.0 ** -24  # the smallest subnormal
    x[1, : E // 2] = 1023 * 2.0 ** -24  # the largest
    x[2, :] = -(2.0 ** -20)
    loss, grad = _check_large(x.astype(dtype))
    assert np.isfinite(loss) and np.isfinite(grad).all()


@pytest.mark.parametrize("dtype,E", [(BF16, 16), (BF16, 12), (np.float32, 16)])
def test_max_logits_give_inf_loss_and_finite_gradient(dtype, E):
    """Issue 40's W2: every logit the dtype's max (bf16 3.39e38): lse^2
    overflows fp32 (loss inf, as jnp), the gradient is finite."""
    big = np.asarray(ml_dtypes.finfo(BF16).max if dtype == BF16 else np.finfo(np.float32).max / 2, np.float32)
    x = np.full((2, E), big, np.float32).astype(dtype)
    loss, saved = K.router_z_loss_fwd(x, 1e-3)
    assert np.isinf(loss) and loss > 0
    grad = np.asarray(K.router_z_loss_bwd(x, saved, 1.0, 1e-3), np.float64)
    assert np.isfinite(grad).all()
    want = 2e-3 / 2 * float(big) / E  # 2 coeff / T * lse * (1 / E), lse ~ big
    np.testing.assert_allclose(grad, want, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,T,E", [(BF16, 4096, 256), (np.float32, 2048, 128), (BF16, 333, 8192),
                                       (np.float32, 1031, 130)])
@pytest.mark.parametrize("scale", [1e2, 1e4, 1e8, 1e30])
def test_gpu_large_logits(dtype, T, E, scale):
    """W1 at model shapes on the GPU (the vector kernels and the unit kernels)."""
    _check_large(_large_logits(T, E, dtype, scale, seed=T))


@pytest.mark.gpu
@pytest.mark.parametrize("T,E", [(4096, 256), (1031, 384), (1031, 130)])
@pytest.mark.parametrize("scale", [1e2, 1e4, 6e4])
def test_gpu_large_fp16_logits(T, E, scale):
    """W1 for fp16 at model shapes (vector kernels at E = 256, 384; unit at 130),
    up to near its largest finite logit, 65504."""
    _check_large(_large_logits(T, E, np.float16, scale, seed=T))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,T,E", [(BF16, 4096, 256), (BF16, 1031, 130)])
def test_gpu_max_logits(dtype, T, E):
    """W2 on the GPU: loss inf, gradient finite and 2 coeff / T * lse / E."""
    big = np.asarray(ml_dtypes.finfo(BF16).max, np.float32)
    x = np.full((T, E), big, np.float32).astype(dtype)
    loss, saved = K.router_z_loss_fwd(x, 1e-3)
    assert np.isinf(loss) and loss > 0
    grad = np.asarray(K.router_z_loss_bwd(x, saved, 1.0, 1e-3), np.float64)
    assert np.isfinite(grad).all()
    np.testing.assert_allclose(grad, 2e-3 / T * float(big) / E, rtol=1e-2)
