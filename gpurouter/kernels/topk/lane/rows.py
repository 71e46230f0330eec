"""Row phases of the W-lane forward kernels (``lane_topk_fwd.py``,
``lane_aux_scores_fwd.py``) and the lane tree of the backwards: the flat,
coalesced tile walk, the staging of a tile (score function, ``saved``, bias),
the row statistics and normalisation, the BITMAP_U8 packing of the selection
flags, and the fixed-order tree reduction of a token's lane partials.

No warp intrinsics: shared memory and ``cuda.syncthreads()`` only.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from ..._base.access import loader_2d
from ..._base.device import EPS, NEG_INF, SIGMOID, SOFTMAX, ZERO, activation, exp_f32


@cuda.jit(device=True)
def tree_reduce(red, oa, ob, tid, lane, lanes, a_is_max):
    """Combines the token's lane partials ``red[oa + tid]`` (max or sum) and, when
    ``ob >= 0``, ``red[ob + tid]`` (sum) into the token's lane 0, in a fixed
    pairing (deterministic).  All threads call it; barrier before each level
    and at the end.  The max ignores NaN (``b > a`` is false), like the serial
    ``if v > m`` scans.
    """
    span = 1
    while span < lanes:  # lanes: a power of two, so lane % (2 span) is lane & (2 span - 1)
        cuda.syncthreads()
        if lane & (2 * span - 1) == 0:
            x = red[oa + tid + span]
            if a_is_max:
                if x > red[oa + tid]:
                    red[oa + tid] = x
            else:
                red[oa + tid] = np.float32(red[oa + tid] + x)
            if ob >= 0:
                red[ob + tid] = np.float32(red[ob + tid] + red[ob + tid + span])
        span *= 2
    cuda.syncthreads()


@cuda.jit(device=True)
def flat_walk(tid, nthreads, num_experts):
    """Start ``(t, j)`` and step ``(dt, dj)`` of the flat, coalesced tile loop:
    thread ``tid`` takes tile elements ``tid, tid + nthreads, ...`` (element
    ``e`` = token ``e // E``, expert ``e % E``) without a division per step."""
    t = tid // num_experts
    dt = nthreads // num_experts
    return t, tid - t * num_experts, dt, nthreads - dt * num_experts


@cuda.jit(device=True)
def row_stats(smem, o_red, row, valid, num_experts, tid, lane, lanes, nthreads, softmax):
    """Per-token statistics of the tile rows, W lanes per token.

    softmax: row max (NaN ignored) then ``sum exp(x - max)``; else ``sum v``.
    Lane ``l`` takes experts ``l, l + W, ...`` in ascending order, then
    ``tree_reduce`` combines the lanes.  Afterwards (all threads past the
    final barrier) token ``t``'s max is at ``smem[o_red + t*W]`` and its sum
    at ``smem[o_red + nthreads + t*W]``.
    """
    oa = o_red
    ob = o_red + nthreads
    m = NEG_INF
    if softmax:
        if valid:
            for j in range(lane, num_experts, lanes):
                v = smem[row + j]
                if v > m:  # NaN never wins; it still makes the sum NaN below
                    m = v
        smem[oa + tid] = m
        tree_reduce(smem, oa, -1, tid, lane, lanes, True)
        m = smem[oa + tid - lane]
    total = ZERO
    if valid:
        for j in range(lane, num_experts, lanes):
            v = smem[row + j]
            if softmax:
                v = exp_f32(v - m)
            total += v
    smem[ob + tid] = total
    tree_reduce(smem, ob, -1, tid, lane, lanes, False)


@cuda.jit(device=True)
def normalise_rows(smem, o_red, out1, out2, write2, t0, nt, num_experts, stride, lanes, tid,
               nthreads, softmax):
    """All threads, coalesced: the tile's rows divided by their statistics
    (``exp(x - max) / sum`` like jax.nn.softmax, an all -inf row giving NaN;
    or ``v / (sum + 1e-20)``), in place, to ``out1`` and (``write2``) ``out2``.
    Ends with a barrier."""
    t, j, dt, dj = flat_walk(tid, nthreads, num_experts)
    while t < nt:
        lead = o_red + t * lanes
        idx = t * stride + j
        if softmax:
            p = np.float32(exp_f32(smem[idx] - smem[lead]) / smem[lead + nthreads])
        else:
            p = np.float32(smem[idx] / np.float32(smem[lead + nthreads] + EPS))
        smem[idx] = p
        out1[t0 + t, j] = p
        if write2:
            out2[t0 + t, j] = p
        t, j = flat_next(t, j, dt, dj, num_experts)
    cuda.syncthreads()



@cuda.jit(device=True)
def flat_next(t, j, dt, dj, num_experts):
    """The next ``(t, j)`` of the flat tile loop (see ``flat_walk``)."""
    t += dt
    j += dj
    if j >= num_experts:
        j -= num_experts
        t += 1
    return t, j


@cuda.jit(device=True)
def stage_element(x, b, t, j, t0, saved, smem, stride, score_fn, has_bias):
    """One element of the forward staging: score function, saved, bias, into the tile."""
    s = x
    if score_fn != SOFTMAX:
        s = activation(x, score_fn)
        saved[t0 + t, j] = s if score_fn == SIGMOID else x
        if has_bias:
            s = np.float32(s + b)
    smem[t * stride + j] = s


@cuda.jit(device=True)
def stage_element_clear_flag(x, b, t, j, t0, saved, smem, flags, o_flag, stride, score_fn, has_bias):
    """``stage_element`` and the element's selection flag cleared."""
    stage_element(x, b, t, j, t0, saved, smem, stride, score_fn, has_bias)
    flags[o_flag + t * stride + j] = 0


@functools.cache
def lane_stager(kind: str):
    """Device function staging the forward tile (shared by top-k fwd and aux scores fwd).

    All threads, coalesced (consecutive threads take consecutive experts):
    load the logits, convert to fp32, apply the score function, write
    ``saved`` (sigmoid: ``a``; sqrtsoftplus: the raw ``x``, TE's convention;
    softmax: nothing yet), add the expert bias (selection only), store into
    the tile, clear the flags.  Four elements per step, their loads issued
    before any is used (four loads in flight per thread: one would leave the
    loop latency-bound at a fraction of the memory bandwidth).  Ends with a
    barrier.
    """
    load = loader_2d(kind)

    @cuda.jit(device=True)
    def stage(logits, bias, saved, smem, flags, o_flag, t0, nt, stride, score_fn, has_bias, tid,
              nthreads):
        num_experts = logits.shape[1]
        t, j, dt, dj = flat_walk(tid, nthreads, num_experts)
        while t < nt:
            t1, j1 = flat_next(t, j, dt, dj, num_experts)
            t2, j2 = flat_next(t1, j1, dt, dj, num_experts)
            t3, j3 = flat_next(t2, j2, dt, dj, num_experts)
            x0 = load(logits, t0 + t, j)
            x1 = load(logits, t0 + t1, j1) if t1 < nt else ZERO
            x2 = load(logits, t0 + t2, j2) if t2 < nt else ZERO
            x3 = load(logits, t0 + t3, j3) if t3 < nt else ZERO
            b0 = ZERO
            b1 = ZERO
            b2 = ZERO
            b3 = ZERO
            if has_bias:
                b0 = bias[j]
                b1 = bias[j1]
                b2 = bias[j2]
                b3 = bias[j3]
            stage_element_clear_flag(x0, b0, t, j, t0, saved, smem, flags, o_flag, stride, score_fn, has_bias)
            if t1 < nt:
                stage_element_clear_flag(x1, b1, t1, j1, t0, saved, smem, flags, o_flag, stride, score_fn, has_bias)
            if t2 < nt:
                stage_element_clear_flag(x2, b2, t2, j2, t0, saved, smem, flags, o_flag, stride, score_fn, has_bias)
            if t3 < nt:
                stage_element_clear_flag(x3, b3, t3, j3, t0, saved, smem, flags, o_flag, stride, score_fn, has_bias)
            t, j = flat_next(t3, j3, dt, dj, num_experts)
        cuda.syncthreads()

    return stage


@cuda.jit(device=True)
def pack_flags(flags, o_flag, routing_map, t0, nt, num_experts, stride, tid, nthreads):
    """All threads: the BITMAP_U8 routing map ``[T, ceil(E/8)]`` of the tile from
    its shared selection flags, a map byte per step, assembled by one thread
    from the octet's eight flags (bit ``i``: expert ``8b + i``; the last
    byte's padding bits 0) and stored whole (no other thread writes it)."""
    nbytes = (num_experts + 7) >> 3
    t, b, dt, db = flat_walk(tid, nthreads, nbytes)
    while t < nt:
        base = o_flag + t * stride + 8 * b
        n = min(8, num_experts - 8 * b)
        v = np.uint32(0)
        if n == 8:  # every byte but maybe the last: unrolled
            for i in range(8):
                v |= np.uint32(np.uint32(flags[base + i] != 0) << np.uint32(i))
        else:
            for i in range(n):
                v |= np.uint32(np.uint32(flags[base + i] != 0) << np.uint32(i))
        routing_map[t0 + t, b] = np.uint8(v)
        t, b = flat_next(t, b, dt, db, nbytes)
