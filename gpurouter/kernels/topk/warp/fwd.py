"""The warp-per-token top-k forward: a token's scores in one warp's registers,
selected by a bound and a sort of 32 candidates (docs/kernels.md, "The warp
path").

Where it runs (``topk.use_warp_path``): sigmoid, sqrtsoftplus or softmax
after the top-k, E a multiple of 128 up to 512, K <= 31, no groups or groups
``topk/warp/groups.warp_groups`` takes (DeepSeek-V3's); ``path="auto"``: every
such shape on a GPU (``topk/warp/lanes.warp_auto``); not the routing replay (which runs the
thread-per-token kernel: both sum a token's weights in the same order, so a
replay is the call bit for bit).  Lane ``l`` of the token's warp holds the
quads ``l, l + 32, ...`` of its row: each load the warp makes is one
contiguous span, and all of a token's loads go out before any store.

0. Groups (``topk/warp/groups.py``): a dropped group's experts get the ranking
   score ``r = -inf`` and a key after every kept expert's.
1. Each lane keeps its two largest ranking scores ``r = s + bias`` (NaN as
   -inf; ``s`` the activation, or the logit for softmax after the top-k).  The (K+1)-th largest of those 64
   values (``sort64``; K <= 12: of the 32 lanes' largest, ``sort32v``) is a
   bound ``b``: the (K+1)-th largest of any subset of a row is at most the
   row's, so every expert of the top K has ``r >= b``.
2. The candidates (``r >= b``; about K + 2 of them for random logits) go to
   shared memory by a prefix count (no branch: the others' stores go to a
   spare word of the lane); when there are at most 32, a sort of the
   (score, key) pairs in the selection order (``sort32``: the larger score,
   then the lower expert; docs/contract.md section 2; K = 1, and E = 128 up
   to K = 12: each placed by its rank, counted over the candidates,
   ``by_rank``) leaves the k-th selected expert in lane k - 1.  A key is ``expert << 5 | slot``: the
   slot holds the candidate's score ``s`` for the weights' sum.
3. Otherwise (ties, or the top experts crowded into a few lanes) K rounds of
   a warp arg-max over every expert leave the same in the same lanes.

Then ``thr``, ``cut`` = lane K-1's pair: expert ``j`` is selected when
``r > thr``, or ``r == thr`` and ``j <= cut``.  The weights' sum runs in the
thread-per-token kernel's order: ascending experts with a bias or when
``thr`` is -inf (lane k < K puts its score at its expert's rank among the
K), else the selection order; then K adds in shared memory.  Every lane
then writes its quads: ``saved`` (sigmoid: ``s``; sqrtsoftplus: the logit;
only with the launch's ``save`` flag: the backward's input, not written for a
forward without a gradient),
the probs ``scale * s / (sum + 1e-20)`` (K > 1) and the map.  Softmax after
the top-k: the sum is of ``exp(r - m)`` over the K in the selection order
(``m`` the largest; NaN where a selected logit is), the probs ``scale *
exp(s - m) / sum``, and ``saved`` (those weights unscaled, -inf elsewhere) is
written with them.  Integer arithmetic is cast to int32 throughout: numba's
own is 64-bit (64-bit compares, two shuffles for one).

The QB cutoff (``cutoff``, the QB ``exp_mode``): ``alpha[t]``, bit for bit
``qb_cutoff.py``'s value: the scores are the QB sigmoid's (``jax.nn.sigmoid``'s
bits) and the cutoff is lane K's value after step 2 (step 3: K + 1 rounds);
docs/kernels.md, "The QB cutoff"; every token's alpha is written.
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

from ..._base.access import flat_io, storer_1d
from ..._base.device import EPS, NAN, NEG_INF, ONE, SIGMOID, ZERO, activation, exp_f32, nan_as_neg_inf, u64
from ..._base.launch import SOFTMAX, simulator_enabled
from ..._base.vec import quad_f32
from ..qb_math import EXP_MODES, qb_sigmoid_fn
from .groups import DROPPED, group_dropper, warp_groups
from .lanes import NO_EXPERT, ahead, exchanges, warp_grid, warp_ranks, warp_scans, warp_sorts

#: warps (tokens) a block; blocks at most (a grid-strided token loop): 64 an
#: SM of an H200's 132, several rounds of what is resident at 64-90 registers (fewer
#: blocks left a partial last round; lab/journal/benchmarks.md, "The warp forward's grid")
WARP_TOKENS, WARP_MAX_BLOCKS = 4, 8448
#: the shapes the warp path takes: E a multiple of 128 up to this, K up to
#: 31 (the candidates' sort holds 32: K of them and the bound's)
WARP_MAX_EXPERTS, WARP_MAX_TOPK = 512, 31
#: K up to this: the bound from the lanes' maxima (a sort of 32, not 64)
WARP_ONE_A_LANE_TOPK = 12
#: K up to these: the candidates placed by counting their ranks, not sorted (``by_rank``):
#: E >= 256 K = 1, slower from K = 6 on (more registers; lab/journal/benchmarks.md, "A warp a token,
#: backward"); E = 128 (a quad a lane, 48-56 registers) faster at K = 1-12 ("Softmax after the top-k")
WARP_RANK_MAX_TOPK, WARP_RANK_E128_MAX_TOPK = 1, 12


def warp_path(num_experts: int, topk: int, num_groups: int, score_fn: int, pre_softmax: bool,
              group_topk: int = 0) -> bool:
    """Whether the warp-per-token forward takes the shape (module docstring)."""
    return (not (score_fn == SOFTMAX and pre_softmax) and num_experts % 128 == 0
            and 128 <= num_experts <= WARP_MAX_EXPERTS and 1 <= topk <= WARP_MAX_TOPK
            and warp_groups(num_experts, topk, num_groups, group_topk))


def warp_launch(num_tokens: int) -> tuple[int, int]:
    """``(grid, threads)``: ``topk/warp/lanes.warp_grid`` with this kernel's sizes."""
    return warp_grid(num_tokens, WARP_TOKENS, WARP_MAX_BLOCKS)


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def warp_topk_fwd_kernel(kind: str, num_experts: int, topk: int, score_fn: int, has_bias: bool,
                         bitmap: bool = False, indices: bool = False, num_groups: int = 0, group_topk: int = 0,
                         group_score: str = "sum_topk", compact: bool = False, cutoff: str = ""):
    """The kernel for logits of ``kind``; everything but the token count is a
    compile-time constant (``num_groups`` 0: no groups; ``group_score``: the
    group-score rule, ``groups.WARP_GROUP_SCORES``).  ``compact``: the forward
    writes only the weights ``[T, K]`` (``probs``, flat, logits kind, in the
    selection order: the values the dense probs hold at those experts) and the
    experts ``[T, K]`` int32 (``xarr``); ``rmap`` and ``saved`` are not written.  Launch:
    ``warp_launch(T)``, no dynamic shared memory.

    ``cutoff`` (sigmoid, not compact; "" none): the QB ``exp_mode``; the kernel
    scores by that mode's sigmoid and also writes ``alpha [T]`` f32, its argument
    after ``fallback_only`` (unread without).  ``save`` (the launch's, 0 or 1):
    whether ``saved`` is written."""
    Q = num_experts // 128  # quads a lane
    N = 4 * Q
    QROW = num_experts // 4  # quads a row
    MROW = num_experts // 8  # BITMAP_U8 bytes a row
    KB = np.int32(topk)  # the bound's place in its sort: the (K+1)-th largest
    #: K <= 12: the bound from the lanes' maxima (a 32-sort, about 32 ln(32 / (31 - K))
    #: candidates: 17 at K = 12); else from each lane's two largest (a 64-sort)
    ONE_A_LANE = topk <= WARP_ONE_A_LANE_TOPK
    #: the candidates placed by their ranks, counted over the warp's words, instead of a
    #: 32-sort (15 stages of two exchanges): K <= WARP_RANK_MAX_TOPK, at E = 128 WARP_RANK_E128_MAX_TOPK
    RANKED = topk <= (WARP_RANK_E128_MAX_TOPK if Q == 1 else WARP_RANK_MAX_TOPK)
    KL = np.int32(topk - 1)
    WARPS = warp_launch(1)[1] // 32
    SLOTS = 64 * WARPS  # a warp's words: 32 candidates, then one a lane for the others' stores
    RED = 32 * WARPS if simulator_enabled() else 1  # the exchanges' twins: a word a thread
    G = max(0, num_groups)  # the groups (0: none)
    GSLOTS = 64 * WARPS if G else 1  # 32 group scores, 32 kept flags a warp (a constant size)
    post = score_fn == SOFTMAX  # softmax after the top-k (the kernel never takes softmax-pre)
    norm = topk > 1 and not post
    load4, store4, _ = flat_io(kind)
    store1 = storer_1d(kind)
    store_f32 = quad_f32()[1]
    xor, _, idx, uniform_any, warp_sync = exchanges()
    sort64, sort32, sort32v = warp_sorts()
    by_rank = warp_ranks()
    inclusive_sum, arg_max = warp_scans()
    CUT = bool(cutoff)
    if CUT and (score_fn != SIGMOID or compact or cutoff not in EXP_MODES):
        raise ValueError(f"warp_topk_fwd_kernel: cutoff needs sigmoid scores, no compact mode and an exp_mode of "
                         f"{EXP_MODES}, got score_fn={score_fn}, compact={compact}, cutoff={cutoff!r}.")
    qsig = qb_sigmoid_fn(cutoff if CUT else EXP_MODES[0])  # never called without the cutoff

    @cuda.jit(device=True)
    def score(x, b, s, r, n):
        """Expert slot ``n``'s score and ranking score from its logit ``x``
        (softmax after the top-k: the logit itself)."""
        if CUT:  # the QB sigmoid's bits: the cutoff below is the (K+1)-th of these r
            v = qsig(x)
        else:
            v = x if post else activation(x, score_fn)
        s[n] = v
        r[n] = nan_as_neg_inf(np.float32(v + b[n]) if has_bias else v)

    @cuda.jit(device=True)
    def weight(v, m, inv, on):
        """A selected expert's weight before the scaling (0 where ``on`` is false):
        ``exp(v - m) / sum`` after the top-k, ``v / sum`` normalised, else ``v``."""
        if post:
            w = np.float32(exp_f32(v - m) * inv)
        else:
            w = np.float32(v * inv) if norm else v
        return w if on else ZERO

    @cuda.jit(device=True)
    def expert_of(lane, n):
        """The expert of a lane's slot ``n``: quad ``lane + 32 (n // 4)``, item ``n % 4``."""
        return np.int32(np.int32(4) * lane + np.int32(128 * (n >> 2) + (n & 3)))

    @cuda.jit(device=True)
    def key_of(lane, n, drop):
        """Slot ``n``'s expert, plus ``DROPPED`` where its group is dropped: the key
        of the selection order's tie-break (so a kept -inf precedes a dropped one)."""
        return np.int32(expert_of(lane, n) | (DROPPED if (drop >> np.uint32(n)) & np.uint32(1) else np.int32(0)))

    dropped = group_dropper(num_experts, topk, num_groups, group_topk, group_score)

    @cuda.jit(device=True)
    def pick(r, n, e, thr, cut):
        return (r[n] > thr) | ((r[n] == thr) & (e <= cut))

    @cuda.jit
    def warp_topk_fwd(logits, bias, probs, rmap, saved, xarr, num_tokens, scale, fallback_only, alpha, save):
        cand_v = cuda.shared.array(SLOTS, nb_f32)
        cand_e = cuda.shared.array(SLOTS, nb_i32)
        cand_s = cuda.shared.array(SLOTS, nb_f32)
        cand_g = cuda.shared.array(GSLOTS, nb_f32)  # the group scores
        red = cuda.shared.array(RED, nb_f32)
        redi = cuda.shared.array(RED, nb_i32)
        tid = np.int32(cuda.threadIdx.x)
        lane = np.int32(tid & 31)
        ulane = np.uint32(lane)  # (unsigned indices: no negative-index wrap-around code)
        base = np.int32(tid - lane)
        wv = cand_v[2 * base:2 * base + 64]  # the warp's words (constant offsets in unrolled loops)
        we = cand_e[2 * base:2 * base + 64]
        ws = cand_s[2 * base:2 * base + 64]
        wg = cand_g[2 * base:2 * base + 64] if G else cand_g[0:1]
        gsc = cuda.local.array(4, nb_f32)
        spare = np.uint32(32 + lane)  # where a lane's store goes when it writes no candidate
        b = cuda.local.array(N, nb_f32)
        s = cuda.local.array(N, nb_f32)
        r = cuda.local.array(N, nb_f32)
        xs = cuda.local.array(N, nb_f32)
        for n in range(N):
            b[n] = bias[expert_of(lane, n)] if has_bias else ZERO
        tok = np.int64(cuda.blockIdx.x) * WARPS
        while tok < num_tokens:  # the block's warps take the same trips (the twins' barriers)
            t = tok + (tid >> 5)
            live = t < num_tokens
            row = u64(min(t, num_tokens - 1)) * u64(QROW)
            m1 = NEG_INF
            m2 = NEG_INF
            for q in range(Q):  # every load first: Q of them in flight (a store between would wait for each)
                x0, x1, x2, x3 = load4(logits, row + u64(lane + 32 * q))
                xs[4 * q], xs[4 * q + 1], xs[4 * q + 2], xs[4 * q + 3] = x0, x1, x2, x3
            for q in range(Q):
                w = row + u64(lane + 32 * q)
                for i in range(4):
                    score(xs[4 * q + i], b, s, r, 4 * q + i)
                if live and save != 0 and not post and not compact:  # (after the top-k: stored with the weights)
                    if score_fn == SIGMOID:
                        store_f32(saved, w, s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3])
                    else:
                        store_f32(saved, w, xs[4 * q], xs[4 * q + 1], xs[4 * q + 2], xs[4 * q + 3])
            drop = dropped(r, lane, wg, gsc, red, tid)
            for n in range(N):
                v = r[n]
                m1, m2 = max(m1, v), max(m2, min(m1, v))
            # 1. the bound
            if ONE_A_LANE:
                bound = idx(sort32v(m1, red, tid), KB, red, tid)
            else:
                a0, a1 = sort64(m1, m2, red, tid)
                bound = idx(a1 if KB & 1 else a0, KB >> 1, red, tid)
            # 2. the candidates, at most 32 of them sorted
            cnt = np.int32(0)  # (int32 throughout: numba's own integer arithmetic is 64-bit)
            for n in range(N):
                cnt = np.int32(cnt + np.int32(r[n] >= bound))
            incl = inclusive_sum(cnt, redi, tid)
            total = idx(incl, 31, redi, tid)
            pos = np.int32(incl - cnt)
            for n in range(N):  # no branch: a non-candidate (or a 33rd) goes to the lane's spare word
                c = r[n] >= bound
                at = np.uint32(pos) if c & (pos < 32) else spare
                wv[at] = r[n]
                we[at] = np.int32(np.int32(key_of(lane, n, drop) << np.int32(5)) | pos)
                ws[at] = s[n]
                pos = np.int32(pos + np.int32(c))
            warp_sync()
            cv = wv[ulane] if lane < total else NEG_INF
            ce = we[ulane] if lane < total else NO_EXPERT
            if RANKED:
                cv, ce = by_rank(wv, we, cv, ce, lane, min(total, np.int32(32)))
            else:
                warp_sync()
                cv, ce = sort32(cv, ce, red, redi, tid)
            # 3. K rounds of a warp arg-max where the candidates overflowed (K + 1 with the
            # QB cutoff: the (K+1)-th in lane K, as the sort leaves it)
            need = (total > 32) | (fallback_only != 0)
            if uniform_any(need):
                taken = np.uint32(0)
                for k in range(topk + 1 if CUT else topk):
                    bv = NEG_INF
                    be = NO_EXPERT
                    for n in range(N):
                        e = np.int32(np.int32(key_of(lane, n, drop) << np.int32(5)) | np.int32(k))
                        if ((taken >> np.uint32(n)) & np.uint32(1)) == 0 and ahead(r[n], e, bv, be):
                            bv = r[n]
                            be = e
                    bv, be = arg_max(bv, be, red, redi, tid)
                    for n in range(N):
                        if be == np.int32(np.int32(key_of(lane, n, drop) << np.int32(5)) | np.int32(k)):
                            taken |= np.uint32(1) << np.uint32(n)
                            if need and (not CUT or k < topk):  # the owner's score, where the key says (slot k)
                                ws[np.uint32(k)] = s[n]
                    if need and lane == k:
                        cv = bv
                        ce = be
            if CUT:  # the QB cutoff: the (K+1)-th largest r, in lane K
                cq = idx(cv, KB, red, tid)
                if live and lane == 0:
                    alpha[u64(t)] = cq
            thr = idx(cv, KL, red, tid)
            cut = np.int32(idx(ce, KL, redi, tid) >> np.int32(5))
            expert = np.int32(ce >> np.int32(5))
            if (indices or compact) and live and lane < topk:
                xarr[u64(t) * u64(topk) + u64(lane)] = expert
            sel = np.uint32(0)  # bit n: expert slot n is selected
            for n in range(N):
                if pick(r, n, key_of(lane, n, drop), thr, cut):
                    sel |= np.uint32(1) << np.uint32(n)
            # the weights' sum, in the thread-per-token kernel's order: lane k < K adds
            # its expert's score at its place (its rank among the K experts, or k)
            inv = ONE
            m = idx(cv, 0, red, tid) if post else ZERO  # after the top-k: the largest selected score
            if norm or post:
                warp_sync()  # (the fallback's scores written)
                sk = ws[np.uint32(ce & np.int32(31))] if lane < topk else ZERO
                place = lane
                if post:  # exp(v - m) in the selection order; NaN where a selected logit is
                    sk = np.float32(exp_f32(cv - m)) if sk == sk else NAN
                else:
                    we[ulane] = expert
                    warp_sync()
                    if has_bias or thr == NEG_INF:  # ascending experts
                        place = np.int32(0)
                        for j in range(topk):
                            place = np.int32(place + np.int32(we[j] < expert))
                if lane < topk:
                    wv[np.uint32(place)] = sk
                warp_sync()
                acc = ZERO
                for k in range(topk):
                    acc = np.float32(acc + wv[k])
                warp_sync()
                inv = np.float32(ONE / (np.float32(acc + EPS) if norm else acc))
            if compact:  # lane k < K: the k-th selected expert's weight, as the dense probs hold it
                warp_sync()  # (the fallback's scores written)
                if live and lane < topk:
                    sv = ws[np.uint32(ce & np.int32(31))]
                    store1(probs, u64(t) * u64(topk) + u64(lane), np.float32(scale * weight(sv, m, inv, True)))
                tok += np.int64(cuda.gridDim.x) * WARPS
                continue
            for q in range(Q):
                n = 4 * q
                w = row + u64(lane + 32 * q)
                nib = (sel >> np.uint32(n)) & np.uint32(15)
                on0, on1 = (nib & np.uint32(1)) != 0, (nib & np.uint32(2)) != 0
                on2, on3 = (nib & np.uint32(4)) != 0, (nib & np.uint32(8)) != 0
                w0 = weight(s[n], m, inv, on0)
                w1 = weight(s[n + 1], m, inv, on1)
                w2 = weight(s[n + 2], m, inv, on2)
                w3 = weight(s[n + 3], m, inv, on3)
                if post and live and save != 0:
                    store_f32(saved, w, w0 if on0 else NEG_INF, w1 if on1 else NEG_INF, w2 if on2 else NEG_INF,
                              w3 if on3 else NEG_INF)
                if bitmap:  # a byte holds two quads: the even lane writes its odd neighbour's too
                    odd = np.uint32(xor(np.int32(nib), 1, redi, tid))
                    if live and (lane & 1) == 0:
                        rmap[u64(t) * u64(MROW) + u64((lane + 32 * q) >> 1)] = np.uint8(nib | (odd << np.uint32(4)))
                elif live:  # a byte an expert
                    rmap[w] = ((nib & np.uint32(1)) | ((nib & np.uint32(2)) << np.uint32(7))
                               | ((nib & np.uint32(4)) << np.uint32(14)) | ((nib & np.uint32(8)) << np.uint32(21)))
                if live:
                    store4(probs, w, np.float32(scale * w0) if on0 else ZERO, np.float32(scale * w1) if on1 else ZERO,
                           np.float32(scale * w2) if on2 else ZERO, np.float32(scale * w3) if on3 else ZERO)
            tok += np.int64(cuda.gridDim.x) * WARPS

    return warp_topk_fwd
