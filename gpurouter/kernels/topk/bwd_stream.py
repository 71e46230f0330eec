"""The streaming backward kernel of the top-k and aux-score ops: E not a
multiple of 4 (the other shapes take ``quad_bwd.py``); launched by
``topk.bwd_plans.topk_with_score_function_bwd_plan`` (with the routing map) and
``aux_scores.score_for_aux_loss_bwd_plan`` (no map: every expert selected,
scale 1, the K > 1 normalisation).

VJP (docs/contract.md section 3), m the routing mask, g = grad_probs * scaling_factor:

- sigmoid/sqrtsoftplus, K > 1: probs_i = a_i / (S + eps), S = sum_m a, so
  d/da_e = m_e (g_e / (S + eps) - D / (S + eps)^2) with D = sum_m g a;
  then dx = that * da/dx.  K == 1: dx = m g da/dx.
- softmax post: t = softmax over I of x, so dx = m q (g - sum_m g q).
- softmax pre: probs = m p with p = softmax over E, so dx = p (m g - sum m g p).

Per token: the sums (W lanes, tree-combined), then elementwise.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from .._base.parallel import recipe

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types

from .._base.access import loader_2d, storer_2d
from .._base.device import EPS, SOFTMAX, SQRTSOFTPLUS, ZERO, activation_grad, sqrtsoftplus
from .lane.rows import tree_reduce


@functools.cache
def pair_loader(kind: str):
    """Device function ``pair(saved, grad, token, j, needed)``: ``(saved[token, j],
    grad[token, j])`` as fp32 (``grad`` of ``kind``) where ``needed``, else zeros
    (no load: unselected experts' saved scores and gradients are never read)."""
    load = loader_2d(kind)

    @cuda.jit(device=True)
    def pair(saved, grad, token, j, needed):
        if needed:
            return saved[token, j], load(grad, token, j)
        return ZERO, ZERO

    return pair


@cuda.jit(device=True)
def accumulate_sums(total, dot, x, g, scale, score_fn):
    """``(S + a, D + (g * scale) * a)`` for a selected expert (``a`` from saved ``x``)."""
    a = sqrtsoftplus(x) if score_fn == SQRTSOFTPLUS else x
    return np.float32(total + a), np.float32(dot + np.float32(np.float32(g * scale) * a))


@cuda.jit(device=True)
def topk_dx(x, g, sel, dense, den, dsum, scale, topk, score_fn):
    """d logit of one element (docs/contract.md section 3), from saved ``x`` and the raw
    gradient ``g`` (scaled here); 0 for unselected experts unless ``dense``
    (softmax-pre, where every p contributes)."""
    if not (sel or dense):
        return ZERO
    a = sqrtsoftplus(x) if score_fn == SQRTSOFTPLUS else x
    gs = np.float32(g * scale) if sel else ZERO
    if score_fn == SOFTMAX:
        return np.float32(a * (gs - dsum))
    gp = gs
    if topk > 1:
        gp = np.float32(gs / den - dsum / np.float32(den * den))
    return np.float32(gp * activation_grad(x, a, score_fn))


@functools.cache
def mask_reader(has_map: bool, bitmap: bool = False):
    """Device function ``mask(routing_map, token, j, inside)``: the routing map
    at ``[token, j]`` (False past the row's end; ``bitmap``: a BITMAP_U8
    ``[T, ceil(E/8)]`` map, bit ``j % 8`` of byte ``j // 8``), or, without a
    map (the aux-score backward: every expert counts), ``inside``."""
    if has_map and bitmap:

        @cuda.jit(device=True)
        def mask(routing_map, token, j, inside):
            if not inside:
                return False
            return (np.uint32(routing_map[token, j >> 3]) >> np.uint32(j & 7)) & np.uint32(1) != 0

    elif has_map:

        @cuda.jit(device=True)
        def mask(routing_map, token, j, inside):
            return routing_map[token, j] if inside else False

    else:

        @cuda.jit(device=True)
        def mask(routing_map, token, j, inside):
            return inside

    return mask



@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def stream_bwd_kernel(grad_kind: str, out_kind: str, has_map: bool, bitmap: bool = False):
    """The backwards (top-k; aux scores: no map, every expert selected, scale 1,
    the K > 1 normalisation), streaming: W lanes per token read its row from
    global memory twice, with no shared-memory tile (occupancy is not limited
    by shared memory, and every thread runs few instructions per element),
    four experts per lane per step with their loads issued together.

    Pass 1 sums S and D over the token's selected experts only (its lanes'
    partials, combined by ``tree_reduce`` in a fixed order). Pass 2 writes
    every element: 0 where the map is unset, except for softmax-pre, where
    ``p (m g - D)`` needs every p. The second read of the row mostly hits L1.
    """
    pair = pair_loader(grad_kind)
    store = storer_2d(out_kind)
    mask = mask_reader(has_map, bitmap)

    @cuda.jit
    def stream_bwd(
        routing_map,  # [T, E] bool; bitmap: [T, ceil(E/8)] uint8 (any array, never read, without a map)
        saved,  # [T, E] fp32 (TE's convention, see the forward)
        grad_probs,  # [T, E] grad_kind
        grad_logits,  # [T, E] out_kind, out
        topk,
        score_fn,
        pre_softmax,
        scale,  # fp32
        lanes,  # W; blockDim.x = tokens per block * W
    ):
        num_tokens = saved.shape[0]
        num_experts = saved.shape[1]
        red = cuda.shared.array(0, nb_f32)  # fp32 [2 * threads]: lane partials of S and D
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        tok = tid // lanes
        lane = tid - tok * lanes
        token = cuda.blockIdx.x * (nthreads // lanes) + tok
        live = token < num_tokens
        dense = score_fn == SOFTMAX and pre_softmax

        # Pass 1: S = sum_m a, D = sum_m g a over this lane's experts, four
        # experts per step: their loads are all issued before any is used
        # (a branch on a loaded flag would otherwise wait for each in turn).
        total = ZERO
        dot = ZERO
        j = lane
        while live and j < num_experts:
            j1 = j + lanes
            j2 = j1 + lanes
            j3 = j2 + lanes
            m0 = mask(routing_map, token, j, True)
            m1 = mask(routing_map, token, j1, j1 < num_experts)
            m2 = mask(routing_map, token, j2, j2 < num_experts)
            m3 = mask(routing_map, token, j3, j3 < num_experts)
            a0, g0 = pair(saved, grad_probs, token, j, m0)
            a1, g1 = pair(saved, grad_probs, token, j1, m1)
            a2, g2 = pair(saved, grad_probs, token, j2, m2)
            a3, g3 = pair(saved, grad_probs, token, j3, m3)
            if m0:
                total, dot = accumulate_sums(total, dot, a0, g0, scale, score_fn)
            if m1:
                total, dot = accumulate_sums(total, dot, a1, g1, scale, score_fn)
            if m2:
                total, dot = accumulate_sums(total, dot, a2, g2, scale, score_fn)
            if m3:
                total, dot = accumulate_sums(total, dot, a3, g3, scale, score_fn)
            j = j3 + lanes
        red[tid] = total
        red[nthreads + tid] = dot
        tree_reduce(red, 0, nthreads, tid, lane, lanes, False)

        # Pass 2: the gradient of every element of the row, four per step.
        if live:
            lead = tok * lanes
            den = np.float32(red[lead] + EPS)
            dsum = red[nthreads + lead]
            j = lane
            while j < num_experts:
                j1 = j + lanes
                j2 = j1 + lanes
                j3 = j2 + lanes
                m0 = mask(routing_map, token, j, True)
                m1 = mask(routing_map, token, j1, j1 < num_experts)
                m2 = mask(routing_map, token, j2, j2 < num_experts)
                m3 = mask(routing_map, token, j3, j3 < num_experts)
                x0, g0 = pair(saved, grad_probs, token, j, m0 or dense)
                x1, g1 = pair(saved, grad_probs, token, j1, m1 or (dense and j1 < num_experts))
                x2, g2 = pair(saved, grad_probs, token, j2, m2 or (dense and j2 < num_experts))
                x3, g3 = pair(saved, grad_probs, token, j3, m3 or (dense and j3 < num_experts))
                store(grad_logits, token, j, topk_dx(x0, g0, m0, dense, den, dsum, scale, topk, score_fn))
                if j1 < num_experts:
                    store(grad_logits, token, j1, topk_dx(x1, g1, m1, dense, den, dsum, scale, topk, score_fn))
                if j2 < num_experts:
                    store(grad_logits, token, j2, topk_dx(x2, g2, m2, dense, den, dsum, scale, topk, score_fn))
                if j3 < num_experts:
                    store(grad_logits, token, j3, topk_dx(x3, g3, m3, dense, den, dsum, scale, topk, score_fn))
                j = j3 + lanes

    return stream_bwd
