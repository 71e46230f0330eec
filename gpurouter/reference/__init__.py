"""Pure-jnp reference of every gpurouter op: the executable specification.

Same names and signatures as :mod:`gpurouter` (minus ``backend=``); plain
``jnp``, differentiable by JAX autodiff, runs on any JAX platform, never
imports numba. The low-level ``*_fwd``/``*_bwd`` pairs are what the numba
kernels mirror.
"""

from .._checks import RoutingMapFormat as RoutingMapFormat
from .._checks import ScoreFunction as ScoreFunction
from . import moe as moe
from .aux_loss import aux_loss_coeff as aux_loss_coeff
from .aux_loss import checked_mask as checked_mask
from .aux_loss import fused_moe_aux_loss as fused_moe_aux_loss
from .aux_loss import global_counts as global_counts
from .aux_loss import mask_rows as mask_rows
from .aux_loss import moe_aux_loss_bwd as moe_aux_loss_bwd
from .aux_loss import moe_aux_loss_fwd as moe_aux_loss_fwd
from .losses import router_z_loss as router_z_loss
from .losses import update_expert_bias as update_expert_bias
from .routing_map import pack_routing_map as pack_routing_map
from .routing_map import tokens_per_expert as tokens_per_expert
from .routing_map import unpack_routing_map as unpack_routing_map
from .topk import fused_topk_with_score_function as fused_topk_with_score_function
from .topk import score_for_aux_loss_bwd as score_for_aux_loss_bwd
from .topk import score_for_aux_loss_fwd as score_for_aux_loss_fwd
from .topk import topk_with_score_function_bwd as topk_with_score_function_bwd
from .topk import topk_with_score_function_fwd as topk_with_score_function_fwd
from .variants import qb_update_expert_bias as qb_update_expert_bias

__all__ = [
    "RoutingMapFormat",
    "ScoreFunction",
    "aux_loss_coeff",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "checked_mask",
    "global_counts",
    "mask_rows",
    "moe_aux_loss_bwd",
    "moe_aux_loss_fwd",
    "pack_routing_map",
    "qb_update_expert_bias",
    "router_z_loss",
    "score_for_aux_loss_bwd",
    "score_for_aux_loss_fwd",
    "tokens_per_expert",
    "topk_with_score_function_bwd",
    "topk_with_score_function_fwd",
    "unpack_routing_map",
    "update_expert_bias",
]
