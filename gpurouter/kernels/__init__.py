"""Numba-CUDA kernels of gpurouter (semi-public: no stability promise).

Launchers take NumPy arrays (and return NumPy) or device arrays (and return
numba device arrays); see ``_launch.py`` for the conventions and README.md for
the layout.  Never imports jax.
"""

from ._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
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
from .losses.z_loss import router_z_loss_bwd as router_z_loss_bwd
from .losses.z_loss import router_z_loss_bwd_plan as router_z_loss_bwd_plan
from .losses.z_loss import router_z_loss_fwd as router_z_loss_fwd
from .losses.z_loss import router_z_loss_fwd_plan as router_z_loss_fwd_plan
from .topk.aux_plans import score_for_aux_loss_bwd as score_for_aux_loss_bwd
from .topk.aux_plans import score_for_aux_loss_bwd_plan as score_for_aux_loss_bwd_plan
from .topk.aux_plans import score_for_aux_loss_fwd as score_for_aux_loss_fwd
from .topk.aux_plans import score_for_aux_loss_fwd_plan as score_for_aux_loss_fwd_plan
from .topk.plans import topk_with_score_function_bwd as topk_with_score_function_bwd
from .topk.plans import topk_with_score_function_bwd_plan as topk_with_score_function_bwd_plan
from .topk.plans import topk_with_score_function_fwd as topk_with_score_function_fwd
from .topk.plans import topk_with_score_function_fwd_plan as topk_with_score_function_fwd_plan

__all__ = [
    "MAX_EXPERTS",
    "MAX_GROUPS",
    "MAX_TOPK",
    "aux_loss_coeff",
    "check_limits",
    "kind_of_dtype",
    "moe_aux_loss_bwd",
    "moe_aux_loss_bwd_plan",
    "moe_aux_loss_fwd",
    "moe_aux_loss_fwd_plan",
    "router_z_loss_bwd",
    "router_z_loss_bwd_plan",
    "router_z_loss_fwd",
    "router_z_loss_fwd_plan",
    "score_for_aux_loss_bwd",
    "score_for_aux_loss_bwd_plan",
    "score_for_aux_loss_fwd",
    "score_for_aux_loss_fwd_plan",
    "topk_with_score_function_bwd",
    "topk_with_score_function_bwd_plan",
    "topk_with_score_function_fwd",
    "topk_with_score_function_fwd_plan",
]

# Token-level MoE ops (moe_*.py)
from .moe.combine import CMB_MAX_EXPERTS as CMB_MAX_EXPERTS  # noqa: E402
from .moe.plans import grouped_dbias as grouped_dbias  # noqa: E402
from .moe.plans import grouped_dbias_dscales as grouped_dbias_dscales  # noqa: E402
from .moe.plans import grouped_dbias_dscales_plan as grouped_dbias_dscales_plan  # noqa: E402
from .moe.plans import token_combine_bwd as token_combine_bwd  # noqa: E402
from .moe.plans import token_combine_bwd_plan as token_combine_bwd_plan  # noqa: E402
from .moe.plans import token_combine_fwd as token_combine_fwd  # noqa: E402
from .moe.plans import token_combine_fwd_plan as token_combine_fwd_plan  # noqa: E402

__all__ += [
    "CMB_MAX_EXPERTS",
    "grouped_dbias",
    "grouped_dbias_dscales",
    "grouped_dbias_dscales_plan",
    "token_combine_bwd",
    "token_combine_bwd_plan",
    "token_combine_fwd",
    "token_combine_fwd_plan",
]
from .moe.plans import token_dispatch_fwd as token_dispatch_fwd  # noqa: E402
from .moe.plans import token_dispatch_fwd_plan as token_dispatch_fwd_plan  # noqa: E402

__all__ += ["token_dispatch_fwd", "token_dispatch_fwd_plan"]
