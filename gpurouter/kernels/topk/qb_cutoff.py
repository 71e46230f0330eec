"""Quantile Balancing: the cutoff pass of ``qb_counts_plan`` (``qb.py``).

``alpha[t]``, the ``(K+1)``-th largest biased sigmoid ``r = s + b`` of token ``t``
(NaN as ``-inf``), among the experts of the kept groups with grouping on
(docs/contract.md section 12). Two kernels:

- ``qb_cutoff_lanes`` (no grouping): ``QbTiling.cutoff_lanes`` threads a token,
  each keeping the top ``K + 1`` of its experts, the lists merged through shared
  memory by lane 0; bf16 logits with ``E % 4 == 0``: a lane reads four
  neighbouring experts with one 8-byte load, two such loads a step;
- ``qb_cutoff`` (grouping): a thread a token, the groups scored by
  ``group_score``, then the top ``K + 1`` of the kept groups' experts.

Each list is updated by :func:`_insert`'s fixed-trip pass, so that it lives in
registers (a shifting loop put it in local memory: 356 us against 93 us for the
pass on an H200 at T = 65536, E = 384, K = 8; docs/performance.md).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32

from .._base.access import loader_2d
from .._base.device import NEG_INF, ZERO, u64
from .._base.launch import BF16
from .._base.parallel import recipe
from .._base.vec import u16_quad_2d
from .qb_math import qb_sigmoid_fn
from .qb_tiling import OP


@cuda.jit(device=True)
def _insert(top, n, v):
    """Inserts ``v`` into ``top[:n]`` (descending) if it beats the last: one
    compare-and-carry pass over all ``n`` places, a fixed trip count, so that once
    the kernel's constant ``n`` is inlined the loop unrolls and the list can live
    in registers (a shifting loop that stops early indexes local memory). The
    list afterwards is the one the shifting insertion gives: equal values are
    equal bits (-0.0 and +0.0 compare equal: either may stay; they give the same
    bins)."""
    if v > top[n - 1]:
        for i in range(n):
            c = top[i]
            if v > c:
                top[i] = v
                v = c


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def qb_cutoff_kernel(kind: str, topk: int, num_groups: int, group_topk: int, group_score: str, masked: bool,
                     exp_mode: str):
    """``alpha[t]``, the ``(topk + 1)``-th largest ``r`` of token ``t`` (a thread a
    token; ``num_groups`` 0: no groups). Masked tokens: not computed (not read)."""
    load = loader_2d(kind)
    sigmoid = qb_sigmoid_fn(exp_mode)
    k1 = topk + 1
    groups = num_groups if num_groups > 0 else 0
    kg = group_topk
    if groups:
        per = {"sum_topk": topk // max(group_topk, 1), "top2_sum": 2, "max": 1}[group_score]
    else:
        per = 1
    gw = max(groups, 1)

    @cuda.jit(device=True)
    def score(logits, bias, t, e):
        r = np.float32(sigmoid(load(logits, u64(t), u64(e))) + bias[u64(e)])
        return NEG_INF if r != r else r

    @cuda.jit
    def qb_cutoff(logits, bias, valid, cutoff, num_tokens, num_experts):
        t = np.int64(cuda.blockIdx.x) * np.int64(cuda.blockDim.x) + np.int64(cuda.threadIdx.x)
        if t >= num_tokens:
            return
        if masked and not valid[t]:
            cutoff[t] = ZERO
            return
        top = cuda.local.array(k1, nb_f32)
        for i in range(k1):
            top[i] = NEG_INF
        if groups:
            gs = cuda.local.array(gw, nb_f32)
            pg = cuda.local.array(per, nb_f32)
            size = np.int32(num_experts // groups)
            for g in range(groups):
                for i in range(per):
                    pg[i] = NEG_INF
                for j in range(size):
                    _insert(pg, per, score(logits, bias, t, g * size + j))
                tot = pg[0]
                for i in range(1, per):
                    tot = np.float32(tot + pg[i])
                gs[g] = tot
            for g in range(groups):
                rank = 0
                for h in range(groups):
                    if gs[h] > gs[g] or (gs[h] == gs[g] and h < g):
                        rank += 1
                if rank < kg:
                    for j in range(size):
                        _insert(top, k1, score(logits, bias, t, g * size + j))
        else:
            for e in range(num_experts):
                _insert(top, k1, score(logits, bias, t, e))
        cutoff[t] = top[k1 - 1]

    return qb_cutoff



@cuda.jit(device=True)
def _bf16_word(v, i):
    """The fp32 of bf16 word ``i`` (0 lowest) of the uint64 ``v``."""
    word = np.uint32(np.uint64(v >> np.uint64(16 * i)) & np.uint64(0xFFFF))
    return np.uint32(word << np.uint32(16)).view(np.float32)


@cuda.jit(device=True)
def _never(a):
    return False


@cuda.jit(device=True)
def _no_quad(a, i, j):
    return np.uint64(0)


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def qb_cutoff_lanes_kernel(kind: str, topk: int, lanes: int, masked: bool, exp_mode: str, quads: bool = False):
    """``alpha[t]`` without grouping, ``lanes`` threads a token: lane ``l`` keeps the
    top ``topk + 1`` of experts ``l, l + lanes, ...`` (neighbouring lanes read
    neighbouring experts), the lists go through shared memory (``blockDim * (topk +
    1)`` fp32) and lane 0 merges them (each sorted: it stops at the first value
    that does not enter).

    ``quads`` (bf16 logits, ``E % 4 == 0``): lane ``l`` reads the expert quads ``l,
    l + lanes, ...`` (experts ``4q .. 4q + 3``) with one 8-byte load each
    (``vec.u16_quad_2d``; logits whose base or row pitch is not 8-byte aligned take
    the scalar path).
    The cutoff is the ``(topk + 1)``-th largest of the same values whichever lane
    holds which (equal values are equal bits; a -0.0 / +0.0 tie gives the same
    bins), so both paths give the same bits."""
    load = loader_2d(kind)
    sigmoid = qb_sigmoid_fn(exp_mode)
    k1 = topk + 1
    w = lanes
    if quads:
        if kind != BF16:
            raise ValueError(f"{OP}: the quad cutoff path reads bf16 words, got {kind}.")
        aligned, load_quad = u16_quad_2d()
    else:
        aligned, load_quad = _never, _no_quad

    @cuda.jit(device=True)
    def push(top, thr, x, bv):
        """Offers ``r = sigmoid(x) + bv`` to the list; returns its last value. ``thr``
        (the list's last value, kept in a register: the list itself is in local
        memory) turns most values away without reading the list; a NaN ``r`` (a
        ``-inf`` score) never enters, as ``-inf`` would not."""
        r = np.float32(sigmoid(x) + bv)
        if r > thr:
            _insert(top, k1, r)
            return top[k1 - 1]
        return thr

    @cuda.jit
    def qb_cutoff_lanes(logits, bias, valid, cutoff, num_tokens, num_experts):
        lists = cuda.shared.array(0, nb_f32)
        tid = np.int32(cuda.threadIdx.x)
        tok = tid // np.int32(w)
        lane = tid - tok * np.int32(w)
        t = np.int64(cuda.blockIdx.x) * np.int64(cuda.blockDim.x // w) + np.int64(tok)
        live = t < num_tokens
        if live and masked:
            live = valid[u64(t)]
        top = cuda.local.array(k1, nb_f32)
        for i in range(k1):
            top[i] = NEG_INF
        thr = NEG_INF
        if live and quads and aligned(logits):
            q = np.int64(lane)
            step = np.int64(w)
            nq = np.int64(num_experts // 4)
            # two quads a step: both loads go out before the first sigmoid
            while q + step < nq:
                ea = np.int64(4) * q
                eb = np.int64(4) * (q + step)
                va = load_quad(logits, u64(t), u64(ea))
                vb = load_quad(logits, u64(t), u64(eb))
                for i in range(4):
                    thr = push(top, thr, _bf16_word(va, i), bias[u64(ea + i)])
                for i in range(4):
                    thr = push(top, thr, _bf16_word(vb, i), bias[u64(eb + i)])
                q += 2 * step
            if q < nq:
                ea = np.int64(4) * q
                va = load_quad(logits, u64(t), u64(ea))
                for i in range(4):
                    thr = push(top, thr, _bf16_word(va, i), bias[u64(ea + i)])
        elif live:
            e = np.int64(lane)
            step = np.int64(w)
            # four experts a step: their loads go out before the first sigmoid (the
            # values enter the list in the same order as one at a time)
            while e + 3 * step < num_experts:
                ea, eb, ec, ed = e, e + step, e + 2 * step, e + 3 * step
                xa = load(logits, u64(t), u64(ea))
                xb = load(logits, u64(t), u64(eb))
                xc = load(logits, u64(t), u64(ec))
                xd = load(logits, u64(t), u64(ed))
                ba, bb, bc, bd = bias[u64(ea)], bias[u64(eb)], bias[u64(ec)], bias[u64(ed)]
                thr = push(top, thr, xa, ba)
                thr = push(top, thr, xb, bb)
                thr = push(top, thr, xc, bc)
                thr = push(top, thr, xd, bd)
                e += 4 * step
            while e < num_experts:
                thr = push(top, thr, load(logits, u64(t), u64(e)), bias[u64(e)])
                e += step
        for i in range(k1):
            lists[tid * k1 + i] = top[i]
        # Barrier: every lane's list is in shared memory before lane 0 merges.
        cuda.syncthreads()
        if lane == 0 and t < num_tokens:
            if live:
                for other in range(1, w):
                    base = (tid + other) * k1
                    for i in range(k1):
                        v = lists[base + i]
                        if not v > top[k1 - 1]:
                            break
                        _insert(top, k1, v)
                cutoff[t] = top[k1 - 1]
            else:
                cutoff[t] = ZERO

    return qb_cutoff_lanes


__all__ = ["qb_cutoff_kernel", "qb_cutoff_lanes_kernel"]
