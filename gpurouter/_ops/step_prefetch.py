"""A training step's other router kernels compiled in the background while
its first op is traced (docs/cache.md, "A cold first call").

The trace reaches each op's kernels one after another, and each op waits
for its own, so a cold process compiles a step's forward kernels in
sequence. TE's router step (and gpurouter's presets, ``coldstart``) uses the
same logits three times under one gradient: the top-k, the aux scores
(``compute_aux_scores=True``) and the aux loss over those scores. When the
top-k's forward is traced under a gradient, :func:`prefetch_router_step`
submits the kernels of the other two, forward and backward, for these
logits, and the top-k's own backward, to the background workers
(``_transport.prefetch``). A step that does not use them costs only those
workers' CPU time once per configuration; ``GPUROUTER_COMPILE_WORKERS=0``
turns every worker off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import AuxLossConfig, TopkConfig
from .._transport import prefetch


def router_step_calls(x, cfg: TopkConfig) -> list:
    """``(planner, arrays)`` of the calls a router step on logits ``x`` makes
    after the top-k forward: its backward, the aux scores' forward and
    backward, the aux loss's forward and backward (``arrays``: structs in
    each call's order). The planners are the ops' own."""
    from . import aux_loss, topk, topk_kernels

    t, e = x.shape
    f32 = jnp.float32
    probs, routing_map, saved = topk_kernels._specs(x, x.dtype, cfg)[:3]
    aux_cfg = cfg  # (the aux planners read its topk, score function and map format)
    aux_saved = topk_kernels._specs(x, f32, aux_cfg)[2]
    counts = jax.ShapeDtypeStruct((e,), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), f32)
    loss_cfg = AuxLossConfig(topk=cfg.topk, coeff=1e-2, total_num_tokens=t, num_experts=e)
    return [
        (functools.partial(topk_kernels._topk_bwd_plan, cfg), [routing_map, saved, probs]),
        (functools.partial(topk._aux_plan, aux_cfg, False), [x]),
        (functools.partial(topk._aux_bwd_plan, aux_cfg, x.dtype),
         [aux_saved, jax.ShapeDtypeStruct(aux_saved.shape, f32)]),
        (functools.partial(aux_loss._fwd_plan, loss_cfg), [jax.ShapeDtypeStruct((t, e), f32), counts]),
        (functools.partial(aux_loss._bwd_plan, t), [scalar, counts, scalar]),
    ]


def prefetch_router_step(x, cfg: TopkConfig) -> int:
    """Submits :func:`router_step_calls`' kernels to the background workers; the number submitted."""
    if np.dtype(x.dtype) == np.float64:
        return 0
    return sum(prefetch(planner, arrays) for planner, arrays in router_step_calls(x, cfg))
