"""The MoE layer around the router (public): the MoE block, expert
parallelism, and the token-level ops it is built from.

``moe`` is TE's ``transformer_engine.jax.moe.moe`` (argument names and weight
layouts): gpurouter's router on ``x @ gate_kernel``, a dropless dispatch, a
gated FFN on grouped GEMMs, the weighted combine, and (``ep_axis``) the rows
sent to their experts' devices with ``ragged_all_to_all``. docs/moe.md has the
data flow and the math.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import numpy as np

from . import _backend, reference
from ._auto import moe_kernels_faster, moe_kernels_take
from ._checks import MOE_OP, TOKEN_COMBINE_OP, check_backend, check_transport
from ._ops.aux_loss import fused_moe_aux_loss
from ._ops.topk import fused_topk_with_score_function
from .grouped_gemm import pallas_ragged_dot as pallas_ragged_dot
from .moe_ops import compute_grouped_dbias as compute_grouped_dbias
from .moe_ops import compute_grouped_dbias_dscales as compute_grouped_dbias_dscales
from .moe_ops import grouped_scaled_bias_add as grouped_scaled_bias_add
from .moe_ops import token_combine as token_combine
from .moe_ops import token_dispatch as token_dispatch
from .reference.grouped_matmul import batched_ragged_dot as batched_ragged_dot
from .reference.grouped_matmul import tiled_ragged_dot as tiled_ragged_dot


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
    grouped_matmul: Callable = jax.lax.ragged_dot,
    backend: str = "auto",
    transport: str = "auto",
) -> tuple[jax.Array, jax.Array | None]:
    """A dropless MoE block; the arguments of :func:`gpurouter.reference.moe.moe`
    plus ``backend`` (``"auto"``, ``"jax"``, ``"numba"``) and ``transport``
    (as for :func:`gpurouter.fused_topk_with_score_function`), the backend and transport of its
    router and aux-loss ops (see :func:`gpurouter.fused_topk_with_score_function`)
    and of its token dispatch and combine: on ``"numba"`` these are
    :func:`token_dispatch` and :func:`token_combine` on their kernels (the
    row copy, the weighted fp32 sum back and their fused backwards; with
    float64 ``x`` or more than ``CMB_MAX_EXPERTS`` (1024) experts, which the
    kernels do not take, the argsort form); on ``"jax"`` the argsort form in
    jnp; on ``"auto"`` the kernels where the combine's measured rule picks
    them for the block's ``T K`` rows (``gpurouter/_auto.py``), else the
    argsort form. The experts are ``grouped_matmul`` on every backend.

    ``grouped_matmul`` is any function with ``jax.lax.ragged_dot``'s
    signature: :func:`batched_ragged_dot` (batched dense GEMMs; on a GPU far
    faster than ``ragged_dot``, which XLA rewrites into dense masked dots:
    docs/moe.md), :func:`tiled_ragged_dot` (the same batched GEMM with its
    slots capped at 1.5x the mean group and the rest in per-expert tiles: no
    cliff under skewed routing), or e.g. a tuned Pallas grouped GEMM.

    Returns:
      ``(output [..., H] in x's dtype, aux_loss float32 scalar or None)``.
    """
    check_backend(MOE_OP, backend)
    check_transport(MOE_OP, transport)
    return reference.moe.moe(
        x, gate_kernel, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, expert_bias,
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, activation_type=activation_type,
        score_function=score_function, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
        group_topk=group_topk, scaling_factor=scaling_factor, aux_loss_coeff=aux_loss_coeff,
        apply_topk_weights_early=apply_topk_weights_early, ep_axis=ep_axis, align_size=align_size,
        grouped_matmul=grouped_matmul,
        router=functools.partial(fused_topk_with_score_function, backend=backend, transport=transport),
        aux_loss=functools.partial(fused_moe_aux_loss, backend=backend, transport=transport),
        permute=(_kernel_permute(transport) if _permute_on_kernels(x, num_experts, num_experts_per_tok, backend)
                 else None),
    )


def _permute_on_kernels(x, num_experts: int, topk: int, backend: str) -> bool:
    """True when the block's dispatch and combine run on the kernels:
    ``"numba"`` where they take the rows, ``"auto"`` where the combine's
    measured rule (``gpurouter/_auto.py``) picks them for the ``T K x H`` rows."""
    if not isinstance(x, jax.Array | np.ndarray) or x.ndim < 1 or not isinstance(num_experts, int):
        return False  # the block's checks say what is wrong
    if math.prod(x.shape[:-1]) == 0:
        return False  # no tokens: the argsort form's empty rows (a dispatch of 0 rows has no kernel launch)
    if backend == "numba":
        return moe_kernels_take([x.dtype], num_experts)
    rows = math.prod(x.shape[:-1]) * topk * x.shape[-1]
    return backend == "auto" and _backend.resolve(TOKEN_COMBINE_OP, "auto", faster=lambda: moe_kernels_faster(
        TOKEN_COMBINE_OP, "auto", rows, [x.dtype], num_experts)) == "numba"


def _kernel_permute(transport: str = "auto"):
    """``(dispatch, combine)`` for :func:`gpurouter.reference.moe.moe` on the
    token dispatch / combine kernels, with the argsort pair's signatures
    (:func:`gpurouter.reference.moe.argsort_dispatch`). The rows come out in
    the same order (expert-major, ascending token inside an expert); the
    combine sums a token's rows in ascending expert order, the argsort form
    in selection order (fp32 either way)."""

    def dispatch(xf, probs, routing_map, idx, num_experts: int):
        rows = idx.shape[0] * idx.shape[1]
        xs, w_rows, row_id_map, _, sizes = token_dispatch(xf, routing_map, rows, probs=probs, backend="numba",
                                                          transport=transport)
        return (xs, reference.moe.rows_of_groups(sizes, rows), sizes.astype(np.int32),
                w_rows.astype(np.float32), (row_id_map, probs))

    def combine(z, state, weighted: bool):
        row_id_map, probs = state
        return token_combine(z, row_id_map, probs if weighted else None, backend="numba", transport=transport)

    return dispatch, combine


__all__ = [
    "batched_ragged_dot",
    "compute_grouped_dbias",
    "compute_grouped_dbias_dscales",
    "grouped_scaled_bias_add",
    "moe",
    "pallas_ragged_dot",
    "tiled_ragged_dot",
    "token_combine",
    "token_dispatch",
]
