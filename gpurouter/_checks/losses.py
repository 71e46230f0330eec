"""The rules of the losses: the switch aux loss (``fused_moe_aux_loss``),
the router z-loss and the aux-loss-free expert-bias update."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import (
    _TPE_NAMES,
    _as_finite_float,
    _as_int,
    _dtype_name,
    _is_traced,
    check_float_dtype,
    is_float_dtype,
)
from .variants import check_traced_token_count

AUX_LOSS_OP = "fused_moe_aux_loss"
Z_LOSS_OP = "router_z_loss"
BIAS_UPDATE_OP = "update_expert_bias"


@dataclass(frozen=True)
class AuxLossConfig:
    """Validated, hashable static configuration of one aux-loss call."""

    topk: int
    coeff: float
    total_num_tokens: int
    num_experts: int


def _float_scalar(value) -> bool:
    """A concrete 0-d float array (jax or NumPy) or NumPy float scalar: a device
    scalar such as TE's graph-safe aux loss takes (contract section 10)."""
    dtype = getattr(value, "dtype", None)
    return (not isinstance(value, (bool, int, float)) and dtype is not None
            and getattr(value, "shape", None) == () and is_float_dtype(dtype))


def _total_tokens(op: str, total_num_tokens, rows: int) -> int | np.float32:
    """An explicit ``total_num_tokens``: > 0, or 0 with no rows (the loss of no
    tokens is the empty sum, 0.0, with or without the count: T = 1 keeps the
    coefficient finite). A concrete 0-d float array is checked the same way
    (finite too) and returned as a float32 value, which the ops pass on as a
    device scalar, as a traced one (no compile per value)."""
    if _float_scalar(total_num_tokens):
        value = np.float32(total_num_tokens)
        if value == 0 and rows == 0:
            return 1
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"{op}: total_num_tokens ({float(value)}) must be finite and > 0 "
                             f"(or 0 with no tokens; there are {rows}).")
        return value
    total_num_tokens = _as_int(op, "total_num_tokens", total_num_tokens)
    if total_num_tokens == 0 and rows == 0:
        return 1
    if total_num_tokens <= 0:
        raise ValueError(f"{op}: total_num_tokens ({total_num_tokens}) must be > 0 "
                         f"(or 0 with no tokens; there are {rows}).")
    return total_num_tokens


def check_aux_loss_args(
    probs_shape: tuple[int, ...],
    probs_dtype,
    tpe_shape: tuple[int, ...],
    tpe_dtype,
    topk,
    coeff,
    total_num_tokens,
    num_experts,
    op: str = AUX_LOSS_OP,
) -> AuxLossConfig:
    """Checks the arguments of ``fused_moe_aux_loss``; returns the config."""
    if len(probs_shape) != 2:
        raise ValueError(
            f"{op}: probs shape {tuple(probs_shape)} must have rank 2 ([num_tokens, num_cols])."
        )
    check_float_dtype(op, "probs", probs_dtype)
    rows, cols = probs_shape
    if cols == 0:
        raise ValueError(f"{op}: num_cols (probs.shape[1] = 0) must be >= 1.")
    if tuple(tpe_shape) != (cols,):
        raise ValueError(
            f"{op}: tokens_per_expert shape {tuple(tpe_shape)} must be (num_cols,) = ({cols},)."
        )
    got = _dtype_name(tpe_dtype)
    if got not in _TPE_NAMES:
        raise TypeError(
            f"{op}: tokens_per_expert must be int32, int64, float32 or bfloat16, got {got}."
        )
    topk = _as_int(op, "topk", topk)
    if topk < 1:
        raise ValueError(f"{op}: topk ({topk}) must be >= 1.")
    coeff = _as_finite_float(op, "coeff", coeff)
    if num_experts is None:
        num_experts = cols
    num_experts = _as_int(op, "num_experts", num_experts)
    if num_experts < 1:
        raise ValueError(f"{op}: num_experts ({num_experts}) must be >= 1.")
    if topk > num_experts:
        raise ValueError(f"{op}: topk ({topk}) must be <= num_experts ({num_experts}).")
    if cols % num_experts != 0:
        raise ValueError(
            f"{op}: num_cols (probs.shape[1] = {cols}) must be a multiple of "
            f"num_experts ({num_experts})."
        )
    if total_num_tokens is None:
        # No tokens and no count: the loss is an empty sum, 0. T = 1 keeps C
        # finite (C * 0 = 0, and the gradient is [0, C]) instead of 0/0.
        total_num_tokens = max(rows, 1)
    if _is_traced(total_num_tokens):  # a device scalar (contract section 10): used as it is
        return AuxLossConfig(topk=topk, coeff=coeff, num_experts=num_experts,
                             total_num_tokens=check_traced_token_count(op, total_num_tokens))
    total_num_tokens = _total_tokens(op, total_num_tokens, rows)
    return AuxLossConfig(
        topk=topk, coeff=coeff, total_num_tokens=total_num_tokens, num_experts=num_experts
    )


def check_z_loss_args(logits_shape, logits_dtype, coeff, total_num_tokens, shards: int = 1,
                      op: str = Z_LOSS_OP) -> tuple[float, int]:
    """Checks ``router_z_loss``'s arguments; returns ``(coeff, T)``, ``T``
    defaulting to the rows times ``shards`` (1 when there are no rows: the
    loss of no tokens is 0, not 0/0)."""
    if len(logits_shape) == 0:
        raise ValueError(f"{op}: logits rank (0) must be >= 1 (logits are [..., num_experts]).")
    check_float_dtype(op, "logits", logits_dtype)
    if logits_shape[-1] == 0:
        raise ValueError(f"{op}: num_experts (logits.shape[-1] = 0) must be >= 1.")
    coeff = _as_finite_float(op, "coeff", coeff)
    if total_num_tokens is None:
        return coeff, max(int(np.prod(logits_shape[:-1])) * shards, 1)
    if _is_traced(total_num_tokens):  # a device scalar (contract section 10): used as it is
        return coeff, check_traced_token_count(op, total_num_tokens)
    return coeff, _total_tokens(op, total_num_tokens, int(np.prod(logits_shape[:-1])))


def check_bias_update_args(bias_shape, bias_dtype, tpe_shape, tpe_dtype, rate,
                           op: str = BIAS_UPDATE_OP) -> None:
    """Checks ``update_expert_bias``'s arguments (``rate`` may be a traced scalar)."""
    if len(bias_shape) != 1 or bias_shape[0] == 0:
        raise ValueError(f"{op}: expert_bias shape {tuple(bias_shape)} must be (num_experts,), num_experts >= 1.")
    check_float_dtype(op, "expert_bias", bias_dtype)
    if tuple(tpe_shape) != tuple(bias_shape):
        raise ValueError(f"{op}: tokens_per_expert shape {tuple(tpe_shape)} must be (num_experts,) = "
                         f"{tuple(bias_shape)}.")
    got = _dtype_name(tpe_dtype)
    if got not in _TPE_NAMES + ("float16", "float64", "uint32", "int16", "uint8"):
        raise TypeError(f"{op}: tokens_per_expert must be integer or float counts, got {got}.")
    if _is_traced(rate) or hasattr(rate, "shape"):
        if tuple(getattr(rate, "shape", ())) != ():
            raise ValueError(f"{op}: rate shape {tuple(rate.shape)} must be () (a scalar).")
        return
    _as_finite_float(op, "rate", rate)
