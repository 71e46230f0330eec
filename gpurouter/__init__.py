"""gpurouter: TransformerEngine-compatible MoE router ops for JAX.

Numba-CUDA kernels behind ``jax.custom_vjp``, and a pure-jnp reference
(:mod:`gpurouter.reference`) that is both the fallback and the oracle.
``import gpurouter`` needs neither numba nor a GPU.
"""

from ._backend import guard_simulator_collectives as _guard_simulator_collectives
from ._checks import RoutingMapFormat as RoutingMapFormat
from ._checks import ScoreFunction as ScoreFunction
from ._ops.aux_loss import fused_moe_aux_loss as fused_moe_aux_loss
from ._ops.losses import router_z_loss as router_z_loss
from ._ops.losses import update_expert_bias as update_expert_bias
from ._ops.topk import fused_topk_with_score_function as fused_topk_with_score_function
from .config import RouterConfig as RouterConfig
from .reference.routing_map import pack_routing_map as pack_routing_map
from .reference.routing_map import tokens_per_expert as tokens_per_expert
from .reference.routing_map import unpack_routing_map as unpack_routing_map
from .reference.variants import qb_update_expert_bias as qb_update_expert_bias

_guard_simulator_collectives()  # only with NUMBA_ENABLE_CUDASIM set: see _backend.py

__version__ = "0.1.0"

__all__ = [
    "RouterConfig",
    "RoutingMapFormat",
    "ScoreFunction",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "pack_routing_map",
    "qb_update_expert_bias",
    "router_z_loss",
    "tokens_per_expert",
    "unpack_routing_map",
    "update_expert_bias",
]
