"""The Quantile-Balancing histogram of the public router op (docs/contract.md
section 12): this call's counts from the logits, added (saturating) to the
caller's histogram.

Who counts (docs/ops/topk.md, "Quantile Balancing"):

- ``backend="jax"``: jnp (``reference._route.qb_call_counts``);
- ``backend="numba"`` with sigmoid scores: the kernels of
  ``gpurouter/kernels/topk/qb.py`` (a cutoff pass, a shared-memory histogram
  pass), the same counts bit for bit, once this process has checked that the
  kernels' sigmoid is XLA's on the device (:func:`kernel_exp_mode`); where it
  is not (no mode matches), and with sqrtsoftplus, jnp as on jax.

Under a token-sharded ``jit`` (explicit sharding) each device counts its own
tokens and the counts are all-reduced, as the routes are computed per shard
(gpurouter/_sharding.py): a global scatter-add of token-sharded bins has no
single output sharding JAX could pick. The kernels run once per shard there.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._checks import ScoreFunction, TopkConfig
from .._sharding import token_axes
from .._transport import kernel_call
from ..reference._route import qb_call_counts
from ..reference.variants import saturating_add

#: probe values of the one-time sigmoid check: a dense grid over the range
#: where sigmoid is neither 0 nor 1 in fp32, random normals, and the edges
_PROBE_GRID = 1 << 16


def _probe_values(simulator: bool) -> np.ndarray:
    n = 512 if simulator else _PROBE_GRID
    rng = np.random.default_rng(37)
    grid = np.linspace(-104.0, 20.0, n, dtype=np.float32)
    normal = (rng.standard_normal(n) * 4).astype(np.float32)
    edges = np.array([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 88.5, -88.5, 89.0, -89.0, 100.0, -100.0,
                      np.inf, -np.inf], np.float32)
    return np.concatenate([grid, normal, edges])


@functools.cache
def kernel_exp_mode() -> str | None:
    """The QB kernels' ``exp_mode`` whose sigmoid equals ``jax.nn.sigmoid`` here
    bit for bit on the probe values (checked once a process, on the default
    device), or None (then the histogram is counted in jnp, with a warning)."""
    from ..kernels._base.launch import simulator_enabled
    from ..kernels.topk.qb_math import EXP_MODES, default_exp_mode, qb_sigmoid_probe

    sim = simulator_enabled()
    x = _probe_values(sim)
    with jax.ensure_compile_time_eval():
        want = np.asarray(jax.nn.sigmoid(jnp.asarray(x)))
    modes = [default_exp_mode()] + ([] if sim else [m for m in EXP_MODES if m != default_exp_mode()])
    for mode in modes:
        got = qb_sigmoid_probe(x, mode)
        if np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            return mode
    warnings.warn("gpurouter: the QB kernels' sigmoid differs from jax.nn.sigmoid on this device; the QB "
                  "histogram of backend='numba' is counted in jnp (exact, slower).", RuntimeWarning, stacklevel=3)
    return None


def _kernel_counts(x, bias, bounds, valid, cfg: TopkConfig, group_score: str, num_bins: int, transport: str,
                   exp_mode: str, cutoff=None, scores=None):
    """This call's counts ``[E, B]`` int32 by the QB kernels (one shard's rows);
    ``cutoff``: the route's ``alpha [T]`` (the QB plan then skips its cutoff pass);
    ``scores`` (with it): the route's saved scores ``[T, E]`` f32, read instead of ``x``."""
    groups = cfg.num_groups if cfg.grouped else 0
    kg = cfg.group_topk if cfg.grouped else 0
    static = (cfg.topk, num_bins, groups, kg, group_score, exp_mode, cutoff is not None, scores is not None)
    rows = x if scores is None else scores
    # counts have no gradient: the kernel call must not be differentiated
    args = [lax.stop_gradient(a) for a in (rows, bias.astype(jnp.float32), bounds.astype(jnp.float32))]
    if valid is not None:
        args.append(valid.astype(jnp.bool_))
    if cutoff is not None:
        args.append(lax.stop_gradient(cutoff))
    spec = [jax.ShapeDtypeStruct((x.shape[1], num_bins), jnp.int32)]
    (counts,) = kernel_call(functools.partial(_plan, static), spec, [], args, transport)
    return counts


def _plan(static, x, bias, bounds, *rest):
    from ..kernels.topk.qb import qb_counts_plan

    topk, num_bins, groups, kg, rule, mode, given, scored = static
    masked = len(rest) > int(given)  # rest: [valid], then [alpha]
    kw = {"cutoff_given": True} if given else {}
    if scored:  # x: the route's scores
        kw["scores_given"] = True
    return qb_counts_plan(x, masked, topk, num_bins, groups, kg, rule, mode, **kw)


def use_kernels(cfg: TopkConfig, transport: str | None) -> str | None:
    """The exp mode the QB kernels run with for this call, or None (jnp counts):
    ``transport`` None means ``backend="jax"``."""
    if transport is None or cfg.score_function != ScoreFunction.SIGMOID:
        return None
    return kernel_exp_mode()


def histogram_after(x, expert_bias, cfg: TopkConfig, group_score: str, histogram, bin_bounds,
                    valid=None, axis_name=None, transport: str | None = None, cutoff=None,
                    scores=None) -> jax.Array:
    """``histogram`` plus the counts of the rows ``x [T, E]`` (valid ones),
    summed over ``axis_name`` once, each bin saturating at ``2**31 - 1``.
    ``transport``: the kernels' (resolved) transport on ``backend="numba"``,
    None on jax.  ``cutoff``: ``alpha [T]`` f32 from the route (the warp
    forward's QB cutoff; rows not token-sharded, the kernels counting:
    ``_ops/topk.py: _qb_cutoff_mode``), given to the QB plan, which then skips
    its cutoff pass; ``scores``: with it, the route's saved scores ``[T, E]`` f32
    (the QB sigmoid), which the histogram reads instead of ``x``."""
    histogram = jnp.asarray(histogram)
    num_bins = histogram.shape[1]
    bias, bounds = jnp.asarray(expert_bias), jnp.asarray(bin_bounds)
    mode = use_kernels(cfg, transport) if x.shape[0] else None

    def count(xl, b, lo_hi, vl, cut=None, sc=None):
        if mode is None:
            return qb_call_counts(xl, b, cfg, group_score, num_bins, lo_hi, vl)
        return _kernel_counts(xl, b, lo_hi, vl, cfg, group_score, num_bins, transport, mode, cut, sc)

    info = token_axes(x)
    if info is None:
        counts = count(x, bias, bounds, valid, cutoff, scores)
    else:
        mesh, tok = info
        names = tok if isinstance(tok, tuple) else (tok,)
        v = jnp.ones((x.shape[0],), bool) if valid is None else valid

        def local(xl, vl, b, lo_hi):
            return lax.psum(count(xl, b, lo_hi, vl), names)

        args = [jax.sharding.reshard(a, NamedSharding(mesh, spec))
                for a, spec in ((x, P(tok, None)), (v, P(tok)), (bias, P()), (bounds, P()))]
        counts = jax.shard_map(local, mesh=mesh, in_specs=(P(tok, None), P(tok), P(), P()),
                               out_specs=P())(*args)
    if axis_name is not None:
        counts = lax.psum(counts, axis_name)
    return saturating_add(histogram, counts)
