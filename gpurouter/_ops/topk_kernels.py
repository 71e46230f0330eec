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

from .._checks import TOPK_OP, TopkConfig
from .._transport import kernel_call

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
    # last output ("" none; _ops/topk.py's _qb_cutoff_mode decides)
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


def _topk_plan(cfg: TopkConfig, call: _KernelCall, logits, *extra):
    """The forward's plan for arrays (or Specs) of these shapes and dtypes."""
    from ..kernels._base.plan import as_spec
    from ..kernels.topk.plans import topk_with_score_function_fwd_plan

    kw = _indices_kw(call)
    if call.forced:
        kw["forced"] = True
    return topk_with_score_function_fwd_plan(
        as_spec(logits), (bool(extra) and not call.forced) or call.replay_bias, cfg.topk,
        cfg.use_pre_softmax, cfg.num_groups, cfg.group_topk, np.float32(cfg.scaling_factor), int(cfg.score_function),
        int(cfg.routing_map_format), **kw,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _topk(x, extra, cfg: TopkConfig, call: _KernelCall):
    """``extra``: the fp32 bias, the forced indices (``call.forced``) or None."""
    return _topk_fwd(x, extra, cfg, call)[0]


def _topk_vjp_fwd(x, extra, cfg: TopkConfig, call: _KernelCall):
    """The forward under a gradient: the kernels of its backward and of the
    rest of a router step start compiling in the background first
    (``step_prefetch.py``)."""
    from .step_prefetch import prefetch_router_step

    prefetch_router_step(x, cfg)
    return _topk_fwd(x, extra, cfg, call)


def _topk_fwd(x, extra, cfg: TopkConfig, call: _KernelCall):
    tokens, per_call = [x], []
    if extra is not None:
        (tokens if call.forced else per_call).append(extra)
    # The plan of this call's shapes, built at trace time (and cached): a plan's
    # error raises here, never inside a host callback, and its kernels compile
    # before the first launch on every transport.
    _topk_plan(cfg, call, x, *tokens[1:], *per_call)
    specs = _specs(x, x.dtype, cfg, call.write_indices)
    if call.qb_cutoff:  # (no gradient: its cotangent is never read)
        specs += (jax.ShapeDtypeStruct((x.shape[0],), jnp.float32),)
    out = kernel_call(functools.partial(_topk_plan, cfg, call), specs, tokens, per_call, call.transport)
    probs, routing_map, saved = out[:3]
    return (probs, routing_map, *out[3:]), (routing_map, saved)


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
    from ..kernels.topk.plans import topk_with_score_function_bwd_plan

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
