"""The Quantile-Balancing histogram of the public router op (docs/contract.md
section 12), on every backend: this call's counts in jnp from the logits,
added (saturating) to the caller's histogram.

Under a token-sharded ``jit`` (explicit sharding) each device counts its own
tokens and the counts are all-reduced, as the routes are computed per shard
(gpurouter/_sharding.py): a global scatter-add of token-sharded bins has no
single output sharding JAX could pick.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._checks import TopkConfig
from .._sharding import token_axes
from ..reference._route import qb_call_counts
from ..reference.variants import saturating_add


def histogram_after(x, expert_bias, cfg: TopkConfig, group_score: str, histogram, bin_bounds,
                    valid=None, axis_name=None) -> jax.Array:
    """``histogram`` plus the counts of the rows ``x [T, E]`` (valid ones),
    summed over ``axis_name`` once, each bin saturating at ``2**31 - 1``."""
    histogram = jnp.asarray(histogram)
    num_bins = histogram.shape[1]
    bias, bounds = jnp.asarray(expert_bias), jnp.asarray(bin_bounds)
    info = token_axes(x)
    if info is None:
        counts = qb_call_counts(x, bias, cfg, group_score, num_bins, bounds, valid)
    else:
        mesh, tok = info
        names = tok if isinstance(tok, tuple) else (tok,)
        v = jnp.ones((x.shape[0],), bool) if valid is None else valid

        def local(xl, vl, b, lo_hi):
            return lax.psum(qb_call_counts(xl, b, cfg, group_score, num_bins, lo_hi, vl), names)

        args = [jax.sharding.reshard(a, NamedSharding(mesh, spec))
                for a, spec in ((x, P(tok, None)), (v, P(tok)), (bias, P()), (bounds, P()))]
        counts = jax.shard_map(local, mesh=mesh, in_specs=(P(tok, None), P(tok), P(), P()),
                               out_specs=P())(*args)
    if axis_name is not None:
        counts = lax.psum(counts, axis_name)
    return saturating_add(histogram, counts)
