"""The quad backward kernel of the top-k and aux-score ops: E a multiple of 4
(the other shapes take ``stream_bwd.py``); launched by
``topk.bwd_plans.topk_with_score_function_bwd_plan`` (with the routing map) and
``aux_scores.score_for_aux_loss_bwd_plan`` (no map: every expert selected,
scale 1, the K > 1 normalisation; a lane's first quads held in registers).
The VJP: ``stream_bwd.py``'s docstring.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from .._base.parallel import recipe

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types

from .._base.access import flat_io
from .._base.device import (
    ALL_SET,
    B0,
    B1,
    B2,
    B3,
    EPS,
    N0,
    N1,
    N2,
    N3,
    ONE,
    SOFTMAX,
    SQRTSOFTPLUS,
    ZERO,
    activation_grad,
    sqrtsoftplus,
    u32,
    u64,
)
from .._base.launch import F32
from .lane.rows import tree_reduce


@functools.cache
def quad_dx(score_fn: int, dense: bool):
    """Device function ``dx(x, g, sel, inv, c, dsum, scale, norm)``: d logit of
    one element (docs/contract.md section 3) from saved ``x`` and the raw gradient
    ``g``, the score function and ``dense`` fixed at compile time.  The
    token's sums enter as ``inv = 1 / (S + eps)`` and ``c = D inv^2`` (one
    division per token instead of two per element: ``g/den - D/den^2`` is
    ``g inv - c``) and ``dsum = D``; ``norm``: the K > 1 normalisation."""
    if score_fn == SOFTMAX:

        @cuda.jit(device=True)
        def dx(x, g, sel, inv, c, dsum, scale, norm):
            if not (sel or dense):
                return ZERO
            gs = np.float32(g * scale) if sel else ZERO
            return np.float32(x * np.float32(gs - dsum))

    else:

        @cuda.jit(device=True)
        def dx(x, g, sel, inv, c, dsum, scale, norm):
            if not sel:
                return ZERO
            a = sqrtsoftplus(x) if score_fn == SQRTSOFTPLUS else x
            gp = np.float32(g * scale)
            if norm:
                gp = np.float32(np.float32(gp * inv) - c)
            return np.float32(gp * activation_grad(x, a, score_fn))

    return dx


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def quad_bwd_kernel(grad_kind: str, out_kind: str, has_map: bool, score_fn: int, dense: bool, hold: int,
                    bitmap: bool = False, listed: int = 0):
    """The backwards (top-k; aux scores: no map, every expert selected, scale 1,
    the K > 1 normalisation) for E a multiple of 4, a quad of four experts
    per step, every array seen flat (``array_views``): the map read as one
    uint32 word per quad (bf16 gradients as one uint64) and the quad skipped
    when its word is 0 (no selected expert: no gradient or saved load, zeros
    written), which is most quads.  ``score_fn`` and ``dense`` (softmax-pre, where
    ``p (m g - D)`` needs every p) are compile-time constants.

    W lanes per token (``bwd_tiling.quad_tiling``), lane ``l`` quads ``l, l + W,
    ...``; pass 1 sums S and D over the selected experts, ``tree_reduce``
    combines the lanes in a fixed order, pass 2 writes every quad, loading
    it again (mostly from L1).  Without a map (aux scores), a lane's first
    ``hold`` quads (a compile-time count, ``bwd_tiling.quad_hold``) are loaded
    all at once, before any is used (their loads in flight together), and
    stay in registers for pass 2.  Loop counters are int32 and indices
    unsigned: numba's int64 ``range`` and wrapped signed indices cost several
    times the loop's own work.

    ``bitmap`` (a compile-time constant): the map is BITMAP_U8, seen flat
    (``[T * ceil(E/8)]`` uint8), and a quad's flags are a nibble of its
    octet's byte (bits 0..3: the quad's experts); the quad's tests take the
    nibble's bits instead of the bool word's bytes.

    ``listed`` (a compile-time count, top-k sqrtsoftplus only; 0: off): a
    lane's first ``listed`` selected experts are put in a list in shared
    memory by pass 1 (saved x and g, after ``red``), then the sqrtsoftplus
    and its derivative are computed once per listed expert in a loop of
    their own, the derivative kept in the list for pass 2.  Without the
    list every quad's four per-expert branches carry the transcendentals
    (``log1p``, ``sqrt``, a division) in both passes, and a warp runs each
    branch where any of its 32 lanes (quads of 4 tokens) has that expert
    selected: about 17 of them a pass at E = 256, K = 6, against ~3 turns
    of the list loop.  Experts past the list (rare) are computed as before,
    so every routing map is served; the sums keep the lane's expert order
    where nothing overflows (results bit for bit those of ``listed = 0``).
    """
    if hold and (has_map or grad_kind != F32):
        raise ValueError("quad_bwd_kernel: hold needs every quad selected (no map) and fp32 gradients")
    if listed and (not has_map or score_fn != SQRTSOFTPLUS or hold):
        raise ValueError("quad_bwd_kernel: listed is for the sqrtsoftplus top-k backward (a map, no hold)")
    from .._base.vec import quad_f32_unchecked

    aligned, load_aligned = quad_f32_unchecked()
    load4 = flat_io(grad_kind)[0]
    load_saved = flat_io(F32)[0]
    _, out4, zero_out4 = flat_io(out_kind)
    dx = quad_dx(score_fn, dense)
    held_values = 4 * max(1, hold)  # local arrays need a size >= 1; indexed by constants only
    # a quad's flags: the bool map's word (a byte per expert) or the bitmap's nibble
    c0, c1, c2, c3 = (N0, N1, N2, N3) if bitmap else (B0, B1, B2, B3)
    all_set = np.uint32(15) if bitmap else ALL_SET  # the flags of a quad of four selected experts
    if has_map and bitmap:

        @cuda.jit(device=True)
        def word(routing_map, w, mrow, q):
            b = np.uint32(routing_map[u64(mrow + (q >> 1))])
            return np.uint32(b >> np.uint32(4 * (q & 1))) & np.uint32(15)

    elif has_map:

        @cuda.jit(device=True)
        def word(routing_map, w, mrow, q):
            return routing_map[u64(w)]

    else:

        @cuda.jit(device=True)
        def word(routing_map, w, mrow, q):
            return all_set

    @cuda.jit(device=True)
    def acc(total, dot, x, g, scale):
        """``(S + a, D + (g * scale) * a)`` for a selected expert (``a`` from saved ``x``)."""
        a = sqrtsoftplus(x) if score_fn == SQRTSOFTPLUS else x
        return np.float32(total + a), np.float32(dot + np.float32(np.float32(g * scale) * a))

    @cuda.jit(device=True)
    def acc4(total, dot, mw, x0, x1, x2, x3, g0, g1, g2, g3, scale):
        if mw & c0 != 0:
            total, dot = acc(total, dot, x0, g0, scale)
        if mw & c1 != 0:
            total, dot = acc(total, dot, x1, g1, scale)
        if mw & c2 != 0:
            total, dot = acc(total, dot, x2, g2, scale)
        if mw & c3 != 0:
            total, dot = acc(total, dot, x3, g3, scale)
        return total, dot

    @cuda.jit(device=True)
    def push(red, lx, n, x, g, total, dot, scale):
        """Pass 1, a selected expert: into the lane's list (``lx``: its first
        slot in ``red``; slots ``nthreads`` apart, x then g ``listed``
        slots further) while there is room, else into the sums at once."""
        if n < listed:
            red[u32(lx + n * cuda.blockDim.x)] = x
            red[u32(lx + (n + listed) * cuda.blockDim.x)] = g
        else:
            total, dot = acc(total, dot, x, g, scale)
        return np.int32(n + 1), total, dot

    @cuda.jit(device=True)
    def push4(red, lx, n, mw, x0, x1, x2, x3, g0, g1, g2, g3, total, dot, scale):
        if mw & c0 != 0:
            n, total, dot = push(red, lx, n, x0, g0, total, dot, scale)
        if mw & c1 != 0:
            n, total, dot = push(red, lx, n, x1, g1, total, dot, scale)
        if mw & c2 != 0:
            n, total, dot = push(red, lx, n, x2, g2, total, dot, scale)
        if mw & c3 != 0:
            n, total, dot = push(red, lx, n, x3, g3, total, dot, scale)
        return n, total, dot

    @cuda.jit(device=True)
    def listed_dx(red, lx, k, sel, g, saved, i, inv, c, scale, norm):
        """Pass 2, one expert of a quad: ``(dx, k)``, the derivative of the
        lane's ``k``-th selected expert taken from its list slot, or computed
        from ``saved[i]`` past the list; 0 and ``k`` unchanged if unselected."""
        if not sel:
            return ZERO, k
        if k < listed:
            d = red[u32(lx + k * cuda.blockDim.x)]
        else:
            x = saved[u64(i)]
            d = activation_grad(x, sqrtsoftplus(x), score_fn)
        gp = np.float32(g * scale)
        if norm:
            gp = np.float32(np.float32(gp * inv) - c)
        return np.float32(gp * d), np.int32(k + 1)

    @cuda.jit(device=True)
    def hold4(held, h, v0, v1, v2, v3):
        held[4 * h] = v0
        held[4 * h + 1] = v1
        held[4 * h + 2] = v2
        held[4 * h + 3] = v3

    def held_loader(load):
        """Device function: a lane's ``hold`` quads of both fp32 arrays into
        ``hg``, ``hx``, all loads before any use (``load``: with or without
        the alignment test; inlined, so the arrays stay registers)."""

        @cuda.jit(device=True)
        def load_held(hg, hx, grad_probs, saved, wlast, lane, step, eq):
            for h in range(hold):
                w = wlast + min(np.int32(lane + h * step), np.int32(eq - 1))
                g0, g1, g2, g3 = load(grad_probs, w)
                hold4(hg, h, g0, g1, g2, g3)
                x0, x1, x2, x3 = load(saved, w)
                hold4(hx, h, x0, x1, x2, x3)

        return load_held

    load_held_aligned = held_loader(load_aligned)
    load_held_checked = held_loader(load_saved)  # hold > 0: fp32 gradients, saved's loader_2d

    @cuda.jit(device=True)
    def write4(grad_logits, w, mw, x0, x1, x2, x3, g0, g1, g2, g3, inv, c, dsum, scale, norm):
        out4(grad_logits, w, dx(x0, g0, mw & c0 != 0, inv, c, dsum, scale, norm),
             dx(x1, g1, mw & c1 != 0, inv, c, dsum, scale, norm),
             dx(x2, g2, mw & c2 != 0, inv, c, dsum, scale, norm),
             dx(x3, g3, mw & c3 != 0, inv, c, dsum, scale, norm))

    @cuda.jit
    def quad_bwd(
        routing_map,  # [T*E/4] uint32 over the bool map; bitmap: [T*ceil(E/8)] uint8
                      # (any array, never read, without a map)
        saved,  # [T*E] fp32
        grad_probs,  # [T, E] grad_kind, flat (bf16: [T*E/4] uint64)
        grad_logits,  # [T, E] out_kind, flat (bf16: [T*E/4] uint64), out
        num_tokens,
        num_experts,
        topk,
        scale,  # fp32
        lanes,  # W; blockDim.x = tokens per block * W
    ):
        eq = np.int32(num_experts // 4)
        red = cuda.shared.array(0, nb_f32)  # fp32 [2 * threads]: lane partials of S and D
        hx = cuda.local.array(held_values, nb_f32)  # the held quads' saved x and g: registers
        hg = cuda.local.array(held_values, nb_f32)  # (indexed by constants once unrolled)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        tok = tid // lanes
        lane = np.int32(tid - tok * lanes)
        step = np.int32(lanes)
        token = cuda.blockIdx.x * (nthreads // lanes) + tok
        live = token < num_tokens
        wbase = token * eq  # the token's first quad (int64)
        mrow = token * ((eq + 1) >> 1)  # bitmap: the token's first map byte (int64)
        norm = score_fn != SOFTMAX and topk > 1

        total = ZERO
        dot = ZERO
        if hold > 0:
            # Every load first, with no branch between them (the alignment
            # tested once), at indices clamped into the array (a dead token
            # or a missing quad reads the last token's last quad and is not
            # used); then the sums.
            wlast = min(token, num_tokens - 1) * eq
            if aligned(grad_probs) and aligned(saved):
                load_held_aligned(hg, hx, grad_probs, saved, wlast, lane, step, eq)
            else:
                load_held_checked(hg, hx, grad_probs, saved, wlast, lane, step, eq)
            for h in range(hold):
                if live and lane + h * step < eq:
                    total, dot = acc4(total, dot, all_set, hx[4 * h], hx[4 * h + 1], hx[4 * h + 2],
                                      hx[4 * h + 3], hg[4 * h], hg[4 * h + 1], hg[4 * h + 2],
                                      hg[4 * h + 3], scale)
        lx = 2 * nthreads + tid  # listed: this lane's first list slot in red
        n = np.int32(0)
        q = np.int32(lane + hold * step)
        while live and q < eq:
            w = wbase + q
            mw = word(routing_map, w, mrow, q)
            if mw != 0:
                g0, g1, g2, g3 = load4(grad_probs, w)
                x0, x1, x2, x3 = load_saved(saved, w)
                if listed:
                    n, total, dot = push4(red, lx, n, mw, x0, x1, x2, x3, g0, g1, g2, g3, total, dot, scale)
                else:
                    total, dot = acc4(total, dot, mw, x0, x1, x2, x3, g0, g1, g2, g3, scale)
            q = np.int32(q + step)
        if listed:
            for j in range(min(n, np.int32(listed))):
                slot = u32(lx + j * nthreads)
                x = red[slot]
                a = sqrtsoftplus(x)  # acc's sums, a computed once for both
                total = np.float32(total + a)
                dot = np.float32(dot + np.float32(np.float32(red[u32(slot + listed * nthreads)] * scale) * a))
                red[slot] = activation_grad(x, a, score_fn)  # d a / d x, for pass 2
        red[tid] = total
        red[nthreads + tid] = dot
        tree_reduce(red, 0, nthreads, tid, lane, lanes, False)

        if live:
            lead = tok * lanes
            inv = np.float32(ONE / np.float32(red[lead] + EPS))
            dsum = red[nthreads + lead]
            c = np.float32(np.float32(dsum * inv) * inv)
            for h in range(hold):
                q = np.int32(lane + h * step)
                if q < eq:
                    write4(grad_logits, wbase + q, all_set, hx[4 * h], hx[4 * h + 1], hx[4 * h + 2],
                           hx[4 * h + 3], hg[4 * h], hg[4 * h + 1], hg[4 * h + 2], hg[4 * h + 3], inv,
                           c, dsum, scale, norm)
            q = np.int32(lane + hold * step)
            k = np.int32(0)
            while q < eq:
                w = wbase + q
                mw = word(routing_map, w, mrow, q)
                if mw == 0 and not dense:
                    zero_out4(grad_logits, w)
                elif listed:
                    g0, g1, g2, g3 = load4(grad_probs, w)
                    e = 4 * w  # the quad's first element in saved (read only past the list)
                    v0, k = listed_dx(red, lx, k, mw & c0 != 0, g0, saved, e, inv, c, scale, norm)
                    v1, k = listed_dx(red, lx, k, mw & c1 != 0, g1, saved, e + 1, inv, c, scale, norm)
                    v2, k = listed_dx(red, lx, k, mw & c2 != 0, g2, saved, e + 2, inv, c, scale, norm)
                    v3, k = listed_dx(red, lx, k, mw & c3 != 0, g3, saved, e + 3, inv, c, scale, norm)
                    out4(grad_logits, w, v0, v1, v2, v3)
                else:
                    g0, g1, g2, g3 = load4(grad_probs, w)
                    x0, x1, x2, x3 = load_saved(saved, w)  # one 16-byte load, whichever are selected
                    write4(grad_logits, w, mw, x0, x1, x2, x3, g0, g1, g2, g3, inv, c, dsum, scale, norm)
                q = np.int32(q + step)

    return quad_bwd
