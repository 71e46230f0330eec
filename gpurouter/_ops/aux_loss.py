"""Public aux-loss op: backend choice and the ``jax.custom_vjp`` around the kernels."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _backend, reference
from .._auto import kernels_faster as kernels_faster_here
from .._checks import (
    AUX_LOSS_OP,
    AuxLossConfig,
    array_meta,
    check_aux_loss_args,
    check_kernel_dtype,
    check_transport,
)
from .._host import aux_loss_coeff
from .._sharding import per_row_shard_sum, token_axes
from .._transport import kernel_call, prefetch, resolve_transport


def fused_moe_aux_loss(
    probs: jax.typing.ArrayLike,
    tokens_per_expert: jax.typing.ArrayLike,
    topk: int,
    coeff: float,
    *,
    total_num_tokens: int | jax.typing.ArrayLike | None = None,
    num_experts: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    token_mask: jax.typing.ArrayLike | None = None,
    backend: str = "auto",
    transport: str = "auto",
) -> jax.Array:
    """Switch load-balancing aux loss; drop-in for TE's JAX ``fused_moe_aux_loss``.

    Same arguments and result as :func:`gpurouter.reference.fused_moe_aux_loss`
    (see its docstring for the formula), plus:

    Args:
      axis_name: see the reference; inside ``shard_map`` over token shards.
      backend: ``"jax"``, ``"numba"`` or ``"auto"`` (docs/contract.md section 5).
      transport: ``"ffi"``, ``"zero-copy"``, ``"callback"`` or ``"auto"``, as for
        :func:`gpurouter.fused_topk_with_score_function`.

    The numba forward is deterministic: bit-identical from run to run. Under
    ``jit`` with token-sharded ``probs`` (explicit sharding) every backend
    runs per shard and all-reduces the partial losses. ``total_num_tokens``
    is a Python int or a traced scalar (docs/contract.md section 10; no
    retrace per value); under ``axis_name`` it defaults to the static global
    count, or with ``token_mask`` to the global valid count (traced).
    With ``token_mask``, ``backend="numba"`` gives the mask to the kernels
    (compiled with ``has_mask``): masked rows are left out of the column sums
    and get a zero gradient, and ``T`` (traced or not) is a device scalar by
    which the kernel divides C twice (C's division order). A traced ``T``
    without a mask runs the kernel with ``T = 1`` on float32 probs and
    divides by ``T`` twice after.

    Raises:
      ValueError, TypeError: bad shapes, config or dtypes (at trace time), or
        an ``axis_name`` not bound by an enclosing ``shard_map``/``vmap``.
      ImportError, RuntimeError: as for
        :func:`gpurouter.fused_topk_with_score_function`.
    """
    mask = None
    counted = False  # the kernel counts the valid rows (T defaults to the count, one device, no axis)
    if token_mask is not None and backend == "numba":  # the kernels take the mask ("auto" with a mask: jax)
        counted = total_num_tokens is None and axis_name is None and token_axes(jnp.asarray(probs)) is None
        mask, total_num_tokens = reference.checked_mask(AUX_LOSS_OP, probs, token_mask, total_num_tokens,
                                                        axis_name)
    else:
        probs, total_num_tokens = reference.mask_rows(AUX_LOSS_OP, probs, token_mask, total_num_tokens,
                                                      axis_name, 0)
    tokens_per_expert, total_num_tokens = reference.global_counts(
        AUX_LOSS_OP, probs, tokens_per_expert, total_num_tokens, axis_name)
    probs_meta = array_meta(AUX_LOSS_OP, "probs", probs)
    cfg = check_aux_loss_args(
        *probs_meta,
        *array_meta(AUX_LOSS_OP, "tokens_per_expert", tokens_per_expert),
        topk, coeff, total_num_tokens, num_experts,
    )
    check_transport(AUX_LOSS_OP, transport)  # validated whatever the backend
    probs = jnp.asarray(probs)
    tokens_per_expert = jnp.asarray(tokens_per_expert)
    traced = not isinstance(cfg.total_num_tokens, int)  # a device scalar: an argument, not config
    def kernels_faster() -> bool:  # "auto": the measured rule (gpurouter/_auto.py)
        return probs_meta[1] != np.float64 and not traced and kernels_faster_here(
            AUX_LOSS_OP, transport, probs.shape[0], probs.shape[1])

    if _backend.resolve(AUX_LOSS_OP, backend, faster=kernels_faster) == "jax":
        def loss(p, t, total=cfg.total_num_tokens):
            return reference.fused_moe_aux_loss(
                p, t, topk, coeff, total_num_tokens=total, num_experts=cfg.num_experts)
    else:
        transport = resolve_transport(AUX_LOSS_OP, transport)
        check_kernel_dtype(AUX_LOSS_OP, "probs", probs_meta[1])  # the caller's dtype, before jnp's cast

        if counted:
            return _aux_loss_counted(probs, tokens_per_expert, mask, cfg, transport)
        if mask is not None:
            # the mask sharded with the rows; T (fp32, the global count) and the counts replicated
            n = jnp.asarray(cfg.total_num_tokens, jnp.float32)
            return per_row_shard_sum(lambda p, m, t, c: _aux_loss_masked(p, t, m, c, cfg, transport),
                                     probs, [tokens_per_expert, n], [mask])

        def loss(p, t, total=None):
            if total is None:
                return _aux_loss(p, t, cfg, transport)
            # C = ((E coeff) / k) / T / T: the kernel with T = 1, then / T / T
            once = dataclasses.replace(cfg, total_num_tokens=1)
            t32 = total.astype(jnp.float32)
            return ((_aux_loss(p.astype(jnp.float32), t, once, transport) / t32) / t32).astype(p.dtype)

    # Token-sharded probs: per-shard partial losses, all-reduced (_sharding.py).
    extra = [jnp.asarray(cfg.total_num_tokens)] if traced else []
    return per_row_shard_sum(loss, probs, [tokens_per_expert, *extra])


def _fwd_plan(cfg: AuxLossConfig, probs, tokens_per_expert):
    from ..kernels.losses.aux_loss import moe_aux_loss_fwd_plan

    rows, cols = probs.shape
    c = aux_loss_coeff(cols if cfg.num_experts is None else cfg.num_experts, cfg.coeff, cfg.topk,
                       rows if cfg.total_num_tokens is None else cfg.total_num_tokens)
    return moe_aux_loss_fwd_plan(probs, tokens_per_expert, c)


def _bwd_plan(num_rows: int, saved_coeff, tokens_per_expert, grad_loss):
    from ..kernels.losses.aux_loss import moe_aux_loss_bwd_plan

    return moe_aux_loss_bwd_plan(tokens_per_expert, grad_loss, num_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _aux_loss(probs, tokens_per_expert, cfg: AuxLossConfig, transport: str):
    return _aux_loss_fwd(probs, tokens_per_expert, cfg, transport)[0]


def _aux_loss_vjp_fwd(probs, tokens_per_expert, cfg: AuxLossConfig, transport: str):
    """Under a gradient: the backward's kernels start compiling first (``_transport.prefetch``)."""
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    prefetch(functools.partial(_bwd_plan, probs.shape[0]),
             [scalar, tokens_per_expert, jax.ShapeDtypeStruct((), probs.dtype)])
    return _aux_loss_fwd(probs, tokens_per_expert, cfg, transport)


def _aux_loss_fwd(probs, tokens_per_expert, cfg: AuxLossConfig, transport: str):
    specs = (jax.ShapeDtypeStruct((), probs.dtype), jax.ShapeDtypeStruct((), jnp.float32))
    loss, saved_coeff = kernel_call(functools.partial(_fwd_plan, cfg), specs, [],
        [probs, tokens_per_expert], transport,
    )
    # An empty [T, 0] array carries the row count and dtype of probs into the
    # backward (residuals must be arrays; it also follows vmap's batching).
    like = jnp.zeros((probs.shape[0], 0), probs.dtype)
    return loss, (saved_coeff, tokens_per_expert, like)


def _aux_loss_bwd(cfg: AuxLossConfig, transport: str, res, grad_loss):
    saved_coeff, tokens_per_expert, like = res
    num_rows, dtype = like.shape[0], like.dtype
    spec = jax.ShapeDtypeStruct((num_rows, tokens_per_expert.shape[0]), dtype)
    (grad_probs,) = kernel_call(functools.partial(_bwd_plan, num_rows), [spec], [],
        [saved_coeff, tokens_per_expert, grad_loss.astype(dtype)], transport,
    )
    return grad_probs, None


_aux_loss.defvjp(_aux_loss_vjp_fwd, _aux_loss_bwd)


# The masked kernels (has_mask): inputs (probs, tokens_per_expert, mask bool [T], n fp32 ()); C on the device.


def _fwd_plan_masked(cfg: AuxLossConfig, probs, tokens_per_expert, mask, n):
    from ..kernels.losses.aux_loss import aux_loss_partial_coeff, moe_aux_loss_fwd_plan

    num_experts = probs.shape[1] if cfg.num_experts is None else cfg.num_experts
    return moe_aux_loss_fwd_plan(probs, tokens_per_expert, aux_loss_partial_coeff(num_experts, cfg.coeff, cfg.topk),
                                 None, True)


def _bwd_plan_masked(num_rows: int, saved_coeff, tokens_per_expert, grad_loss, mask):
    from ..kernels.losses.aux_loss import moe_aux_loss_bwd_plan

    return moe_aux_loss_bwd_plan(tokens_per_expert, grad_loss, num_rows, None, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _aux_loss_masked(probs, tokens_per_expert, mask, n, cfg: AuxLossConfig, transport: str):
    return _aux_loss_masked_fwd(probs, tokens_per_expert, mask, n, cfg, transport)[0]


def _aux_loss_masked_fwd(probs, tokens_per_expert, mask, n, cfg: AuxLossConfig, transport: str):
    specs = (jax.ShapeDtypeStruct((), probs.dtype), jax.ShapeDtypeStruct((), jnp.float32))
    loss, saved_coeff = kernel_call(functools.partial(_fwd_plan_masked, cfg), specs, [],
        [probs, tokens_per_expert, mask, n], transport,
    )
    like = jnp.zeros((probs.shape[0], 0), probs.dtype)  # the rows and dtype of probs (as _aux_loss_fwd)
    return loss, (saved_coeff, tokens_per_expert, mask, like)


def _aux_loss_masked_bwd(cfg: AuxLossConfig, transport: str, res, grad_loss):
    saved_coeff, tokens_per_expert, mask, like = res
    num_rows, dtype = like.shape[0], like.dtype
    spec = jax.ShapeDtypeStruct((num_rows, tokens_per_expert.shape[0]), dtype)
    (grad_probs,) = kernel_call(functools.partial(_bwd_plan_masked, num_rows), [spec],
        [], [saved_coeff, tokens_per_expert, grad_loss.astype(dtype), mask], transport,
    )
    return grad_probs, None, None, None


_aux_loss_masked.defvjp(_aux_loss_masked_fwd, _aux_loss_masked_bwd)


# T the valid count, counted by the forward kernel (C, saved for the backward, has it).


def _fwd_plan_counted(cfg: AuxLossConfig, probs, tokens_per_expert, mask):
    from ..kernels.losses.aux_loss import aux_loss_partial_coeff, moe_aux_loss_fwd_plan

    num_experts = probs.shape[1] if cfg.num_experts is None else cfg.num_experts
    return moe_aux_loss_fwd_plan(probs, tokens_per_expert, aux_loss_partial_coeff(num_experts, cfg.coeff, cfg.topk),
                                 None, True, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _aux_loss_counted(probs, tokens_per_expert, mask, cfg: AuxLossConfig, transport: str):
    return _aux_loss_counted_fwd(probs, tokens_per_expert, mask, cfg, transport)[0]


def _aux_loss_counted_fwd(probs, tokens_per_expert, mask, cfg: AuxLossConfig, transport: str):
    specs = (jax.ShapeDtypeStruct((), probs.dtype), jax.ShapeDtypeStruct((), jnp.float32))
    loss, saved_coeff = kernel_call(functools.partial(_fwd_plan_counted, cfg), specs, [],
        [probs, tokens_per_expert, mask], transport,
    )
    like = jnp.zeros((probs.shape[0], 0), probs.dtype)
    return loss, (saved_coeff, tokens_per_expert, mask, like)


def _aux_loss_counted_bwd(cfg: AuxLossConfig, transport: str, res, grad_loss):
    return _aux_loss_masked_bwd(cfg, transport, res, grad_loss)[:3]


_aux_loss_counted.defvjp(_aux_loss_counted_fwd, _aux_loss_counted_bwd)
