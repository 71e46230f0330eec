"""Pure-jnp reference of the token-level MoE ops (docs/ops/moe_ops.md).

- :func:`compute_grouped_dbias_dscales` and :func:`compute_grouped_dbias`:
  TE PR #2864's grouped bias gradients (``dbias [G, H]``, ``dscales [N]``);
- :func:`grouped_scaled_bias_add`: ``y + bias[g(i)] * scales[i]``, whose
  backward is the op above;
- :func:`token_dispatch` and :func:`token_combine`: the signatures and meaning
  of ``transformer_engine.jax.permutation.token_dispatch`` / ``token_combine``.

This module is their public home; the code lives by job in
:mod:`gpurouter.reference.grouped_bias` (the grouped bias ops and the
fixed-order segment sums; its docstring says why every op here is
bit-identical from run to run and how padding rows are kept out) and
:mod:`gpurouter.reference.permute` (dispatch and combine). The numba bindings (``gpurouter/_ops/grouped_bias.py``,
``gpurouter/_ops/permute.py``) import their private helpers from those two
modules; nothing private is re-exported here.
"""

from .grouped_bias import compute_grouped_dbias as compute_grouped_dbias
from .grouped_bias import compute_grouped_dbias_dscales as compute_grouped_dbias_dscales
from .grouped_bias import grouped_scaled_bias_add as grouped_scaled_bias_add
from .permute import token_combine as token_combine
from .permute import token_dispatch as token_dispatch

__all__ = [
    "compute_grouped_dbias",
    "compute_grouped_dbias_dscales",
    "grouped_scaled_bias_add",
    "token_combine",
    "token_dispatch",
]
