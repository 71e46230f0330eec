"""Public router top-k op: backend choice and the ``jax.custom_vjp`` around the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _backend, reference
from .._auto import kernels_faster as kernels_faster_here
from .._checks import (
    TOPK_OP,
    RoutingMapFormat,
    ScoreFunction,
    TopkConfig,
    array_meta,
    as_bool,
    check_forced_indices,
    check_kernel_dtype,
    check_topk_args,
    check_topk_variants,
    check_transport,
)
from .._sharding import axis_size, per_token_shard, token_axes
from .._transport import resolve_transport
from ..reference import _route as _ref_route
from .qb import histogram_after, use_kernels
from .topk_kernels import _aux_scores, _compact, _KernelCall, _map_spec, _topk, _warp_rule


def fused_topk_with_score_function(
    logits: jax.typing.ArrayLike,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int = -1,
    group_topk: int = -1,
    scaling_factor: float = 1.0,
    score_function: str | ScoreFunction = "softmax",
    expert_bias: jax.typing.ArrayLike | None = None,
    compute_aux_scores: bool = False,
    routing_map_format: str | int | RoutingMapFormat = RoutingMapFormat.BYTEMAP,
    *,
    return_indices: bool = False,
    forced_indices: jax.typing.ArrayLike | None = None,
    group_score: str = "sum_topk",
    compact: bool = False,
    indices_dtype="int32",
    qb_histogram: jax.typing.ArrayLike | None = None,
    qb_bin_bounds: jax.typing.ArrayLike | None = None,
    qb_histogram_mode: str | None = None,
    token_mask: jax.typing.ArrayLike | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    backend: str = "auto",
    transport: str = "auto",
) -> tuple[jax.Array, ...]:
    """Routes each token to ``topk`` experts; drop-in for TE's JAX router.

    Same arguments, defaults and results as
    :func:`gpurouter.reference.fused_topk_with_score_function` (see its
    docstring for the algorithm), plus:

    Args:
      backend: ``"jax"`` (the pure-jnp reference), ``"numba"`` (the Numba-CUDA
        kernels through ``jax.custom_vjp``) or ``"auto"`` (docs/contract.md section 5).
      transport: how ``backend="numba"`` reaches the kernels: ``"ffi"`` (XLA's
        typed FFI calls a compiled handler; JAX on a GPU), ``"zero-copy"``
        (``buffer_callback`` on XLA's device buffers and stream; JAX on a GPU),
        ``"callback"`` (``pure_callback`` through host copies) or ``"auto"``
        (docs/contract.md section 5). Ignored by the jax backend.

    With ``routing_map_format=BITMAP_U8`` the kernels write the packed map
    directly and the backward reads it; probs and gradients are those of the
    default BYTEMAP, bit for bit. ``return_indices`` (the kernels write the
    indices as they select) and ``forced_indices`` (routing replay: the
    kernels skip the selection) are gpurouter's keyword-only extensions, as
    are the router variants (docs/contract.md sections 9-12): ``group_score``,
    ``compact``, ``indices_dtype``, Quantile Balancing (``qb_histogram``,
    ``qb_bin_bounds``, ``token_mask``, ``axis_name``).

    With ``backend="numba"`` the kernels compute the routes and probs. The
    warp-per-token kernel (the one that takes most shapes) scores groups by
    every ``group_score`` rule and writes the compact outputs itself; on the
    other kernel families the variants are composed around the kernels,
    exactly: a ``group_score`` other than ``"sum_topk"`` selects in jnp and
    the kernels replay that selection (``forced_indices``: the same probs and
    gradients), and the compact weights are gathered from the kernels' probs
    at the indices they write. With sigmoid the QB counts are counted by the
    QB kernels (``kernels/topk/qb.py``; jnp with sqrtsoftplus, or where
    their sigmoid is not XLA's on the device): integer counts, the same
    histogram bit for bit.

    Raises:
      ValueError, TypeError: bad shapes, config or dtypes (at trace time).
      NotImplementedError: valid input beyond a kernel's limits (numba only).
      ImportError: ``backend="numba"`` without numba-cuda installed.
      RuntimeError: ``backend="numba"`` with neither a GPU nor the simulator;
        ``transport="zero-copy"`` without JAX on a CUDA GPU.
    """
    bias_shape, bias_dtype = (None, None) if expert_bias is None else array_meta(
        TOPK_OP, "expert_bias", expert_bias)
    logits_meta = array_meta(TOPK_OP, "logits", logits)
    cfg = check_topk_args(
        *logits_meta, topk, use_pre_softmax, num_groups,
        group_topk, scaling_factor, score_function, bias_shape, bias_dtype,
        compute_aux_scores, routing_map_format,
    )
    forced = forced_indices is not None
    if forced:
        check_forced_indices(TOPK_OP, forced_indices, jnp.shape(logits), cfg.topk, cfg.compute_aux_scores)
    return_indices = as_bool(TOPK_OP, "return_indices", return_indices)
    var = check_topk_variants(
        TOPK_OP, cfg, jnp.shape(logits), return_indices=return_indices, group_score=group_score,
        compact=compact, indices_dtype=indices_dtype, expert_bias=expert_bias, forced=forced,
        qb_histogram=qb_histogram, qb_bin_bounds=qb_bin_bounds, token_mask=token_mask,
        axis_name=axis_name, qb_histogram_mode=qb_histogram_mode,
        shards=axis_size(TOPK_OP, axis_name) if qb_histogram is not None else 1)
    # the compact result is gathered at the indices: the route writes them
    return_indices = var.return_indices or var.compact
    check_transport(TOPK_OP, transport)  # validated whatever the backend
    logits = jnp.asarray(logits)
    shape, num_experts = logits.shape, logits.shape[-1]

    def kernels_faster() -> bool:
        # "auto": the measured rule (gpurouter/_auto.py), only where the
        # kernels take the call at all; indices, replays and the composed
        # variants stay on jax. QB follows the route's rule: its counts are
        # the QB kernels' (sigmoid) or the same jnp counts as on jax (H200,
        # performance.md: the jnp counts added 1454.5 us to the jax top-k at
        # 5fc7012; the whole QB op on the kernels took 314.8 us at 96ca891).
        rule_composed = var.group_score != "sum_topk" and not (cfg.grouped and _warp_rule(cfg, num_experts))
        # compact on the warp kernel writes its indices itself
        warp_compact = var.compact and not var.return_indices and not cfg.compute_aux_scores and not forced
        indices_composed = return_indices and not (warp_compact and _warp_rule(cfg, num_experts))
        if indices_composed or forced or rule_composed or logits_meta[1] == np.float64:
            return False
        try:
            from ..kernels._base.limits import check_limits

            check_limits(TOPK_OP, num_experts, cfg.topk, cfg.num_groups if cfg.grouped else 1)
        except (ImportError, NotImplementedError):
            return False
        return kernels_faster_here(TOPK_OP, transport, logits.size // max(num_experts, 1), num_experts, cfg.topk)

    backend = _backend.resolve(TOPK_OP, backend, faster=kernels_faster)
    # The bias only selects: not with the aux scores, softmax, or a replay.
    use_bias = (expert_bias is not None and not cfg.compute_aux_scores and not forced
                and cfg.score_function != ScoreFunction.SOFTMAX)
    bias = jnp.asarray(expert_bias) if use_bias else None
    # Indices the op computes (a replay returns its forced indices instead).
    write_indices = return_indices and not forced
    # compact on the warp kernel: it writes only the weights and indices [T, K]
    compact_kernel = (backend != "jax" and var.compact and not forced and not cfg.compute_aux_scores
                      and _warp_rule(cfg, num_experts))
    qb_cut = ""  # the QB cutoff from the route (_qb_cutoff_mode; "": the QB plan's own pass)
    if backend == "jax":
        def route(x, *rest):
            b = rest[0] if bias is not None else None
            f = rest[0] if forced else None
            return reference.fused_topk_with_score_function(
                x, topk, use_pre_softmax, num_groups, group_topk, scaling_factor,
                score_function, b, compute_aux_scores, cfg.routing_map_format,
                return_indices=write_indices, forced_indices=f, group_score=var.group_score)
    else:
        transport = resolve_transport(TOPK_OP, transport)
        check_kernel_dtype(TOPK_OP, "logits", logits_meta[1])  # the caller's dtype, before jnp's cast
        from ..kernels._base.limits import check_limits

        check_limits(TOPK_OP, num_experts, cfg.topk, cfg.num_groups if cfg.grouped else 1)
        if bias is not None:
            # The kernels read an fp32 bias; a half bias is upcast here (exactly).
            check_kernel_dtype(TOPK_OP, "expert_bias", bias_dtype)
            bias = bias.astype(jnp.float32)

        qb_cut = _qb_cutoff_mode(cfg, var, logits, forced, compact_kernel, transport)

        def route(logits, *rest):  # the rows [T, E] of one token shard
            if compact_kernel:
                return _compact(logits, rest[0] if rest else None, cfg,
                                _KernelCall(transport, False, True, False, var.group_score))
            if cfg.compute_aux_scores:
                return _aux_scores(logits, cfg, logits.dtype, transport, write_indices)
            if var.group_score != "sum_topk" and not forced and cfg.grouped and _warp_rule(cfg, num_experts):
                # the warp kernel scores the groups by the rule itself
                return _topk(logits, rest[0] if rest else None, cfg,
                             _KernelCall(transport, False, write_indices, False, var.group_score, qb_cut))
            if var.group_score != "sum_topk" and not forced:
                # the token and lane kernels score groups by sum_topk only: select
                # in jnp, then replay that selection (the same probs and gradients)
                b = rest[0] if rest else None
                idx = _ref_route.selection(logits, b, cfg, var.group_score)
                out = _topk(logits, idx, cfg, _KernelCall(transport, True, False, b is not None))
                return (*out, idx) if write_indices else out
            replay_bias = forced and expert_bias is not None and cfg.score_function != ScoreFunction.SOFTMAX
            return _topk(logits, rest[0] if rest else None, cfg,
                         _KernelCall(transport, forced, write_indices, replay_bias, "sum_topk", qb_cut))

    x = logits.reshape(-1, num_experts)
    map_spec = _map_spec(x.shape, cfg)
    map_shape = shape[:-1] + map_spec.shape[-1:]
    idx_shape = shape[:-1] + (cfg.topk,)
    qb = ()
    valid = None if token_mask is None else jnp.asarray(token_mask).reshape(x.shape[0])
    if var.qb and not qb_cut:  # this call's QB counts: the QB kernels on numba (sigmoid), else jnp (exact)
        qb = (histogram_after(x, jnp.asarray(expert_bias), cfg, var.group_score, qb_histogram, qb_bin_bounds,
                              valid, axis_name, transport if backend != "jax" else None),)
    if x.shape[0] == 0:
        out_dtype = jnp.float32 if cfg.compute_aux_scores else logits.dtype
        idx = jnp.zeros(idx_shape, var.indices_dtype)
        if var.compact:
            return (jnp.zeros(idx_shape, out_dtype), idx, *qb)
        empty = (jnp.zeros(shape, out_dtype), jnp.zeros(map_shape, map_spec.dtype))
        return (*empty, idx, *qb) if return_indices else (*empty, *qb)
    tokens = [x]
    if forced:
        tokens.append(jnp.asarray(forced_indices).reshape(-1, cfg.topk).astype(jnp.int32))
    # Token-sharded logits: each device routes its own tokens (_sharding.py).
    n_out = (3 if write_indices and not compact_kernel else 2) + 2 * bool(qb_cut)
    out = per_token_shard(route, tokens, [] if bias is None else [bias], n_out)
    if qb_cut:  # the QB counts on the route's cutoff and scores (its last two outputs)
        qb = (histogram_after(x, jnp.asarray(expert_bias), cfg, var.group_score, qb_histogram, qb_bin_bounds,
                              valid, axis_name, transport, cutoff=out[-2], scores=out[-1]),)
        out = out[:-2]
    if compact_kernel:
        return (out[0].reshape(idx_shape), out[1].astype(var.indices_dtype).reshape(idx_shape), *qb)
    if forced:  # the map's experts: -1 for an entry that selects nothing (contract section 2)
        from ..reference._select import replay_indices

        idx_rows = replay_indices(jnp.asarray(forced_indices).reshape(-1, cfg.topk), num_experts)
    elif return_indices:
        idx_rows = out[2]
    if var.compact:
        weights = jnp.take_along_axis(out[0], jnp.maximum(idx_rows, 0), axis=-1)
        weights = jnp.where(idx_rows >= 0, weights, jnp.zeros((), weights.dtype))
        return (weights.reshape(idx_shape), idx_rows.astype(var.indices_dtype).reshape(idx_shape), *qb)
    probs, routing_map = out[0].reshape(shape), out[1].reshape(map_shape)
    if not return_indices:
        return (probs, routing_map, *qb)
    return (probs, routing_map, idx_rows.astype(var.indices_dtype).reshape(idx_shape), *qb)




def _qb_cutoff_mode(cfg: TopkConfig, var, logits, forced: bool, compact_kernel: bool, transport: str) -> str:
    """Whether the route writes the QB cutoff (the one place that decides): the QB
    counts on the kernels (sigmoid and a kernel exp mode, ``qb.use_kernels``) and
    the route on the warp kernel's dense forward (``_warp_rule``: not a replay, not
    the aux scores or the compact kernel, not a group rule the warp kernel does not
    score), its tokens not sharded, T > 0.  Returns the exp mode, or "" (the QB
    plan's own cutoff pass)."""
    num_experts = logits.shape[-1]
    rows = logits.reshape(-1, num_experts)
    if not var.qb or forced or compact_kernel or cfg.compute_aux_scores or rows.shape[0] == 0:
        return ""
    if var.group_score != "sum_topk" and not cfg.grouped:  # (the jnp selection, replayed)
        return ""
    if not _warp_rule(cfg, num_experts) or token_axes(rows) is not None:
        return ""
    return use_kernels(cfg, transport) or ""
