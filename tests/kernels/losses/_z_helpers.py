"""Helpers shared by the z-loss kernel tests (test_z_loss.py, test_z_loss_vec.py):
the inputs, the float64 logsumexp, the reference's loss and gradient, and one
forward + backward checked against them. Imported only after the tests'
``importorskip`` of the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpurouter import kernels as K
from gpurouter import reference as ref
from gpurouter.testing.tolerances import assert_close

COEFF = 0.01


def _logits(T, E, dtype, seed=0, masked=0.1):
    """[T, E] normal * 3 logits of ``dtype`` with a fraction ``masked`` of -inf."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    x[rng.random((T, E)) < masked] = -np.inf
    x[:, 0] = np.where(np.isneginf(x).all(-1), np.float32(0.5), x[:, 0])  # no dead rows by accident
    return x.astype(dtype)


def _lse64(x):
    """float64 logsumexp of each row, 0 for an all -inf row, NaN for a NaN row."""
    x = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.max(x, -1, keepdims=True)
        shift = np.where(np.isneginf(m), 0.0, m)
        lse = (np.log(np.sum(np.exp(x - shift), -1, keepdims=True)) + shift)[..., 0]
    return np.where(np.isneginf(m[..., 0]), 0.0, lse)


def _lse_of(saved):
    """The lse of the forward's saved ``(m, log2 s)`` pairs (``[2T]``: the maxima,
    then the log sums), in fp32 as the kernels take it (``logsumexp.lse_of_saved``)."""
    saved = np.asarray(saved, np.float32)
    t = saved.shape[0] // 2
    m, lg = saved[:t], saved[t:]
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(m), lg, m + lg * np.float32(np.log(2.0))).astype(np.float32)


def _reference(x, coeff, total, g):
    """(loss, grad_logits) of the reference with N = ``total``: the reference
    divides by its own T, so it is scaled by T / N (exact in the gradient's
    tolerance; the loss is compared at rtol 1e-5)."""
    T = x.shape[0]
    scale = np.float32(T / total) if T else np.float32(0)

    def f(y):
        return ref.router_z_loss(y, coeff) * scale

    xj = jnp.asarray(x)
    loss, vjp = jax.vjp(f, xj)
    (grad,) = vjp(jnp.asarray(g, jnp.float32))
    return np.asarray(loss), np.asarray(grad)


def _check(x, total=None, g=1.5, coeff=COEFF, tiling=None):
    T, E = x.shape
    n = max(T, 1) if total is None else total
    loss, saved = K.router_z_loss_fwd(x, coeff, total, tiling=tiling)
    assert loss.shape == () and loss.dtype == np.float32
    assert saved.shape == (2 * T,) and saved.dtype == np.float32
    rloss, rgrad = _reference(x, coeff, n, g)
    assert_close(loss, rloss, "aux_loss", np.float32, err_msg="z-loss")  # fp32 from the same inputs
    assert_close(_lse_of(saved), _lse64(x).astype(np.float32), "probs", np.float32, err_msg="lse")
    grad = K.router_z_loss_bwd(x, saved, g, coeff, total, tiling=tiling)
    assert grad.shape == x.shape and grad.dtype == x.dtype
    assert_close(grad, rgrad.astype(x.dtype), "grads", x.dtype, E=E, err_msg="z-loss grad")
    return loss, saved, grad
