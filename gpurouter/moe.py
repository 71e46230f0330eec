"""The MoE layer around the router (public): the MoE block, expert
parallelism, and the token-level ops it is built from.

``moe`` is TE's ``transformer_engine.jax.moe.moe`` (argument names and weight
layouts): gpurouter's router on ``x @ gate_kernel``, a dropless dispatch, a
gated FFN on grouped GEMMs, the weighted combine, and (``ep_axis``) the rows
sent to their experts' devices with ``ragged_all_to_all``. docs/moe.md has the
data flow and the math.

This module is the one public home of the MoE layer: the block, the grouped
GEMMs and the five token-level MoE ops (docs/ops/moe_ops.md), whose bodies
live in ``gpurouter/_ops/grouped_bias.py`` and ``gpurouter/_ops/permute.py``
(``gpurouter.moe_ops`` re-exports the five ops for older imports).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from . import reference
from ._auto import moe_block_on_kernels
from ._checks import MOE_OP, check_backend, check_transport
from ._ops.aux_loss import fused_moe_aux_loss
from ._ops.grouped_bias import compute_grouped_dbias as compute_grouped_dbias
from ._ops.grouped_bias import compute_grouped_dbias_dscales as compute_grouped_dbias_dscales
from ._ops.grouped_bias import grouped_scaled_bias_add as grouped_scaled_bias_add
from ._ops.permute import block_combine, block_dispatch
from ._ops.permute import token_combine as token_combine
from ._ops.permute import token_dispatch as token_dispatch
from ._ops.topk import fused_topk_with_score_function
from .grouped_gemm import mosaic_ragged_dot as mosaic_ragged_dot
from .grouped_gemm import pallas_ragged_dot as pallas_ragged_dot
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
    grouped_matmul: Callable | str = "auto",
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
    cliff under skewed routing), or e.g. a tuned Pallas grouped GEMM; or
    ``"slots"``: the whole expert FFN (the three GEMMs, the activation, the
    routing weight) on batched GEMMs in capacity slots; without ``ep_axis``
    the slots are filled straight from the tokens and summed straight back
    into them (no dispatch, no combine, no ``[T K, H]`` rows; the weight
    always multiplies ``h`` before ``wo``), with it the rows are gathered
    into the slots once and read back once; past 1.5x the mean rows of an
    expert, its further rows in per-expert tiles (no cliff;
    :mod:`gpurouter.reference.slot_experts`, docs/moe.md). On an H200 at
    scale 1 it makes the block about 1.5x (DeepSeek-V3-like) to 1.6x (Qwen3-like)
    faster than ``batched_ragged_dot``. The default, ``"auto"``, is the
    measured choice: ``"slots"`` on an NVIDIA GPU without ``ep_axis``, else
    :func:`batched_ragged_dot` (``jax.lax.ragged_dot`` was 26-44x slower on a
    CPU, and ran out of memory at DeepSeek-V3-like shapes on both;
    :func:`gpurouter.reference.moe.auto_grouped_matmul`, docs/moe.md).

    Returns:
      ``(output [..., H] in x's dtype, aux_loss float32 scalar or None)``.
    """
    check_backend(MOE_OP, backend)
    check_transport(MOE_OP, transport)
    router = functools.partial(fused_topk_with_score_function, backend=backend, transport=transport)
    aux_loss = functools.partial(fused_moe_aux_loss, backend=backend, transport=transport)
    block = dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, activation_type=activation_type,
                 score_function=score_function, aux_loss_coeff=aux_loss_coeff,
                 apply_topk_weights_early=apply_topk_weights_early, ep_axis=ep_axis, align_size=align_size,
                 grouped_matmul=grouped_matmul)
    route = dict(use_pre_softmax=use_pre_softmax, num_groups=num_groups, group_topk=group_topk,
                 scaling_factor=scaling_factor)
    if not moe_block_on_kernels(x, num_experts, num_experts_per_tok, backend):  # gpurouter/_auto.py
        return reference.moe.moe(x, gate_kernel, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, expert_bias,
                                 **block, **route, router=router, aux_loss=aux_loss)
    # The kernel path, step by step (the reference block's steps). The tokens go
    # by direct calls to block_dispatch -> token_dispatch -> its kernel binding
    # (gpurouter/_ops/permute.py), which builds the dispatch's plan
    # (gpurouter/kernels/moe/plans.py) by name and hands it to kernel_call.
    routed = reference.moe.route_tokens(x, gate_kernel, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, expert_bias,
                                        **block, **route, router=router)
    return reference.moe.experts_and_combine(routed, functools.partial(block_dispatch, transport=transport),
                                             functools.partial(block_combine, transport=transport),
                                             wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias, **block, router=router,
                                             aux_loss=aux_loss)


__all__ = [
    "batched_ragged_dot",
    "compute_grouped_dbias",
    "compute_grouped_dbias_dscales",
    "grouped_scaled_bias_add",
    "moe",
    "mosaic_ragged_dot",
    "pallas_ragged_dot",
    "tiled_ragged_dot",
    "token_combine",
    "token_dispatch",
]
