"""The top-k op's kernel calls (custom_vjp wiring): the dense forward and
backward, and the compact forward of the warp kernel (its primal the compact
mode alone; under a gradient the dense forward, gathered, and the dense
backward of the cotangent scattered to ``[T, E]``)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import TOPK_OP, AuxLossConfig, TopkConfig
from .._transport import kernel_call, prefetch

# ----------------------------------------------------------------------------
# custom_vjp wiring: forward and backward each call the kernels through
# kernel_call, nothing else.
# ----------------------------------------------------------------------------


def _map_spec(shape: tuple[int, int], cfg: TopkConfig) -> jax.ShapeDtypeStruct:
    """The routing map of ``[T, E]`` logits: ``[T, E]`` bool, or ``[T, ceil(E/8)]`` uint8."""
    t, e = shape
    if cfg.bitmap:
        return jax.ShapeDtypeStruct((t, -(-e // 8)), jnp.uint8)
    return jax.ShapeDtypeStruct((t, e), jnp.bool_)


def _specs(x: jax.Array, probs_dtype, cfg: TopkConfig, write_indices: bool = False):
    t, e = x.shape
    specs = (
        jax.ShapeDtypeStruct((t, e), probs_dtype),
        _map_spec((t, e), cfg),
        jax.ShapeDtypeStruct((t, e), jnp.float32),
    )
    return specs + ((jax.ShapeDtypeStruct((t, cfg.topk), jnp.int32),) if write_indices else ())


class _KernelCall(NamedTuple):
    """How one top-k call reaches the kernels (static, hashable)."""

    transport: str
    forced: bool  # routing replay: the second per-token input is [T, K] int32 indices
    write_indices: bool  # a fourth output, [T, K] int32 indices in selection order
    # a replay of a call with an expert bias: the bias is never read, but the
    # kernels then sum the weights' normaliser in that call's order (bit-exact)
    replay_bias: bool = False
    group_score: str = "sum_topk"  # the group-score rule (the warp kernel's, _warp_rule)
    # the QB exp mode: the warp forward also writes the QB cutoff alpha [T] f32, the
    # last output but one, and its saved scores [T, E] f32 are the last ("" none;
    # _ops/topk.py's _qb_cutoff_mode decides)
    qb_cutoff: str = ""


def _warp_rule(cfg: TopkConfig, num_experts: int) -> bool:
    """Whether the forward's kernel (path "auto") is the warp kernel, which
    computes every group-score rule and the compact outputs (the token and lane
    kernels: sum_topk only, dense outputs); False without numba-cuda."""
    try:
        from ..kernels.topk.warp_paths import use_warp_path
    except ImportError:
        return False

    g, kg = (cfg.num_groups, cfg.group_topk) if cfg.grouped else (0, 0)
    return use_warp_path("auto", TOPK_OP, num_experts, cfg.topk, g, kg,
                         int(cfg.score_function), cfg.use_pre_softmax, False)


def _indices_kw(call: _KernelCall) -> dict:
    # only when asked: kernel launchers without these options stay callable
    kw = {"return_indices": True} if call.write_indices else {}
    if call.group_score != "sum_topk":
        kw["group_score"] = call.group_score
    if call.qb_cutoff:
        kw["qb_cutoff"] = call.qb_cutoff
    return kw


def _topk_plan(cfg: TopkConfig, call: _KernelCall, save: bool, logits, *extra):
    """The forward's plan for arrays (or Specs) of these shapes and dtypes;
    ``save``: whether the saved scores are an output (the backward's input)."""
    from ..kernels._base.plan import as_spec
    from ..kernels.topk.plans import topk_with_score_function_fwd_plan

    kw = _indices_kw(call)
    if call.forced:
        kw["forced"] = True
    if not save:
        kw["save"] = False
    return topk_with_score_function_fwd_plan(
        as_spec(logits), (bool(extra) and not call.forced) or call.replay_bias, cfg.topk,
        cfg.use_pre_softmax, cfg.num_groups, cfg.group_topk, np.float32(cfg.scaling_factor), int(cfg.score_function),
        int(cfg.routing_map_format), **kw,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _topk(x, extra, cfg: TopkConfig, call: _KernelCall):
    """``extra``: the fp32 bias, the forced indices (``call.forced``) or None.
    Without a gradient the warp kernel's saved scores are not an output (nor
    allocated: it skips their stores), except where the QB counts read them
    (the QB cutoff); the other kernels always write them (the one place that
    decides)."""
    save = call.forced or bool(call.qb_cutoff) or not _warp_rule(cfg, x.shape[-1])
    return _topk_fwd(x, extra, cfg, call, save=save)[0]


def _topk_vjp_fwd(x, extra, cfg: TopkConfig, call: _KernelCall):
    """The forward under a gradient: the kernels of its backward and of the
    rest of a router step start compiling in the background first
    (``prefetch_router_step``)."""
    prefetch_router_step(x, cfg)
    return _topk_fwd(x, extra, cfg, call)


def _topk_fwd(x, extra, cfg: TopkConfig, call: _KernelCall, save: bool = True):
    tokens, per_call = [x], []
    if extra is not None:
        (tokens if call.forced else per_call).append(extra)
    # The plan of this call's shapes, built at trace time (and cached): a plan's
    # error raises here, never inside a host callback, and its kernels compile
    # before the first launch on every transport.
    _topk_plan(cfg, call, save, x, *tokens[1:], *per_call)
    specs = list(_specs(x, x.dtype, cfg, call.write_indices))
    if not save:
        del specs[2]
    if call.qb_cutoff:  # (no gradient: its cotangent is never read)
        specs.append(jax.ShapeDtypeStruct((x.shape[0],), jnp.float32))
    out = kernel_call(functools.partial(_topk_plan, cfg, call, save), specs, tokens, per_call, call.transport)
    probs, routing_map = out[:2]
    saved = out[2] if save else None
    rest = out[2 + save:]
    # with the QB cutoff the saved scores are an output too (last, after alpha): the QB counts read them
    qb = (saved,) if call.qb_cutoff else ()
    return (probs, routing_map, *rest, *qb), (routing_map, saved)


def _compact_plan(cfg: TopkConfig, call: _KernelCall, logits, *extra):
    from ..kernels.topk.plans import topk_with_score_function_fwd_plan

    return topk_with_score_function_fwd_plan(
        logits, bool(extra), cfg.topk, cfg.use_pre_softmax, cfg.num_groups, cfg.group_topk,
        np.float32(cfg.scaling_factor), int(cfg.score_function), int(cfg.routing_map_format),
        group_score=call.group_score, compact=True,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _compact(x, bias, cfg: TopkConfig, call: _KernelCall):
    """The compact outputs ``(weights [T, K] x.dtype, indices [T, K] int32)``: the
    primal launches only the warp kernel's compact mode."""
    t = x.shape[0]
    specs = (jax.ShapeDtypeStruct((t, cfg.topk), x.dtype), jax.ShapeDtypeStruct((t, cfg.topk), jnp.int32))
    out = kernel_call(functools.partial(_compact_plan, cfg, call),
        specs, [x], [] if bias is None else [bias], call.transport,
    )
    return out[0], out[1]


def _compact_fwd(x, bias, cfg: TopkConfig, call: _KernelCall):
    # under a gradient: the dense forward (its map and saved scores are what the
    # backward reads), gathered at its indices: the compact kernel's bits
    (probs, _, idx), res = _topk_vjp_fwd(x, bias, cfg, call)
    return (jnp.take_along_axis(probs, idx, axis=-1), idx), (res, idx)


def _compact_bwd(cfg: TopkConfig, call: _KernelCall, res, cts):
    dense_res, idx = res
    g = cts[0]
    rows = jnp.arange(g.shape[0])[:, None]
    dense = jnp.zeros((g.shape[0], dense_res[1].shape[-1]), g.dtype).at[rows, idx].add(g)
    return _topk_bwd(cfg, call, dense_res, (dense,))


_compact.defvjp(_compact_fwd, _compact_bwd)


def _topk_bwd_plan(cfg: TopkConfig, routing_map, saved, grad_probs):
    from ..kernels.topk.bwd_plans import topk_with_score_function_bwd_plan

    return topk_with_score_function_bwd_plan(
        grad_probs, cfg.topk, cfg.use_pre_softmax, np.float32(cfg.scaling_factor),
        int(cfg.score_function), int(cfg.routing_map_format),
    )


def _topk_bwd(cfg: TopkConfig, call: _KernelCall, res, cts):
    routing_map, saved = res
    grad_probs = cts[0]
    (grad_logits,) = kernel_call(functools.partial(_topk_bwd_plan, cfg),
        [jax.ShapeDtypeStruct(grad_probs.shape, grad_probs.dtype)],
        [routing_map, saved, grad_probs], (), call.transport,
    )
    # the bias only selects and the forced indices are integers: no gradient (None = zero)
    return grad_logits, None


_topk.defvjp(_topk_vjp_fwd, _topk_bwd)


# The aux scores (compute_aux_scores=True): forward and backward kernels


def _aux_plan(cfg: TopkConfig, write_indices: bool, logits):
    from ..kernels.topk.aux_plans import score_for_aux_loss_fwd_plan

    kw = {"return_indices": True} if write_indices else {}
    return score_for_aux_loss_fwd_plan(
        logits, cfg.topk, int(cfg.score_function), int(cfg.routing_map_format), **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _aux_scores(x, cfg: TopkConfig, dtype, transport: str, write_indices: bool):
    return _aux_scores_fwd(x, cfg, dtype, transport, write_indices)[0]


def _aux_scores_vjp_fwd(x, cfg: TopkConfig, dtype, transport: str, write_indices: bool):
    """Under a gradient: the backward's kernels start compiling first (``_transport.prefetch``)."""
    saved = _specs(x, jnp.float32, cfg)[2]
    prefetch(functools.partial(_aux_bwd_plan, cfg, dtype), [saved, jax.ShapeDtypeStruct(saved.shape, jnp.float32)])
    return _aux_scores_fwd(x, cfg, dtype, transport, write_indices)


def _aux_scores_fwd(x, cfg: TopkConfig, dtype, transport: str, write_indices: bool):
    out = kernel_call(functools.partial(_aux_plan, cfg, write_indices),
        _specs(x, jnp.float32, cfg, write_indices), [x], (), transport,
    )
    scores, routing_map, saved = out[:3]
    return (scores, routing_map, *out[3:]), saved


def _aux_bwd_plan(cfg: TopkConfig, out_dtype, saved, grad_scores):
    from ..kernels._base.launch import kind_of_dtype
    from ..kernels.topk.aux_plans import score_for_aux_loss_bwd_plan

    kind = kind_of_dtype(out_dtype, "out_dtype", "score_for_aux_loss_bwd")
    return score_for_aux_loss_bwd_plan(saved, int(cfg.score_function), kind)


def _aux_scores_bwd(cfg: TopkConfig, dtype, transport: str, write_indices: bool, saved, cts):
    grad_scores = cts[0].astype(jnp.float32)
    (grad_logits,) = kernel_call(functools.partial(_aux_bwd_plan, cfg, dtype),
        [jax.ShapeDtypeStruct(saved.shape, dtype)],
        [saved, grad_scores], (), transport,
    )
    return (grad_logits,)


_aux_scores.defvjp(_aux_scores_vjp_fwd, _aux_scores_bwd)


# A router step's other kernels compiled in the background while its first
# op is traced (docs/cache.md, "Background compiles while the trace goes on").
#
# The trace reaches each op's kernels one after another, and each op waits
# for its own, so a cold process compiles a step's forward kernels in
# sequence. TE's router step (and gpurouter's presets, ``coldstart``) uses the
# same logits three times under one gradient: the top-k, the aux scores
# (``compute_aux_scores=True``) and the aux loss over those scores. When the
# top-k's forward is traced under a gradient, :func:`prefetch_router_step`
# submits the kernels of the other two, forward and backward, for these
# logits, and the top-k's own backward, to the background workers
# (``_transport.prefetch``). A step that does not use them costs only those
# workers' CPU time once per configuration; ``GPUROUTER_COMPILE_WORKERS=0``
# turns every worker off.


def router_step_calls(x, cfg: TopkConfig) -> list:
    """``(planner, arrays)`` of the calls a router step on logits ``x`` makes
    after the top-k forward: its backward, the aux scores' forward and
    backward, the aux loss's forward and backward (``arrays``: structs in
    each call's order). The planners are the ops' own."""
    from . import aux_loss

    t, e = x.shape
    f32 = jnp.float32
    probs, routing_map, saved = _specs(x, x.dtype, cfg)[:3]
    aux_cfg = cfg  # (the aux planners read its topk, score function and map format)
    aux_saved = _specs(x, f32, aux_cfg)[2]
    counts = jax.ShapeDtypeStruct((e,), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), f32)
    loss_cfg = AuxLossConfig(topk=cfg.topk, coeff=1e-2, total_num_tokens=t, num_experts=e)
    return [
        (functools.partial(_topk_bwd_plan, cfg), [routing_map, saved, probs]),
        (functools.partial(_aux_plan, aux_cfg, False), [x]),
        (functools.partial(_aux_bwd_plan, aux_cfg, x.dtype),
         [aux_saved, jax.ShapeDtypeStruct(aux_saved.shape, f32)]),
        (functools.partial(aux_loss._fwd_plan, loss_cfg), [jax.ShapeDtypeStruct((t, e), f32), counts]),
        (functools.partial(aux_loss._bwd_plan, t), [scalar, counts, scalar]),
    ]


def prefetch_router_step(x, cfg: TopkConfig) -> int:
    """Submits :func:`router_step_calls`' kernels to the background workers; the number submitted."""
    if np.dtype(x.dtype) == np.float64:
        return 0
    return sum(prefetch(planner, arrays) for planner, arrays in router_step_calls(x, cfg))
