"""gpurouter: TransformerEngine-compatible MoE router ops for JAX.

Numba-CUDA kernels behind ``jax.custom_vjp``, and a pure-jnp reference
(:mod:`gpurouter.reference`) that is both the fallback and the oracle.
``import gpurouter`` needs neither numba nor a GPU.
"""

from ._checks import ScoreFunction as ScoreFunction
from ._ops.aux_loss import fused_moe_aux_loss as fused_moe_aux_loss
from ._ops.topk import fused_topk_with_score_function as fused_topk_with_score_function

__version__ = "0.1.0"

__all__ = ["ScoreFunction", "fused_moe_aux_loss", "fused_topk_with_score_function"]
