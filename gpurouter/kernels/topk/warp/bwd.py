"""The warp-per-token top-k backward: a token's row in one warp, a lane the
quads ``l, l + 32, ...`` (the forward's layout, ``warp_topk_fwd.py``).

Where it runs (``warp_bwd_path``): a routing map, softmax after the top-k,
sigmoid or sqrtsoftplus, E a multiple of 128 up to 512; ``path="auto"`` on a
GPU (``topk/warp/lanes.warp_auto``), never on the CUDA simulator, where its
exchanges are block barriers (its own tests force ``path="warp"``).  Softmax before the
top-k (every expert's gradient needs every p) and the aux scores (no map)
stay on the quad kernel.

1. A token's map words are loaded a token ahead (the grid-strided loop's
   next token's, while this one is worked: a warp's load is one contiguous
   span); then the gradient and saved quads where the word has a selected
   expert; nothing else of the row is read.
2. S (the activations' sum) and D (the gradient-weighted sum) over the
   lane's selected experts in expert order, then a butterfly over the warp
   (xor exchanges: every lane ends with the same bits).  sqrtsoftplus: the
   warp's selected experts go into a list in shared memory (a prefix count
   gives each lane its place; lane order, then expert order), lane ``j``
   works entries ``j, j + 32, ...`` (one entry a lane for K <= 32): the
   activation and its derivative once per selected expert, S and D over
   its entries, the derivative written back for step 3.
3. Every lane writes its quads: ``docs/contract.md`` section 3's VJP at the
   selected experts, 0 elsewhere.

The VJP and the sums' formulas are the quad kernel's (``quad_bwd.quad_dx``);
only the order of the token's sums differs (a lane's experts or list
entries, then the butterfly), so the bits may differ from the quad kernel's
in the last place.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from ..._base.parallel import recipe

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import int32 as nb_i32
from numba import uint32 as nb_u32

from ..._base.access import flat_io
from ..._base.device import B0, B1, B2, B3, EPS, ONE, SQRTSOFTPLUS, ZERO, activation_grad, sqrtsoftplus, u64
from ..._base.launch import F32, SOFTMAX, simulator_enabled
from ..bwd_quad import quad_dx
from ..bwd_tiling import BWD_TILING, BwdTiling
from .lanes import exchanges, warp_grid, warp_scans

#: warps (tokens) a block (blocks at most: ``BwdTiling.warp_max_blocks``, 16 an
#: SM of an H200's 132; 1584 or unlimited blocks, or 8 warps a block, were no
#: better everywhere: lab/journal/benchmarks.md, "A warp a token, backward")
WARP_BWD_TOKENS = 4
#: the shapes it takes: E a multiple of 128 up to this
WARP_BWD_MAX_EXPERTS = 512


def warp_bwd_path(num_experts: int, score_fn: int, pre_softmax: bool) -> bool:
    """Whether the warp-per-token backward takes the shape (module docstring)."""
    return (not (pre_softmax and score_fn == SOFTMAX) and num_experts % 128 == 0
            and 128 <= num_experts <= WARP_BWD_MAX_EXPERTS)


def warp_bwd_launch(num_tokens: int, tiling: BwdTiling = BWD_TILING) -> tuple[int, int]:
    """``(grid, threads)``: ``lanes.warp_grid`` with this kernel's sizes."""
    return warp_grid(num_tokens, WARP_BWD_TOKENS, tiling.warp_max_blocks)


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def warp_topk_bwd_kernel(kind: str, num_experts: int, score_fn: int, bitmap: bool = False):
    """The kernel for gradients of ``kind`` (in and out), the map a bool
    ``[T, E]`` seen as uint32 quad words or (``bitmap``) BITMAP_U8 bytes;
    E, the score function and the map format are compile-time constants.
    Launch: ``warp_bwd_launch(T)``, no dynamic shared memory."""
    if not warp_bwd_path(num_experts, score_fn, False):
        raise ValueError(f"warp_topk_bwd_kernel: E must be a multiple of 128 up to {WARP_BWD_MAX_EXPERTS} "
                         f"(E={num_experts}).")
    Q = num_experts // 128  # quads a lane
    N = 4 * Q  # experts a lane
    QROW = num_experts // 4  # quads a row
    MROW = num_experts // 8  # BITMAP_U8 bytes a row
    WARPS = warp_bwd_launch(1)[1] // 32
    RED = 32 * WARPS if simulator_enabled() else 1  # the exchanges' twins: a word a thread
    listed = score_fn == SQRTSOFTPLUS
    LROW = N if listed else 0  # list slots a lane: a warp's list holds up to E entries
    LSLOTS = max(1, 32 * WARPS * LROW)
    load4, store4, _ = flat_io(kind)
    load_saved = flat_io(F32)[0]
    dx = quad_dx(score_fn, False)
    xor, _, idx, _, warp_sync = exchanges()
    inclusive_sum = warp_scans()[0]

    if bitmap:

        @cuda.jit(device=True)
        def map_word(routing_map, row, mrow, q):
            """Quad ``q``'s map bits as loaded: its octet's byte."""
            return np.uint32(routing_map[mrow + u64(q >> np.int32(1))])

        @cuda.jit(device=True)
        def flags(w, q):
            """Quad ``q``'s selection flags from its loaded word, bit i: its expert i."""
            return (w >> np.uint32(4 * (q & np.int32(1)))) & np.uint32(15)

    else:

        @cuda.jit(device=True)
        def map_word(routing_map, row, mrow, q):
            return np.uint32(routing_map[row + u64(q)])

        @cuda.jit(device=True)
        def flags(w, q):
            return (np.uint32((w & B0) != 0) | (np.uint32((w & B1) != 0) << np.uint32(1))
                    | (np.uint32((w & B2) != 0) << np.uint32(2)) | (np.uint32((w & B3) != 0) << np.uint32(3)))

    @cuda.jit(device=True)
    def load_words(words, routing_map, t, num_tokens, lane):
        """The map words of token ``t``'s quads for this lane (the last token's past the end)."""
        tc = u64(min(t, num_tokens - 1))
        for q in range(Q):
            words[q] = map_word(routing_map, tc * u64(QROW), tc * u64(MROW), np.int32(lane + 32 * q))

    @cuda.jit(device=True)
    def butterfly(v, red, tid):
        """The warp's sum of ``v`` on every lane (the stages written out: numba
        does not unroll a loop that holds shuffles)."""
        v = np.float32(v + xor(v, 16, red, tid))
        v = np.float32(v + xor(v, 8, red, tid))
        v = np.float32(v + xor(v, 4, red, tid))
        v = np.float32(v + xor(v, 2, red, tid))
        return np.float32(v + xor(v, 1, red, tid))

    @cuda.jit(device=True)
    def listed_dx(lx, wbase, pos, g, on, inv, c, scale, norm):
        """sqrtsoftplus: ``(d logit, next list position)`` of a slot, its derivative
        from the warp's list entry ``pos`` when selected (0 and ``pos`` else)."""
        if not on:
            return ZERO, pos
        gp = np.float32(g * scale)
        if norm:
            gp = np.float32(np.float32(gp * inv) - c)
        return np.float32(gp * lx[wbase + np.uint32(pos)]), np.int32(pos + np.int32(1))

    @cuda.jit
    def warp_topk_bwd(routing_map, saved, grad_probs, grad_logits, num_tokens, topk, scale):
        red = cuda.shared.array(RED, nb_f32)
        redi = cuda.shared.array(RED, nb_i32)
        lx = cuda.shared.array(LSLOTS, nb_f32)  # sqrtsoftplus: the warps' selected x, then d a / d x
        lg = cuda.shared.array(LSLOTS, nb_f32)  # ... and their gradients
        tid = np.int32(cuda.threadIdx.x)
        lane = np.int32(tid & 31)
        wbase = np.uint32(tid - lane) * np.uint32(LROW)  # the warp's first list slot
        xs = cuda.local.array(N, nb_f32)  # the saved x and gradients of the lane's experts
        gs = cuda.local.array(N, nb_f32)  # (constant indices once unrolled: registers)
        words = cuda.local.array(Q, nb_u32)  # the next token's map words, loaded a token ahead
        norm = score_fn != SOFTMAX and topk > 1
        stride = np.int64(cuda.gridDim.x) * WARPS
        tok = np.int64(cuda.blockIdx.x) * WARPS
        load_words(words, routing_map, tok + (tid >> 5), num_tokens, lane)
        while tok < num_tokens:  # the block's warps take the same trips (the twins' barriers)
            t = tok + (tid >> 5)
            live = t < num_tokens
            row = u64(min(t, num_tokens - 1)) * u64(QROW)  # a dead warp reads the last token, writes nothing
            sel = np.uint32(0)  # bit n: the lane's expert slot n is selected
            for q in range(Q):
                sel |= flags(words[q], np.int32(lane + 32 * q)) << np.uint32(4 * q)
            load_words(words, routing_map, t + stride, num_tokens, lane)  # in flight through this token
            for q in range(Q):
                w = row + u64(lane + 32 * q)
                if (sel >> np.uint32(4 * q)) & np.uint32(15):
                    g0, g1, g2, g3 = load4(grad_probs, w)
                    x0, x1, x2, x3 = load_saved(saved, w)
                else:
                    g0, g1, g2, g3 = ZERO, ZERO, ZERO, ZERO
                    x0, x1, x2, x3 = ZERO, ZERO, ZERO, ZERO
                gs[4 * q], gs[4 * q + 1], gs[4 * q + 2], gs[4 * q + 3] = g0, g1, g2, g3
                xs[4 * q], xs[4 * q + 1], xs[4 * q + 2], xs[4 * q + 3] = x0, x1, x2, x3
            total = ZERO
            dot = ZERO
            pos = np.int32(0)
            if listed:
                # the warp's selected experts in a list (lane order, then slot order), the
                # list's j-th entry worked by lane j % 32: one turn a lane for K <= 32
                cnt = np.int32(cuda.popc(sel))
                incl = inclusive_sum(cnt, redi, tid)
                count = idx(incl, 31, redi, tid)
                pos = np.int32(incl - cnt)
                at = pos
                for n in range(N):
                    if (sel >> np.uint32(n)) & np.uint32(1):
                        lx[wbase + np.uint32(at)] = xs[n]
                        lg[wbase + np.uint32(at)] = gs[n]
                        at = np.int32(at + np.int32(1))
                warp_sync()
                j = lane
                while j < count:
                    x = lx[wbase + np.uint32(j)]
                    a = sqrtsoftplus(x)
                    total = np.float32(total + a)
                    dot = np.float32(dot + np.float32(np.float32(lg[wbase + np.uint32(j)] * scale) * a))
                    lx[wbase + np.uint32(j)] = activation_grad(x, a, score_fn)  # for the owner's pass 2
                    j = np.int32(j + np.int32(32))
                warp_sync()
            else:
                for n in range(N):
                    if (sel >> np.uint32(n)) & np.uint32(1):
                        total = np.float32(total + xs[n])
                        dot = np.float32(dot + np.float32(np.float32(gs[n] * scale) * xs[n]))
            total = butterfly(total, red, tid)
            dot = butterfly(dot, red, tid)
            inv = np.float32(ONE / np.float32(total + EPS))
            c = np.float32(np.float32(dot * inv) * inv)
            for q in range(Q):
                n = 4 * q
                nib = (sel >> np.uint32(n)) & np.uint32(15)
                on0 = (nib & np.uint32(1)) != 0
                on1 = (nib & np.uint32(2)) != 0
                on2 = (nib & np.uint32(4)) != 0
                on3 = (nib & np.uint32(8)) != 0
                if listed:  # the derivatives from the list, in the order they went in
                    v0, pos = listed_dx(lx, wbase, pos, gs[n], on0, inv, c, scale, norm)
                    v1, pos = listed_dx(lx, wbase, pos, gs[n + 1], on1, inv, c, scale, norm)
                    v2, pos = listed_dx(lx, wbase, pos, gs[n + 2], on2, inv, c, scale, norm)
                    v3, pos = listed_dx(lx, wbase, pos, gs[n + 3], on3, inv, c, scale, norm)
                else:
                    v0 = dx(xs[n], gs[n], on0, inv, c, dot, scale, norm)
                    v1 = dx(xs[n + 1], gs[n + 1], on1, inv, c, dot, scale, norm)
                    v2 = dx(xs[n + 2], gs[n + 2], on2, inv, c, dot, scale, norm)
                    v3 = dx(xs[n + 3], gs[n + 3], on3, inv, c, dot, scale, norm)
                if live:
                    store4(grad_logits, row + u64(lane + 32 * q), v0, v1, v2, v3)
            if listed:
                warp_sync()  # the list read before the next token's entries go in
            tok += stride

    return warp_topk_bwd
