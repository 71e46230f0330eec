"""Pure-jnp reference of the MoE block (TE's ``transformer_engine.jax.moe.moe``):
router, dropless argsort dispatch, gated expert FFN on grouped GEMMs, combine.

docs/moe.md has the data flow and the math. The dispatch is the argsort form
MaxText and TE's ``pure_jax_token_dispatch`` use: the ``T * K`` (token,
expert) pairs sorted by expert, stable, so rows are expert-major with
ascending token index inside an expert.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _ep
from .._checks import MOE_OP, check_moe_args, check_moe_inputs
from .._sharding import axis_size
from .aux_loss import fused_moe_aux_loss
from .grouped_matmul import batched_ragged_dot
from .routing_map import tokens_per_expert
from .slot_experts import slots_expert_ffn, slots_token_ffn
from .topk import fused_topk_with_score_function

# the names _checks.MOE_ACTIVATIONS accepts (tests/ops/test_moe.py holds them equal)
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
    "linear": lambda v: v,
}


def moe(
    x: jax.typing.ArrayLike,
    gate_kernel: jax.typing.ArrayLike,
    wi_0: jax.typing.ArrayLike,
    wi_1: jax.typing.ArrayLike,
    wo: jax.typing.ArrayLike,
    wi_0_bias: jax.typing.ArrayLike | None = None,
    wi_1_bias: jax.typing.ArrayLike | None = None,
    wo_bias: jax.typing.ArrayLike | None = None,
    expert_bias: jax.typing.ArrayLike | None = None,
    *,
    num_experts: int,
    num_experts_per_tok: int,
    activation_type: str = "silu",
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float = 1.0,
    aux_loss_coeff: float = 0.0,
    apply_topk_weights_early: bool = False,
    ep_axis: str | None = None,
    align_size: int = 0,
    grouped_matmul: Callable | str = "auto",
    router: Callable | None = None,
    aux_loss: Callable | None = None,
    permute: tuple[Callable, Callable] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """A dropless MoE block (pure-jnp reference of :func:`gpurouter.moe.moe`).

    Args:
      x: ``[..., H]`` tokens.
      gate_kernel: ``[H, E]``, the router's projection (logits ``x @ gate_kernel``).
      wi_0, wi_1: ``[E, H, M]``, the gate and up projections of each expert.
      wo: ``[E, M, H]``, the down projection.
      wi_0_bias, wi_1_bias: ``[E, M]`` or None; wo_bias: ``[E, H]`` or None.
      expert_bias: ``[E]`` router selection bias (sigmoid / sqrtsoftplus).
      num_experts: ``E``; num_experts_per_tok: ``K``.
      activation_type: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU), ``"relu"``,
        ``"linear"``: ``h = act(x wi_0 + b0) * (x wi_1 + b1)``.
      score_function, use_pre_softmax, num_groups, group_topk,
        scaling_factor: the router's (``None`` groups: no grouping).
      aux_loss_coeff: > 0 adds the switch load-balancing loss of the aux
        scores (:func:`gpurouter.fused_moe_aux_loss`).
      apply_topk_weights_early: multiply the routing weight into ``h``
        before ``wo`` (and the ``wo_bias`` by it: TE PR #2864's fix, else a
        token gets K biases) instead of into the expert outputs at the
        combine. Both give the same output.
      ep_axis: expert parallelism: inside ``jax.shard_map``, with this
        device's tokens and the ``E / P`` experts' weights it owns (``wi_0``
        etc. ``[E / P, ...]``; ``gate_kernel`` and ``expert_bias`` whole),
        the mesh axis the experts are split over (gpurouter/_ep.py). The aux
        loss is then the global one's share of this device.
      align_size: > 0 pads each expert's rows with zero rows to a multiple of
        it (for grouped GEMMs that need aligned groups; the buffer has
        ``T*K + E*(align_size - 1)`` rows); 0: no padding. The output does
        not depend on it.
      grouped_matmul: the grouped GEMM, ``f(lhs [N, K], rhs [G, K, N'],
        group_sizes [G]) -> [N, N']`` (``jax.lax.ragged_dot``'s signature),
        or ``"slots"``: the whole expert FFN on batched GEMMs in capacity
        slots; without ``ep_axis`` filled straight from the tokens and summed
        straight back into them, with no dispatch or combine and the weight
        always into ``h`` (:func:`gpurouter.reference.slot_experts.slots_token_ffn`),
        with it the rows gathered once and read back once
        (:func:`gpurouter.reference.slot_experts.slots_expert_ffn`);
        ``align_size`` then changes nothing; or ``"auto"`` (the default): the
        measured choice, ``"slots"`` on an NVIDIA GPU without ``ep_axis``,
        else :func:`batched_ragged_dot` (:func:`auto_grouped_matmul`).
      router, aux_loss: the router op and aux-loss op to call (the public
        block passes gpurouter's with its backend); default: the references.
      permute: ``(dispatch, combine)``, the token dispatch and combine to use
        (default ``(argsort_dispatch, argsort_combine)``; the public block
        passes its kernel pair on ``backend="numba"``). See
        :func:`argsort_dispatch` for their signatures.

    Returns:
      ``(output [..., H] in x's dtype, aux_loss float32 scalar or None)``.
    """
    routed = route_tokens(
        x, gate_kernel, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, expert_bias,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, activation_type=activation_type,
        score_function=score_function, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
        group_topk=group_topk, scaling_factor=scaling_factor, aux_loss_coeff=aux_loss_coeff,
        apply_topk_weights_early=apply_topk_weights_early, ep_axis=ep_axis, align_size=align_size,
        grouped_matmul=grouped_matmul, router=router)
    dispatch, combine = permute or (argsort_dispatch, argsort_combine)
    return experts_and_combine(
        routed, dispatch, combine, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, activation_type=activation_type,
        score_function=score_function, aux_loss_coeff=aux_loss_coeff,
        apply_topk_weights_early=apply_topk_weights_early, ep_axis=ep_axis, align_size=align_size,
        grouped_matmul=grouped_matmul, router=router, aux_loss=aux_loss)


def auto_grouped_matmul(ep_axis: str | None):
    """What ``grouped_matmul="auto"`` runs (docs/moe.md, "What grouped_matmul="auto" picks"):
    ``"slots"`` where JAX runs on an NVIDIA GPU and the block has no ``ep_axis`` (an
    H200 measured it 1.39-1.90x faster than :func:`batched_ragged_dot` and faster than
    ``jax.lax.ragged_dot`` at every shape tried, 8 to 512 rows an expert);
    :func:`batched_ragged_dot` elsewhere (a CPU measured it 26-44x faster than
    ``jax.lax.ragged_dot``, which ran out of memory at DeepSeek-V3-like shapes on
    both; with ``ep_axis`` the slots' rows path was within 2.5% of it on 2 x H200,
    the exchange 63-66% of the step)."""
    if ep_axis is None and jax.default_backend() == "gpu" and jax.devices()[0].device_kind.upper().startswith("NVIDIA"):
        return "slots"
    return batched_ragged_dot


class Routed(NamedTuple):
    """The block's tokens after :func:`route_tokens`: ``xf [T, H]`` (``x``
    flattened), ``logits [T, E]``, the router's ``probs``, ``routing_map``
    and ``idx [T, K]``, ``x``'s ``shape`` and ``dtype``, and the number of
    expert-parallel ``shards``."""

    xf: jax.Array
    logits: jax.Array
    probs: jax.Array
    routing_map: jax.Array
    idx: jax.Array
    shape: tuple
    dtype: object
    shards: int


def route_tokens(
    x, gate_kernel, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, expert_bias, *, num_experts: int,
    num_experts_per_tok: int, activation_type: str, score_function: str, use_pre_softmax: bool,
    num_groups: int | None, group_topk: int | None, scaling_factor: float, aux_loss_coeff: float,
    apply_topk_weights_early: bool, ep_axis: str | None, align_size: int, grouped_matmul: Callable,
    router: Callable | None = None,
) -> Routed:
    """The block's first step (:func:`moe`'s arguments): every argument
    checked, then the router on ``x @ gate_kernel``."""
    check_moe_inputs(x, gate_kernel, dict(wi_0=wi_0, wi_1=wi_1, wo=wo, wi_0_bias=wi_0_bias, wi_1_bias=wi_1_bias,
                                          wo_bias=wo_bias), expert_bias, num_groups, group_topk, aux_loss_coeff,
                     grouped_matmul, num_experts,
                     dict(use_pre_softmax=use_pre_softmax, apply_topk_weights_early=apply_topk_weights_early,
                          scaling_factor=scaling_factor, score_function=score_function))
    check_moe_args(jnp.shape(x), jnp.shape(gate_kernel), jnp.shape(wi_0), jnp.shape(wi_1), jnp.shape(wo),
                   None if wi_0_bias is None else jnp.shape(wi_0_bias),
                   None if wi_1_bias is None else jnp.shape(wi_1_bias),
                   None if wo_bias is None else jnp.shape(wo_bias),
                   num_experts, num_experts_per_tok, activation_type, align_size,
                   shards := axis_size(MOE_OP, ep_axis))
    router = router or fused_topk_with_score_function
    x = jnp.asarray(x)
    shape, hidden = x.shape, x.shape[-1]
    xf = x.reshape(-1, hidden)
    k = num_experts_per_tok
    logits = xf @ jnp.asarray(gate_kernel).astype(x.dtype)
    route_kw = dict(use_pre_softmax=use_pre_softmax, num_groups=-1 if num_groups is None else num_groups,
                    group_topk=-1 if group_topk is None else group_topk, scaling_factor=scaling_factor,
                    score_function=score_function)
    probs, routing_map, idx = router(logits, k, expert_bias=expert_bias, return_indices=True, **route_kw)
    return Routed(xf, logits, probs, routing_map, idx, shape, x.dtype, shards)


def experts_and_combine(
    routed: Routed, dispatch: Callable, combine: Callable, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, *,
    num_experts: int, num_experts_per_tok: int, activation_type: str, score_function: str,
    aux_loss_coeff: float, apply_topk_weights_early: bool, ep_axis: str | None, align_size: int,
    grouped_matmul: Callable, router: Callable | None = None, aux_loss: Callable | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The block's last steps (:func:`moe`'s arguments): ``dispatch`` the
    tokens to rows sorted by expert (:func:`argsort_dispatch`'s signature),
    the experts on them (over the ``ep_axis`` devices when set), ``combine``
    back to tokens, and the aux loss. ``grouped_matmul="slots"`` without
    ``ep_axis`` calls neither: its slots are filled from the tokens and summed
    back into them (:func:`gpurouter.reference.slot_experts.slots_token_ffn`)."""
    router = router or fused_topk_with_score_function
    aux_loss = aux_loss or fused_moe_aux_loss
    shape, dtype, shards = routed.shape, routed.dtype, routed.shards
    k, e = num_experts_per_tok, num_experts
    weights_ = dict(wi_0=wi_0, wi_1=wi_1, wo=wo, wi_0_bias=wi_0_bias, wi_1_bias=wi_1_bias, wo_bias=wo_bias)
    if isinstance(grouped_matmul, str) and grouped_matmul == "auto":
        grouped_matmul = auto_grouped_matmul(ep_axis)
    if grouped_matmul == "slots" and ep_axis is None:  # tokens -> slots -> tokens, no rows
        weights = jnp.take_along_axis(routed.probs, routed.idx, axis=-1)
        out = slots_token_ffn(routed.xf, routed.idx, weights, **weights_, activation=ACTIVATIONS[activation_type],
                              dtype=dtype)
        return out.astype(dtype).reshape(shape), _aux_loss(routed, router, aux_loss, k, aux_loss_coeff,
                                                           score_function, ep_axis)
    xs, rows_e, group_sizes, w_rows, state = dispatch(routed.xf, routed.probs, routed.routing_map, routed.idx, e)
    if grouped_matmul == "slots":  # the whole FFN in capacity slots (gpurouter/reference/slot_experts.py)
        ffn = functools.partial(slots_expert_ffn, **weights_, activation=ACTIVATIONS[activation_type],
                                early=apply_topk_weights_early, dtype=dtype)
    else:
        ffn = functools.partial(_expert_ffn, **weights_, activation=ACTIVATIONS[activation_type],
                                early=apply_topk_weights_early, align_size=align_size,
                                grouped_matmul=grouped_matmul, dtype=dtype)
    if ep_axis is None:
        z = ffn(xs, rows_e, group_sizes, w_rows)
    else:  # rows to their experts' devices and back (gpurouter/_ep.py)
        ep = dict(axis_name=ep_axis, num_shards=shards)
        recv, local_sizes, ep_state = _ep.dispatch(xs, rows_e, group_sizes, num_experts=e, **ep)
        recv_w, _, _ = _ep.dispatch(w_rows[:, None], rows_e, group_sizes, num_experts=e, **ep)
        z = _ep.combine(ffn(recv, rows_of_groups(local_sizes, recv.shape[0]), local_sizes, recv_w[:, 0]),
                        ep_state, **ep)
    out = combine(z, state, not apply_topk_weights_early).astype(dtype).reshape(shape)
    return out, _aux_loss(routed, router, aux_loss, k, aux_loss_coeff, score_function, ep_axis)


def _aux_loss(routed: Routed, router, aux_loss, k: int, aux_loss_coeff: float, score_function: str,
              ep_axis: str | None):
    """The block's aux loss (None without ``aux_loss_coeff``)."""
    if aux_loss_coeff <= 0:
        return None
    scores, aux_map = router(routed.logits, k, compute_aux_scores=True, score_function=score_function)
    return aux_loss(scores, tokens_per_expert(aux_map), k, aux_loss_coeff, axis_name=ep_axis).astype(jnp.float32)


def argsort_dispatch(xf, probs, routing_map, idx, num_experts: int):
    """Tokens to expert-major rows, the argsort form (MaxText's): the ``T * K``
    (token, expert) pairs of ``idx [T, K]`` sorted by expert, stable, so rows
    ascend in token index inside an expert.

    Returns ``(xs [N, H], rows_e [N] int32 (each row's expert), group_sizes
    [E] int32, w_rows [N] (each row's routing weight, fp32 at least), state)``
    with ``N = T * K``; ``state`` is what :func:`argsort_combine` needs.
    ``routing_map`` is unused here (the kernel pair reads it)."""
    del routing_map
    k = idx.shape[-1]
    weights = jnp.take_along_axis(probs, idx, axis=-1).astype(_accumulation_type(xf.dtype))  # [T, K]
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    return xf[order // k], flat_e[order], group_sizes, weights.reshape(-1)[order], (order, weights)


def argsort_combine(z, state, weighted: bool):
    """Expert rows ``z [N, H]`` back to tokens: ``[T, H]``, the sum of a token's
    K rows in fp32 (at least), each times its routing weight when
    ``weighted``."""
    order, weights = state
    t, k = weights.shape
    z_tk = jnp.zeros_like(z).at[order].set(z).reshape(t, k, z.shape[-1])
    if weighted:
        z_tk = z_tk * weights[:, :, None]
    return jnp.sum(z_tk, axis=1)


def rows_of_groups(group_sizes, num_rows: int):
    """``[num_rows]`` int32: the group of each row of a buffer of consecutive
    groups (rows past the last group: the last group)."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), rows, side="right"),
                       group_sizes.shape[0] - 1).astype(jnp.int32)


def _accumulation_type(dtype):
    """float64 for float64 inputs (the tests' oracle precision), else float32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _expert_ffn(xs, rows_e, group_sizes, w_rows, *, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, activation,
                early: bool, align_size: int, grouped_matmul, dtype):
    """The experts on rows sorted by expert: ``xs [N, H]`` (``rows_e [N]`` their
    experts, ``group_sizes [G]``, ``w_rows [N]`` their routing weights) ->
    ``z [N, H]`` (fp32 at least), ``act(x wi_0 + b0) * (x wi_1 + b1) @ wo + bo``, the
    weight multiplied into ``h`` (and ``bo``) when ``early``. Rows past
    ``sum(group_sizes)`` give 0. ``align_size > 0`` pads each group with zero
    rows to a multiple of it for the grouped GEMMs and drops them after."""
    n, num_groups = xs.shape[0], group_sizes.shape[0]
    real = jnp.arange(n, dtype=jnp.int32) < jnp.sum(group_sizes, dtype=jnp.int32)
    dest = None
    if align_size > 0:
        padded = (group_sizes + align_size - 1) // align_size * align_size
        pad_offsets = jnp.cumsum(padded - group_sizes) - (padded - group_sizes)  # exclusive
        dest = jnp.arange(n, dtype=jnp.int32) + pad_offsets[rows_e]
        rows = n + num_groups * (align_size - 1)
        real = jnp.zeros((rows,), bool).at[dest].set(real)
        xs = jnp.zeros((rows,) + xs.shape[1:], xs.dtype).at[dest].set(xs)
        rows_e = rows_of_groups(padded, rows)
        w_rows = jnp.zeros((rows,), w_rows.dtype).at[dest].set(w_rows)
        group_sizes = padded

    def project(w, b):
        out = grouped_matmul(xs, jnp.asarray(w).astype(dtype), group_sizes)
        return out if b is None else out + jnp.asarray(b).astype(out.dtype)[rows_e]

    h = activation(project(wi_0, wi_0_bias)) * project(wi_1, wi_1_bias)
    h = jnp.where(real[:, None], h, 0)  # padding and tail rows exactly 0 (where: no NaN * 0)
    acc = _accumulation_type(dtype)
    w = jnp.where(real, w_rows, 0).astype(acc)
    if early:
        h = (h.astype(acc) * w[:, None]).astype(h.dtype)
    z = grouped_matmul(h, jnp.asarray(wo).astype(h.dtype), group_sizes).astype(acc)
    if wo_bias is not None:
        b = jnp.where(real[:, None], jnp.asarray(wo_bias).astype(acc)[rows_e], 0)
        z = z + (b * w[:, None] if early else b)
    return z if dest is None else z[dest]


__all__ = [
    "Routed",
    "argsort_combine",
    "argsort_dispatch",
    "experts_and_combine",
    "moe",
    "route_tokens",
    "rows_of_groups",
]
