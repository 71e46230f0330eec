"""The rules of the MoE block ``moe`` (gpurouter/moe.py, gpurouter/reference/moe.py):
its shapes and configuration in TE's weight layouts, and its arguments in its
own terms before any op it calls sees them."""

from __future__ import annotations

from .common import (
    _as_bool,
    _as_finite_float,
    _as_int,
    array_meta,
    check_float_dtype,
    score_function_of,
)

MOE_OP = "moe"
MOE_ACTIVATIONS = ("silu", "gelu", "relu", "linear")


def check_moe_args(x_shape, gate_shape, wi_0_shape, wi_1_shape, wo_shape, b0_shape, b1_shape, bo_shape,
                   num_experts, num_experts_per_tok, activation_type, align_size, ep_shards: int = 1,
                   op: str = MOE_OP) -> None:
    """Checks the MoE block's shapes and config (TE's weight layouts; with
    expert parallelism over ``ep_shards`` devices the expert weights are this
    device's ``num_experts / ep_shards``)."""
    e = _as_int(op, "num_experts", num_experts)
    k = _as_int(op, "num_experts_per_tok", num_experts_per_tok)
    align_size = _as_int(op, "align_size", align_size)
    if align_size < 0:
        raise ValueError(f"{op}: align_size ({align_size}) must be >= 0 (0: no padding).")
    if e < 1:
        raise ValueError(f"{op}: num_experts ({e}) must be >= 1.")
    if e % ep_shards:
        raise ValueError(f"{op}: num_experts ({e}) must be divisible by the ep_axis size ({ep_shards}).")
    if not 1 <= k <= e:
        raise ValueError(f"{op}: num_experts_per_tok ({k}) must be in [1, num_experts ({e})].")
    if len(x_shape) < 1:
        raise ValueError(f"{op}: x rank (0) must be >= 1 (x is [..., hidden]).")
    h = x_shape[-1]
    if tuple(gate_shape) != (h, e):
        raise ValueError(f"{op}: gate_kernel shape {tuple(gate_shape)} must be (hidden, num_experts) = {(h, e)}.")
    e = e // ep_shards  # the experts whose weights this device holds
    if len(wi_0_shape) != 3 or tuple(wi_0_shape[:2]) != (e, h):
        raise ValueError(f"{op}: wi_0 shape {tuple(wi_0_shape)} must be (local experts, hidden, M) = ({e}, {h}, M).")
    m = wi_0_shape[2]
    if tuple(wi_1_shape) != (e, h, m):
        raise ValueError(f"{op}: wi_1 shape {tuple(wi_1_shape)} must be wi_0's, {(e, h, m)}.")
    if tuple(wo_shape) != (e, m, h):
        raise ValueError(f"{op}: wo shape {tuple(wo_shape)} must be (num_experts, M, hidden) = {(e, m, h)}.")
    for name, got, want in (("wi_0_bias", b0_shape, (e, m)), ("wi_1_bias", b1_shape, (e, m)),
                            ("wo_bias", bo_shape, (e, h))):
        if got is not None and tuple(got) != want:
            raise ValueError(f"{op}: {name} shape {tuple(got)} must be {want}.")
    if activation_type not in MOE_ACTIVATIONS:
        raise ValueError(f"{op}: activation_type ({activation_type!r}) must be one of "
                         f"{', '.join(map(repr, MOE_ACTIVATIONS))}.")


def check_moe_inputs(x, gate_kernel, weights: dict, expert_bias, num_groups, group_topk, aux_loss_coeff,
                     grouped_matmul, num_experts=None, router: dict | None = None, op: str = MOE_OP) -> None:
    """The MoE block's arguments in its own terms, before any op it calls
    sees them: arrays (not lists) of float dtypes, a finite non-negative
    ``aux_loss_coeff``, a callable ``grouped_matmul`` (or ``"slots"``, ``"auto"``), and the group pair
    (``num_groups`` given when ``group_topk`` is)."""
    for name, a in (("x", x), ("gate_kernel", gate_kernel), *weights.items(), ("expert_bias", expert_bias)):
        if a is None and name in ("x", "gate_kernel", "wi_0", "wi_1", "wo"):
            raise TypeError(f"{op}: {name} must be an array (jax.Array or numpy.ndarray), got None.")
        if a is not None:
            check_float_dtype(op, name, array_meta(op, name, a)[1])
    coeff = _as_finite_float(op, "aux_loss_coeff", aux_loss_coeff)
    if coeff < 0:
        raise ValueError(f"{op}: aux_loss_coeff ({coeff!r}) must be >= 0 (0: no aux loss).")
    if not callable(grouped_matmul) and not (isinstance(grouped_matmul, str) and grouped_matmul in ("slots", "auto")):
        raise TypeError(f"{op}: grouped_matmul ({grouped_matmul!r}) must be a function with "
                        "jax.lax.ragged_dot's signature (e.g. jax.lax.ragged_dot or gpurouter.moe.batched_ragged_dot), "
                        "\"slots\" (the whole expert FFN in capacity slots) or \"auto\" (the measured choice).")
    for name, value in (router or {}).items():  # the router's and the block's flags and scalars, in moe's terms
        if name in ("use_pre_softmax", "apply_topk_weights_early"):
            _as_bool(op, name, value)
        elif name == "scaling_factor":
            _as_finite_float(op, name, value)
        elif name == "score_function":
            score_function_of(op, value)
    if expert_bias is not None and isinstance(num_experts, int) and not isinstance(num_experts, bool):
        shape = array_meta(op, "expert_bias", expert_bias)[0]
        if tuple(shape) != (num_experts,):
            raise ValueError(f"{op}: expert_bias shape {tuple(shape)} must be (num_experts,) = ({num_experts},).")
    kg = None if group_topk is None else _as_int(op, "group_topk", group_topk)
    g = None if num_groups is None else _as_int(op, "num_groups", num_groups)
    if kg is not None and kg > 0 and (g is None or g < 1):
        raise ValueError(f"{op}: num_groups ({num_groups!r}) must be given (>= 1) when group_topk ({kg}) > 0.")
