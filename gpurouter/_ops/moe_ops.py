"""The numba backend of the token-level MoE ops: ``jax.custom_vjp`` around the
kernels of ``gpurouter/kernels/moe_*.py`` (docs/ops/moe_ops.md).

Called by :mod:`gpurouter.moe_ops` after the arguments were checked (trace
time, ``gpurouter._checks``). Every launch goes through
:func:`gpurouter._transport.kernel_call` with a plan, so the transports
(callback, zero-copy, ffi) need nothing op-specific. The ops reduce over rows
or read rows of other arrays (``offsets`` groups, ``row_id_map`` rows): every
array is a per-call argument (``vmap`` runs one launch per batch element).

- ``compute_grouped_dbias_dscales`` / ``compute_grouped_dbias``: one kernel call;
- ``grouped_scaled_bias_add``: the forward is elementwise jnp (XLA fuses it),
  the backward the grouped dbias/dscales kernels;
- ``token_combine``: forward one kernel call, backward one kernel call that
  computes ``d_inp`` and ``d_merging_probs`` together;
- ``token_dispatch``: the integer index maps (``row_id_map``, counts,
  ``pad_offsets``) and the small ``permuted_probs`` scatter in jnp, the row
  copy on the kernels (the unweighted combine backward's), its backward the
  unweighted combine forward (the K copies summed in fp32).
"""

from .grouped_bias import grouped_dbias, grouped_dbias_dscales, grouped_scaled_bias_add
from .permute import token_combine, token_dispatch

__all__ = ["grouped_dbias", "grouped_dbias_dscales", "grouped_scaled_bias_add", "token_combine", "token_dispatch"]
