"""Every input check of gpurouter, and the only place where error text is written.

The public ops (every backend) and the reference call these at trace time, on
static shapes, dtypes and Python scalars, before any callback is built: nothing
is ever raised inside a callback (docs/contract.md section 6).

Exceptions:
- ``ValueError`` for shapes and configuration,
- ``TypeError`` for dtypes,
- ``NotImplementedError`` for valid inputs beyond a kernel's limits.

Each message names the function, the argument, the value seen and the rule.

The rules live in this package's modules, one job each, and are imported from
here (``from gpurouter._checks import check_topk_args``):

- ``common``: static ints and floats, arrays and dtypes, ``backend=`` and
  ``transport=``, the ``ScoreFunction`` / ``RoutingMapFormat`` enums, the
  environment's messages;
- ``topk``: the router top-k, forced indices, routing maps;
- ``losses``: the aux loss, the z-loss, the expert-bias update;
- ``moe``: the token-level MoE ops and their kernels' limits;
- ``moe_block``: the MoE block.

NumPy only: no jax, no numba.
"""

from .common import BACKENDS as BACKENDS
from .common import TRANSPORTS as TRANSPORTS
from .common import RoutingMapFormat as RoutingMapFormat
from .common import ScoreFunction as ScoreFunction
from .common import array_meta as array_meta
from .common import as_bool as as_bool
from .common import as_finite_float as as_finite_float
from .common import check_array_rank as check_array_rank
from .common import check_backend as check_backend
from .common import check_float_dtype as check_float_dtype
from .common import check_kernel_dtype as check_kernel_dtype
from .common import check_transport as check_transport
from .common import routing_map_format_of as routing_map_format_of
from .common import score_function_of as score_function_of
from .common import simulator_collectives_warning as simulator_collectives_warning
from .common import unbound_axis_error as unbound_axis_error
from .common import unused_argument_error as unused_argument_error
from .losses import AUX_LOSS_OP as AUX_LOSS_OP
from .losses import BIAS_UPDATE_OP as BIAS_UPDATE_OP
from .losses import Z_LOSS_OP as Z_LOSS_OP
from .losses import AuxLossConfig as AuxLossConfig
from .losses import check_aux_loss_args as check_aux_loss_args
from .losses import check_bias_update_args as check_bias_update_args
from .losses import check_z_loss_args as check_z_loss_args
from .moe import BATCHED_RAGGED_DOT_OP as BATCHED_RAGGED_DOT_OP
from .moe import GROUPED_DBIAS_DSCALES_OP as GROUPED_DBIAS_DSCALES_OP
from .moe import GROUPED_DBIAS_OP as GROUPED_DBIAS_OP
from .moe import MOE_KERNEL_OPS as MOE_KERNEL_OPS
from .moe import PALLAS_RAGGED_DOT_OP as PALLAS_RAGGED_DOT_OP
from .moe import SCALED_BIAS_ADD_OP as SCALED_BIAS_ADD_OP
from .moe import TILED_RAGGED_DOT_OP as TILED_RAGGED_DOT_OP
from .moe import TOKEN_COMBINE_OP as TOKEN_COMBINE_OP
from .moe import TOKEN_DISPATCH_OP as TOKEN_DISPATCH_OP
from .moe import DispatchConfig as DispatchConfig
from .moe import check_batched_ragged_dot_args as check_batched_ragged_dot_args
from .moe import check_grouped_dbias_args as check_grouped_dbias_args
from .moe import check_grouped_dbias_dscales_args as check_grouped_dbias_dscales_args
from .moe import check_moe_backend as check_moe_backend
from .moe import check_moe_kernel_backend as check_moe_kernel_backend
from .moe import check_moe_kernel_limit as check_moe_kernel_limit
from .moe import check_pallas_ragged_dot_args as check_pallas_ragged_dot_args
from .moe import check_scaled_bias_add_args as check_scaled_bias_add_args
from .moe import check_tiled_ragged_dot_args as check_tiled_ragged_dot_args
from .moe import check_token_combine_args as check_token_combine_args
from .moe import check_token_dispatch_args as check_token_dispatch_args
from .moe import moe_no_kernel_error as moe_no_kernel_error
from .moe_block import MOE_ACTIVATIONS as MOE_ACTIVATIONS
from .moe_block import MOE_OP as MOE_OP
from .moe_block import check_moe_args as check_moe_args
from .moe_block import check_moe_inputs as check_moe_inputs
from .topk import TOPK_OP as TOPK_OP
from .topk import TopkConfig as TopkConfig
from .topk import check_forced_indices as check_forced_indices
from .topk import check_routing_map as check_routing_map
from .topk import check_topk_args as check_topk_args
from .variants import GROUP_SCORES as GROUP_SCORES
from .variants import INT32_MAX as INT32_MAX
from .variants import QB_UPDATE_OP as QB_UPDATE_OP
from .variants import TopkVariants as TopkVariants
from .variants import check_bin_bounds as check_bin_bounds
from .variants import check_compact as check_compact
from .variants import check_flag as check_flag
from .variants import check_group_score as check_group_score
from .variants import check_indices_dtype as check_indices_dtype
from .variants import check_qb_args as check_qb_args
from .variants import check_qb_update_args as check_qb_update_args
from .variants import check_token_mask as check_token_mask
from .variants import check_topk_variants as check_topk_variants
from .variants import check_traced_token_count as check_traced_token_count
