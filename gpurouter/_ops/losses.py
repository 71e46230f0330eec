"""Public router z-loss (backend choice, ``jax.custom_vjp`` around the kernels)
and the expert-bias update (pure jnp on every backend)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _backend, reference
from .._checks import Z_LOSS_OP, array_meta, check_kernel_dtype, check_transport, check_z_loss_args
from .._sharding import axis_size, per_row_shard_sum, token_axes
from .._transport import kernel_call, prefetch, resolve_transport
from ..reference.losses import update_expert_bias as update_expert_bias


def router_z_loss(
    logits: jax.typing.ArrayLike,
    coeff: float,
    *,
    total_num_tokens: int | jax.typing.ArrayLike | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    token_mask: jax.typing.ArrayLike | None = None,
    backend: str = "auto",
    transport: str = "auto",
) -> jax.Array:
    """Router z-loss of ST-MoE: ``coeff * mean_t(logsumexp_e(logits[t])^2)``, float32.

    Same arguments and result as :func:`gpurouter.reference.router_z_loss`
    (docs/losses.md: what ``T`` is under sharding and micro-batching), plus
    ``backend`` (``"jax"``, ``"numba"``: a deterministic row kernel and an
    elementwise backward, or ``"auto"``: jax, the kernels have no end-to-end
    measurement yet) and ``transport`` as for
    :func:`gpurouter.fused_topk_with_score_function`.

    Under ``jit`` with token-sharded ``logits`` (explicit sharding) every
    backend computes each shard's share and all-reduces it; inside
    ``shard_map`` pass ``axis_name`` and sum the shares yourself (``psum``).

    ``token_mask`` and a traced ``total_num_tokens`` (docs/contract.md
    section 10): ``T`` defaults to the global valid count. On the jax
    backend masked rows become all ``-inf`` rows (which add 0 and get no
    gradient). On numba the mask goes into the kernels (compiled with
    ``has_mask``): their squares are left out, their gradient is 0 whatever
    they hold, and ``T`` (traced or not) is a device scalar the kernels
    divide by. A traced ``T`` without a mask runs the kernel with ``coeff =
    1, T = 1`` (the sum of the squares) and ``coeff * (sum / T)`` after it.
    """
    shape, dtype = array_meta(Z_LOSS_OP, "logits", logits)
    use_jax = _backend.resolve(Z_LOSS_OP, backend) == "jax"
    mask = None
    counted = False  # the kernels count the valid rows (T defaults to the count, one device, no axis)
    if token_mask is not None and not use_jax:  # the kernels take the mask
        counted = total_num_tokens is None and axis_name is None and token_axes(jnp.asarray(logits)) is None
        mask, total_num_tokens = reference.checked_mask(Z_LOSS_OP, logits, token_mask, total_num_tokens,
                                                        axis_name, "logits")
    else:
        logits, total_num_tokens = reference.mask_rows(Z_LOSS_OP, logits, token_mask, total_num_tokens,
                                                       axis_name, -jnp.inf)
    coeff, total = check_z_loss_args(shape, dtype, coeff, total_num_tokens, axis_size(Z_LOSS_OP, axis_name))
    check_transport(Z_LOSS_OP, transport)
    x = jnp.asarray(logits).reshape(-1, shape[-1])
    traced = not isinstance(total, int)  # a device scalar: an argument, not config
    # Under a token-sharded jit each shard's rows see the global T: shares.
    if use_jax:
        def loss(rows, t=total):
            return reference.router_z_loss(rows, coeff, total_num_tokens=t)
    elif mask is not None:
        transport = resolve_transport(Z_LOSS_OP, transport)
        check_kernel_dtype(Z_LOSS_OP, "logits", dtype)
        if x.shape[0] == 0:
            return jnp.zeros((), jnp.float32)
        if counted:
            return _z_loss_counted(x, mask, np.float32(coeff), transport)
        # the mask is sharded with the rows, T (fp32, the global count) replicated
        n = jnp.asarray(total, jnp.float32)
        return per_row_shard_sum(lambda rows, m, t: _z_loss_masked(rows, m, t, np.float32(coeff), transport),
                                 x, [n], [mask])
    else:
        transport = resolve_transport(Z_LOSS_OP, transport)
        check_kernel_dtype(Z_LOSS_OP, "logits", dtype)

        def loss(rows, t=None):
            if t is None:
                return _z_loss(rows, np.float32(coeff), total, transport)
            squares = _z_loss(rows, np.float32(1.0), 1, transport)
            return jnp.float32(coeff) * (squares / t.astype(jnp.float32))

    if x.shape[0] == 0:
        return jnp.zeros((), jnp.float32)
    # Token-sharded logits: per-shard shares, all-reduced (_sharding.py).
    return per_row_shard_sum(loss, x, [jnp.asarray(total)] if traced else [])


def _fwd_plan(coeff, total, logits):
    from ..kernels.losses.z_loss import router_z_loss_fwd_plan

    return router_z_loss_fwd_plan(logits, coeff, total)


def _bwd_plan(coeff, total, logits, lse, grad_loss):
    from ..kernels.losses.z_loss import router_z_loss_bwd_plan

    return router_z_loss_bwd_plan(logits, coeff, total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _z_loss(x, coeff: np.float32, total: int, transport: str):
    return _z_loss_fwd(x, coeff, total, transport)[0]


def _z_loss_vjp_fwd(x, coeff: np.float32, total: int, transport: str):
    """Under a gradient: the backward's kernels start compiling first (``_transport.prefetch``)."""
    lse = jax.ShapeDtypeStruct((2 * x.shape[0],), jnp.float32)
    prefetch(functools.partial(_bwd_plan, coeff, total), [x, lse, jax.ShapeDtypeStruct((), jnp.float32)])
    return _z_loss_fwd(x, coeff, total, transport)


