"""Numba-CUDA kernels of gpurouter (semi-public: no stability promise).

Launchers take NumPy arrays (and return NumPy) or device arrays (and return
numba device arrays); see ``_base/launch.py`` for the conventions and README.md
for the layout: ``_base/`` (no op), ``topk/``, ``losses/``, ``moe/``.  Never
imports jax.
"""

from ._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from ._base import pointer as _pointer  # noqa: F401  (registers execute's GPU path: plan.GPU_EXECUTOR)

# isort: split

from ._base.launch import kind_of_dtype as kind_of_dtype
from ._base.limits import MAX_EXPERTS as MAX_EXPERTS
from ._base.limits import MAX_GROUPS as MAX_GROUPS
from ._base.limits import MAX_TOPK as MAX_TOPK
from ._base.limits import check_limits as check_limits
from .losses.aux_loss import aux_loss_coeff as aux_loss_coeff
from .losses.aux_loss import moe_aux_loss_bwd as moe_aux_loss_bwd
from .losses.aux_loss import moe_aux_loss_bwd_plan as moe_aux_loss_bwd_plan
from .losses.aux_loss import moe_aux_loss_fwd as moe_aux_loss_fwd
from .losses.aux_loss import moe_aux_loss_fwd_plan as moe_aux_loss_fwd_plan
from .losses.tiling import AuxLossTiling as AuxLossTiling
from .losses.tiling import ZLossTiling as ZLossTiling
from .losses.z_loss import router_z_loss_bwd as router_z_loss_bwd
from .losses.z_loss import router_z_loss_bwd_plan as router_z_loss_bwd_plan
from .losses.z_loss import router_z_loss_fwd as router_z_loss_fwd
from .losses.z_loss import router_z_loss_fwd_plan as router_z_loss_fwd_plan
from .moe.grouped_bias import DbiasTiling as DbiasTiling
from .moe.permute import CMB_MAX_EXPERTS as CMB_MAX_EXPERTS
from .moe.permute import CombineTiling as CombineTiling
from .moe.plans import grouped_dbias as grouped_dbias
from .moe.plans import grouped_dbias_dscales as grouped_dbias_dscales
from .moe.plans import grouped_dbias_dscales_plan as grouped_dbias_dscales_plan
from .moe.plans import token_combine_bwd as token_combine_bwd
from .moe.plans import token_combine_bwd_plan as token_combine_bwd_plan
from .moe.plans import token_combine_fwd as token_combine_fwd
from .moe.plans import token_combine_fwd_plan as token_combine_fwd_plan
from .moe.plans import token_dispatch_fwd as token_dispatch_fwd
from .moe.plans import token_dispatch_fwd_plan as token_dispatch_fwd_plan
from .topk.aux_plans import score_for_aux_loss_bwd as score_for_aux_loss_bwd
from .topk.aux_plans import score_for_aux_loss_bwd_plan as score_for_aux_loss_bwd_plan
from .topk.aux_plans import score_for_aux_loss_fwd as score_for_aux_loss_fwd
from .topk.aux_plans import score_for_aux_loss_fwd_plan as score_for_aux_loss_fwd_plan
from .topk.bwd_plans import topk_with_score_function_bwd as topk_with_score_function_bwd
from .topk.bwd_plans import topk_with_score_function_bwd_plan as topk_with_score_function_bwd_plan
from .topk.bwd_tiling import BwdTiling as BwdTiling
from .topk.lane.tiling import RowTiling as RowTiling
from .topk.plans import topk_with_score_function_fwd as topk_with_score_function_fwd
from .topk.plans import topk_with_score_function_fwd_plan as topk_with_score_function_fwd_plan
from .topk.qb import QbTiling as QbTiling
from .topk.qb import qb_counts as qb_counts
from .topk.qb import qb_counts_plan as qb_counts_plan
from .topk.tiling import TopkTiling as TopkTiling
from .topk.token.tiling import TokenTiling as TokenTiling

__all__ = [
    "AuxLossTiling",
    "BwdTiling",
    "CMB_MAX_EXPERTS",
    "CombineTiling",
    "DbiasTiling",
    "MAX_EXPERTS",
    "MAX_GROUPS",
    "MAX_TOPK",
    "QbTiling",
    "RowTiling",
    "TokenTiling",
    "TopkTiling",
    "ZLossTiling",
    "aux_loss_coeff",
    "check_limits",
    "grouped_dbias",
    "grouped_dbias_dscales",
    "grouped_dbias_dscales_plan",
    "kind_of_dtype",
    "moe_aux_loss_bwd",
    "moe_aux_loss_bwd_plan",
    "moe_aux_loss_fwd",
    "moe_aux_loss_fwd_plan",
    "qb_counts",
    "qb_counts_plan",
    "router_z_loss_bwd",
    "router_z_loss_bwd_plan",
    "router_z_loss_fwd",
    "router_z_loss_fwd_plan",
    "score_for_aux_loss_bwd",
    "score_for_aux_loss_bwd_plan",
    "score_for_aux_loss_fwd",
    "score_for_aux_loss_fwd_plan",
    "token_combine_bwd",
    "token_combine_bwd_plan",
    "token_combine_fwd",
    "token_combine_fwd_plan",
    "token_dispatch_fwd",
    "token_dispatch_fwd_plan",
    "topk_with_score_function_bwd",
    "topk_with_score_function_bwd_plan",
    "topk_with_score_function_fwd",
    "topk_with_score_function_fwd_plan",
]
