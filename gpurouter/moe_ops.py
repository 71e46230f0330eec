"""The five token-level MoE ops under their older import path: a re-export.

Their public home is :mod:`gpurouter.moe` (docs/ops/moe_ops.md); their bodies
live in ``gpurouter/_ops/grouped_bias.py`` and ``gpurouter/_ops/permute.py``.
``from gpurouter.moe_ops import token_dispatch`` keeps working and gives the
same function objects as ``gpurouter.moe``; new code imports from
``gpurouter.moe``.
"""

from ._ops.grouped_bias import compute_grouped_dbias as compute_grouped_dbias
from ._ops.grouped_bias import compute_grouped_dbias_dscales as compute_grouped_dbias_dscales
from ._ops.grouped_bias import grouped_scaled_bias_add as grouped_scaled_bias_add
from ._ops.permute import token_combine as token_combine
from ._ops.permute import token_dispatch as token_dispatch

__all__ = [
    "compute_grouped_dbias",
    "compute_grouped_dbias_dscales",
    "grouped_scaled_bias_add",
    "token_combine",
    "token_dispatch",
]