def _z_loss_fwd(x, coeff: np.float32, total: int, transport: str):
    # the saved pair of every row (its max, then log2 of its sum): kernels/losses/z_loss.py
    specs = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2 * x.shape[0],), jnp.float32))
    loss, lse = kernel_call(functools.partial(_fwd_plan, coeff, total), specs, [], [x], transport)
    return loss, (x, lse)


def _z_loss_bwd(coeff: np.float32, total: int, transport: str, res, grad_loss):
    x, lse = res
    (grad,) = kernel_call(functools.partial(_bwd_plan, coeff, total),
                          [jax.ShapeDtypeStruct(x.shape, x.dtype)], [], [x, lse, grad_loss.astype(jnp.float32)],
                          transport)
    return (grad,)


_z_loss.defvjp(_z_loss_vjp_fwd, _z_loss_bwd)


# The masked kernels (has_mask): inputs (x, mask bool [T], n fp32 ()), N on the device.


def _fwd_plan_masked(coeff, logits, mask, n):
    from ..kernels.losses.z_loss import router_z_loss_fwd_plan

    return router_z_loss_fwd_plan(logits, coeff, 1, None, True)


def _bwd_plan_masked(coeff, logits, lse, grad_loss, mask, n):
    from ..kernels.losses.z_loss import router_z_loss_bwd_plan

    return router_z_loss_bwd_plan(logits, coeff, 1, None, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _z_loss_masked(x, mask, n, coeff: np.float32, transport: str):
    return _z_loss_masked_fwd(x, mask, n, coeff, transport)[0]


def _z_loss_masked_fwd(x, mask, n, coeff: np.float32, transport: str):
    specs = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2 * x.shape[0],), jnp.float32))
    loss, lse = kernel_call(functools.partial(_fwd_plan_masked, coeff), specs, [], [x, mask, n], transport)
    return loss, (x, lse, mask, n)


def _z_loss_masked_bwd(coeff: np.float32, transport: str, res, grad_loss):
    x, lse, mask, n = res
    (grad,) = kernel_call(functools.partial(_bwd_plan_masked, coeff),
                          [jax.ShapeDtypeStruct(x.shape, x.dtype)], [],
                          [x, lse, grad_loss.astype(jnp.float32), mask, n], transport)
    return grad, None, None


_z_loss_masked.defvjp(_z_loss_masked_fwd, _z_loss_masked_bwd)


# T the valid count, counted by the forward kernels (a third output, N, for the backward).


def _fwd_plan_counted(coeff, logits, mask):
    from ..kernels.losses.z_loss import router_z_loss_fwd_plan

    return router_z_loss_fwd_plan(logits, coeff, 1, None, True, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _z_loss_counted(x, mask, coeff: np.float32, transport: str):
    return _z_loss_counted_fwd(x, mask, coeff, transport)[0]


def _z_loss_counted_fwd(x, mask, coeff: np.float32, transport: str):
    specs = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2 * x.shape[0],), jnp.float32),
             jax.ShapeDtypeStruct((), jnp.float32))
    loss, lse, n = kernel_call(functools.partial(_fwd_plan_counted, coeff), specs, [], [x, mask], transport)
    return loss, (x, lse, mask, n)


def _z_loss_counted_bwd(coeff: np.float32, transport: str, res, grad_loss):
    return _z_loss_masked_bwd(coeff, transport, res, grad_loss)[:2]


_z_loss_counted.defvjp(_z_loss_counted_fwd, _z_loss_counted_bwd)

__all__ = ["router_z_loss", "update_expert_bias"]
