"""Router top-k with a score function: Numba-CUDA kernels and launchers.

CONTRACT sections 2 and 3.  Also holds the device helpers shared by the other
row kernels (``aux_scores.py``): dtype conversion, score functions and the
insertion top-K.

Decomposition (see docs/kernels.md): a block owns a tile of ``TB`` consecutive
tokens, its shared memory a padded fp32 copy of their scores ``[TB, P]``.

1. All threads, coalesced: load logits, convert to fp32, apply the score
   function, write ``saved_scores``; clear the selection flags.
2. One thread per token: serial selection over its shared row (group scores,
   insertion top-K into a ``cuda.local.array``), the weights.
3. All threads, coalesced: write ``probs`` and ``routing_map`` rows.

No warp intrinsics: shared memory and ``cuda.syncthreads()`` only, so the
same kernels run on the GPU and on the CUDA simulator.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools
import math

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types
from numba import int32 as nb_i32
from numba import uint8 as nb_u8

from . import _launch as L
from ._limits import MAX_GROUPS, check_limits

OP = "topk_with_score_function"

# fp32 constants: numba types bare Python floats as float64, so every literal
# that meets fp32 data is one of these.
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_TWO = np.float32(2.0)
_EPS = np.float32(1e-20)  # TE's epsilon in every normalisation denominator
_SOFTPLUS_THRESHOLD = np.float32(20.0)  # softplus(x) = x above this
_EXP_CLAMP = np.float32(88.0)  # exp() argument cap: see _exp
_NEG_INF = np.float32(-np.inf)

_SIGMOID, _SOFTMAX, _SQRTSOFTPLUS = L.SIGMOID, L.SOFTMAX, L.SQRTSOFTPLUS


# ----------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------


@cuda.jit(device=True)
def _exp(a):
    """fp32 ``exp(a)`` with the argument capped at 88 (NaN passes through).

    The cap only matters where expf would overflow to inf anyway (only
    ``sigmoid(x < -88)`` reaches it, and there it changes the result by
    < 1e-38); it keeps the simulator, which evaluates ``math.exp`` in Python
    doubles, from raising OverflowError.
    """
    if a > _EXP_CLAMP:
        a = _EXP_CLAMP
    return np.float32(math.exp(a))


@cuda.jit(device=True)
def _sigmoid(x):
    return np.float32(_ONE / (_ONE + _exp(-x)))


@cuda.jit(device=True)
def _sqrtsoftplus(x):
    """``sqrt(softplus(x))``, softplus taking ``x`` itself above 20 (PyTorch's threshold)."""
    if x > _SOFTPLUS_THRESHOLD:
        return np.float32(math.sqrt(x))
    return np.float32(math.sqrt(np.float32(math.log1p(_exp(x)))))


@cuda.jit(device=True)
def _activation(x, sf):
    """sigmoid or sqrtsoftplus of an fp32 logit (``sf`` is the score-function code)."""
    if sf == _SIGMOID:
        return _sigmoid(x)
    return _sqrtsoftplus(x)


@cuda.jit(device=True)
def _activation_grad(x, a, sf):
    """d activation / dx given the logit ``x`` and the activation ``a``.

    sigmoid: ``a (1 - a)``; sqrtsoftplus: ``sigmoid(x) / (2 v + eps)`` for
    ``x <= 20`` and ``1 / (2 v + eps)`` above.
    """
    if sf == _SIGMOID:
        return np.float32(a * (_ONE - a))
    num = _ONE if x > _SOFTPLUS_THRESHOLD else _sigmoid(x)
    return np.float32(num / (_TWO * a + _EPS))


@cuda.jit(device=True)
def _insert(vals, idxs, n, cap, v, j):
    """Inserts candidate ``(v, j)`` into the descending list ``vals[:n]``; returns the new n.

    Candidates arrive in ascending index order, so inserting only after every
    entry with a value ``>= v`` (and replacing the last entry only on a
    strictly greater value) gives the contract's tie rule for free: among
    equal values the lower index wins.  NaN counts as -inf; -0.0 == +0.0
    already under IEEE comparison.  Empty slots are filled by any candidate,
    -inf included, so a row always ends with exactly ``cap`` distinct entries
    (the lowest-index eligible ones fill what finite values cannot).
    """
    if v != v:
        v = _NEG_INF
    if n < cap:
        pos = n
        n += 1
    elif v > vals[cap - 1]:
        pos = cap - 1
    else:
        return n
    while pos > 0 and vals[pos - 1] < v:
        vals[pos] = vals[pos - 1]
        idxs[pos] = idxs[pos - 1]
        pos -= 1
    vals[pos] = v
    idxs[pos] = j
    return n


@functools.cache
def loader(kind: str):
    """Device function ``load(a, i, j) -> fp32`` for a 2-D array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def load(a, i, j):
            # bf16 is the top half of an fp32: shift the word up, reinterpret.
            return np.uint32(np.uint32(a[i, j]) << np.uint32(16)).view(np.float32)

    else:

        @cuda.jit(device=True)
        def load(a, i, j):
            return np.float32(a[i, j])

    return load


@functools.cache
def loader1(kind: str):
    """Device function ``load(a, i) -> fp32`` for a 1-D array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def load(a, i):
            return np.uint32(np.uint32(a[i]) << np.uint32(16)).view(np.float32)

    else:

        @cuda.jit(device=True)
        def load(a, i):
            return np.float32(a[i])

    return load


@cuda.jit(device=True)
def _bf16_bits(v):
    """fp32 -> bf16 word, round to nearest even, like ml_dtypes' astype.

    NaN becomes the canonical quiet NaN with v's sign (0x7FC0 / 0xFFC0), as
    ml_dtypes (Eigen) does.
    """
    bits = np.float32(v).view(np.uint32)
    if v != v:
        sign = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(0x8000))
        return np.uint16(sign | np.uint32(0x7FC0))
    lsb = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(np.uint32(np.uint32(bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)))


@functools.cache
def storer(kind: str):
    """Device function ``store(a, i, j, v)`` writing fp32 ``v`` into a 2-D array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = _bf16_bits(v)

    elif kind == L.F16:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = np.float16(v)  # cvt.rn.f16.f32: round to nearest even

    else:

        @cuda.jit(device=True)
        def store(a, i, j, v):
            a[i, j] = v

    return store


@functools.cache
def storer1(kind: str):
    """Device function ``store(a, i, v)`` for a 1-D array of ``kind``."""
    if kind == L.BF16:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = _bf16_bits(v)

    elif kind == L.F16:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = np.float16(v)

    else:

        @cuda.jit(device=True)
        def store(a, i, v):
            a[i] = v

    return store


def topk_capacity(topk: int) -> int:
    """Compile-time size of the per-thread top-K list: 8, 16, 32 or 64."""
    cap = 8
    while cap < topk:
        cap *= 2
    return cap


# ----------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------


@functools.cache
def _topk_fwd_kernel(kind: str, kcap: int):
    """The forward kernel for logits of ``kind``, with a top-K list of ``kcap`` slots."""
    load = loader(kind)
    store = storer(kind)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind
        bias,  # [E] fp32 (any [E] fp32 array when has_bias is False; never read then)
        probs,  # [T, E] kind, out
        routing_map,  # [T, E] bool, out
        saved,  # [T, E] fp32, out
        topk,  # K
        sf,  # score-function code
        pre,  # use_pre_softmax (softmax only)
        has_bias,
        num_groups,  # G (grouping on iff group_topk > 0)
        group_topk,  # Kg
        scale,  # fp32 scaling_factor
        tile_tokens,  # TB
    ):
        num_tokens = logits.shape[0]
        num_experts = logits.shape[1]
        stride = num_experts | 1  # odd row stride P: conflict-free per-token rows
        # Dynamic shared memory (one allocation, two views):
        #   fp32 [2*TB] stats (row max, row sum) | fp32 [TB, P] tile | uint8 [TB, P] flags
        smem = cuda.shared.array(0, nb_f32)
        flags = cuda.shared.array(0, nb_u8)
        tile = 2 * tile_tokens
        flag0 = (tile + tile_tokens * stride) * 4
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)  # tokens of this (maybe partial) tile
        n = nt * num_experts
        post_softmax = sf == _SOFTMAX and not pre

        # Phase 1 (all threads, element e of the tile; consecutive threads take
        # consecutive experts: coalesced reads and writes).
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            x = load(logits, t0 + t, j)
            s = x
            if sf != _SOFTMAX:
                s = _activation(x, sf)
                # saved: sigmoid(x), or the raw x for sqrtsoftplus (TE's convention)
                saved[t0 + t, j] = s if sf == _SIGMOID else x
            smem[tile + t * stride + j] = s
            flags[flag0 + t * stride + j] = 0
        # Barrier: phase 2 reads whole rows written by other threads.
        cuda.syncthreads()

        if sf == _SOFTMAX and pre:
            # Pre-softmax needs each row's max and sum before anything is
            # selected: one thread per token (serial, fixed order)...
            if tid < nt:
                row = tile + tid * stride
                m = _NEG_INF
                for j in range(num_experts):
                    v = smem[row + j]
                    if v > m:  # NaN never wins; a NaN still makes the sum NaN below
                        m = v
                total = _ZERO
                for j in range(num_experts):
                    total += _exp(smem[row + j] - m)
                smem[2 * tid] = m
                smem[2 * tid + 1] = total
            # Barrier: every thread needs its row's stats.
            cuda.syncthreads()
            # ...then all threads normalise in place (exp(x - max) / sum, as
            # jax.nn.softmax; an all -inf row gives NaN) and write saved.
            for e in range(tid, n, nthreads):
                t = e // num_experts
                j = e - t * num_experts
                idx = tile + t * stride + j
                p = np.float32(_exp(smem[idx] - smem[2 * t]) / smem[2 * t + 1])
                smem[idx] = p
                saved[t0 + t, j] = p
            # Barrier: the selection reads the normalised rows.
            cuda.syncthreads()

        # Phase 2 (one thread per token; thread t owns tile row t).
        if tid < nt:
            row = tile + tid * stride
            topv = cuda.local.array(kcap, nb_f32)
            topi = cuda.local.array(kcap, nb_i32)
            grouped = group_topk > 0
            group_size = num_experts
            keep = cuda.local.array(MAX_GROUPS, nb_u8)
            if grouped:
                group_size = num_experts // num_groups
                per_group = topk // group_topk
                gv = cuda.local.array(MAX_GROUPS, nb_f32)
                gi = cuda.local.array(MAX_GROUPS, nb_i32)
                ng = 0
                for g in range(num_groups):
                    # group score: sum of the top K/Kg selection scores,
                    # added in descending order ((v0 + v1) + v2 ...)
                    cnt = 0
                    for j in range(g * group_size, (g + 1) * group_size):
                        r = smem[row + j]
                        if has_bias:
                            r = np.float32(r + bias[j])
                        cnt = _insert(topv, topi, cnt, per_group, r, j)
                    gs = topv[0]
                    for q in range(1, per_group):
                        gs = np.float32(gs + topv[q])
                    ng = _insert(gv, gi, ng, group_topk, gs, g)  # NaN (inf - inf) -> -inf
                    keep[g] = 0
                for q in range(group_topk):
                    keep[gi[q]] = 1
            # Top-K over the eligible experts (kept groups only), ascending index.
            cnt = 0
            for j in range(num_experts):
                if grouped and keep[j // group_size] == 0:
                    continue  # dropped groups are never selected, not even as fillers
                r = smem[row + j]
                if has_bias:
                    r = np.float32(r + bias[j])
                cnt = _insert(topv, topi, cnt, topk, r, j)
            # Weights, gathered from the UNBIASED scores s (no (s + b) - b).
            for q in range(topk):
                topv[q] = smem[row + topi[q]]
            if post_softmax:
                # softmax over the selected logits only
                m = _NEG_INF
                for q in range(topk):
                    if topv[q] > m:
                        m = topv[q]
                total = _ZERO
                for q in range(topk):
                    topv[q] = _exp(topv[q] - m)
                    total += topv[q]
                for q in range(topk):
                    topv[q] = np.float32(topv[q] / total)
            elif sf != _SOFTMAX and topk > 1:
                total = _ZERO
                for q in range(topk):
                    total += topv[q]
                den = np.float32(total + _EPS)
                for q in range(topk):
                    topv[q] = np.float32(topv[q] / den)
            # The token's row now holds its weights at the selected experts,
            # marked by the flags (cleared in phase 1).
            for q in range(topk):
                smem[row + topi[q]] = topv[q]
                flags[flag0 + tid * stride + topi[q]] = 1
        # Barrier: phase 3 reads flags and weights written by the token threads.
        cuda.syncthreads()

        # Phase 3 (all threads, coalesced): probs, routing_map, and saved for
        # post-softmax (-inf at unselected, the selected-set softmax at selected).
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            sel = flags[flag0 + t * stride + j] != 0
            w = smem[tile + t * stride + j]
            routing_map[t0 + t, j] = sel
            if sel:
                store(probs, t0 + t, j, np.float32(scale * w))
            else:
                store(probs, t0 + t, j, _ZERO)
            if post_softmax:
                saved[t0 + t, j] = w if sel else _NEG_INF

    return kernel


# ----------------------------------------------------------------------------
# Backward kernel
#
# VJP (CONTRACT section 3), m the routing mask, g = grad_probs * scaling_factor:
# - sigmoid/sqrtsoftplus, K > 1: probs_i = a_i / (S + eps), S = sum_m a, so
#   d/da_e = m_e (g_e / (S + eps) - D / (S + eps)^2) with D = sum_m g a;
#   then dx = that * da/dx.  K == 1: dx = m g da/dx.
# - softmax post: t = softmax over I of x, so dx = m q (g - sum_m g q).
# - softmax pre: probs = m p with p = softmax over E, so dx = p (m g - sum m g p).
# Two passes per token: the sums (one thread per token), then elementwise.
# ----------------------------------------------------------------------------


@functools.cache
def _topk_bwd_kernel(kind: str):
    load = loader(kind)
    store = storer(kind)

    @cuda.jit
    def kernel(
        routing_map,  # [T, E] bool
        saved,  # [T, E] fp32 (TE's convention, see the forward)
        grad_probs,  # [T, E] kind
        grad_logits,  # [T, E] kind, out
        topk,
        sf,
        pre,
        scale,  # fp32
        tile_tokens,
    ):
        num_tokens = saved.shape[0]
        num_experts = saved.shape[1]
        stride = num_experts | 1
        # fp32 [2*TB] stats (S, D) | fp32 [TB, P] a-plane | fp32 [TB, P] g-plane
        # | uint8 [TB, P] mask
        smem = cuda.shared.array(0, nb_f32)
        flags = cuda.shared.array(0, nb_u8)
        pa = 2 * tile_tokens
        pg = pa + tile_tokens * stride
        flag0 = (pg + tile_tokens * stride) * 4
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)
        n = nt * num_experts

        # Phase 1 (all threads, coalesced): stage a (the activation, q or p),
        # g (scaled) and the mask.
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            v = saved[t0 + t, j]
            if sf == _SQRTSOFTPLUS:
                v = _sqrtsoftplus(v)  # saved holds the raw x: recompute v
            off = t * stride + j
            smem[pa + off] = v
            smem[pg + off] = np.float32(load(grad_probs, t0 + t, j) * scale)
            flags[flag0 + off] = 1 if routing_map[t0 + t, j] else 0
        # Barrier: the per-token sums read whole rows.
        cuda.syncthreads()

        # Phase 2 (one thread per token): S = sum_m a, D = sum_m g a (fixed order).
        if tid < nt:
            total = _ZERO
            dot = _ZERO
            for j in range(num_experts):
                off = tid * stride + j
                if flags[flag0 + off] != 0:
                    a = smem[pa + off]
                    total += a
                    dot += np.float32(smem[pg + off] * a)
            smem[2 * tid] = total
            smem[2 * tid + 1] = dot
        # Barrier: every element needs its token's sums.
        cuda.syncthreads()

        # Phase 3 (all threads, coalesced): the elementwise gradient.
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            off = t * stride + j
            sel = flags[flag0 + off] != 0
            a = smem[pa + off]
            g = smem[pg + off]
            dot = smem[2 * t + 1]
            dx = _ZERO
            if sf == _SOFTMAX:
                if pre:
                    gm = g if sel else _ZERO
                    dx = np.float32(a * (gm - dot))
                elif sel:
                    dx = np.float32(a * (g - dot))
            elif sel:
                gp = g
                if topk > 1:
                    den = np.float32(smem[2 * t] + _EPS)
                    gp = np.float32(g / den - dot / np.float32(den * den))
                dx = np.float32(gp * _activation_grad(saved[t0 + t, j], a, sf))
            store(grad_logits, t0 + t, j, dx)

    return kernel


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _check_config(op, num_experts, topk, num_groups, group_topk, sf, pre, bias_given):
    if num_experts < 1:
        raise ValueError(f"{op}: num_experts ({num_experts}) must be >= 1.")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"{op}: topk ({topk}) must be in [1, num_experts ({num_experts})].")
    grouped = group_topk is not None and group_topk > 0
    if grouped:
        if num_groups is None or num_groups < 1 or num_experts % num_groups:
            raise ValueError(
                f"{op}: num_experts ({num_experts}) must be divisible by num_groups ({num_groups})."
            )
        if group_topk > num_groups:
            raise ValueError(
                f"{op}: group_topk ({group_topk}) must be <= num_groups ({num_groups}).")
        if topk % group_topk:
            raise ValueError(f"{op}: topk ({topk}) must be divisible by group_topk ({group_topk}).")
        if topk // group_topk > num_experts // num_groups:
            raise ValueError(
                f"{op}: topk / group_topk ({topk // group_topk}) must be <= "
                f"num_experts / num_groups ({num_experts // num_groups})."
            )
    if bias_given and sf == _SOFTMAX:
        raise ValueError(f"{op}: expert_bias is only allowed with sigmoid or sqrtsoftplus.")
    check_limits(op, num_experts, topk, num_groups if grouped else 1)
    return grouped


def topk_with_score_function_fwd(
    logits,
    topk,
    use_pre_softmax=False,
    num_groups=-1,
    group_topk=-1,
    scaling_factor=1.0,
    score_function="softmax",
    expert_bias=None,
    *,
    out=None,
    stream=0,
):
    """Router forward: scores, (group-limited) top-K, weights.

    Args:
      logits: (T, E) float32 | bfloat16 | float16, host or device.
      topk: K, ``1 <= K <= E``.
      use_pre_softmax: softmax over all E before the top-K (softmax only).
      num_groups: G; grouping is on iff ``group_topk > 0``.
      group_topk: Kg; ``E % G == 0``, ``K % Kg == 0``, ``Kg <= G``, ``K / Kg <= E / G``.
      scaling_factor: multiplies the final probs.
      score_function: "softmax" | "sigmoid" | "sqrtsoftplus" | 0..2.
      expert_bias: (E,) float32 or None; sigmoid/sqrtsoftplus only, selection only.
      out: optional ``(probs, routing_map, saved_scores)`` device arrays to write.
      stream: numba stream or int CUDA stream handle (0: default).

    Returns:
      ``(probs (T, E) logits dtype, routing_map (T, E) bool, saved_scores (T, E) float32)``.

    Notes:
      fp32 math throughout.  Ties: the lower expert index wins; NaN counts
      as -inf for selection; exactly K experts per token.
    """
    op = OP + "_fwd"
    sf = L.score_function_code(score_function, op)
    s = L.resolve_stream(stream)
    d_logits, kind = L.device_input(logits, "logits", op, s, ndim=2)
    num_tokens, num_experts = (int(v) for v in d_logits.shape)
    topk = int(topk)
    _check_config(op, num_experts, topk, num_groups, group_topk, sf,
                  use_pre_softmax, expert_bias is not None)
    to_host = not L.any_on_device(logits, expert_bias) and out is None
    d_bias = None
    if expert_bias is not None and sf != _SOFTMAX:
        d_bias, bkind = L.device_input(expert_bias, "expert_bias", op, s, ndim=1)
        if bkind != L.F32 or tuple(d_bias.shape) != (num_experts,):
            raise ValueError(f"{op}: expert_bias must be float32 of shape ({num_experts},), "
                             f"got {tuple(d_bias.shape)} {d_bias.dtype}.")
    plan = topk_with_score_function_fwd_plan(
        L.spec_of(d_logits.shape, kind), d_bias is not None, topk, bool(use_pre_softmax),
        num_groups, group_topk, np.float32(scaling_factor), sf)
    return L.execute(plan, [d_logits] if d_bias is None else [d_logits, d_bias], out, s, to_host)


@functools.cache
def topk_with_score_function_fwd_plan(logits: L.Spec, has_bias: bool, topk: int, pre: bool,
                                      num_groups, group_topk, scale: np.float32, sf: int) -> L.Plan:
    """The launches of the forward (inputs: logits, bias; outputs: probs, map, saved).

    Arguments are validated (by the launcher or, under JAX, at trace time).
    """
    num_tokens, num_experts = logits.shape
    grouped = group_topk is not None and group_topk > 0
    shape = (num_tokens, num_experts)
    outs = (L.spec_of(shape, logits.kind), L.Spec(shape, np.bool_), L.spec_of(shape, L.F32))
    bias_spec = L.spec_of((num_experts,), L.F32)
    ins = (logits, bias_spec) if has_bias else (logits,)
    if num_tokens == 0:
        return L.Plan(OP + "_fwd", ins, outs)
    # without a bias the kernel gets any [E] fp32 array (never read): saved's first row
    bias = L.In(1) if has_bias else L.Out(2, bias_spec)
    grid, threads, tb, shared = L.row_tiling(num_tokens, num_experts, planes=1)
    step = L.Step(_topk_fwd_kernel(logits.kind, topk_capacity(topk)), grid, threads, shared,
                  (L.In(0), bias, L.Out(0), L.Out(1), L.Out(2), int(topk), int(sf), bool(pre),
                   bool(has_bias), int(num_groups) if grouped else 1,
                   int(group_topk) if grouped else -1, np.float32(scale), tb))
    return L.Plan(OP + "_fwd", ins, outs, (), (step,))


def topk_with_score_function_bwd(
    routing_map,
    saved_scores,
    grad_probs,
    topk,
    use_pre_softmax=False,
    scaling_factor=1.0,
    score_function="softmax",
    *,
    out=None,
    stream=0,
):
    """Router backward: ``grad_probs`` -> ``grad_logits`` (CONTRACT section 3).

    Args:
      routing_map: (T, E) bool, from the forward.
      saved_scores: (T, E) float32, from the forward.
      grad_probs: (T, E) float32 | bfloat16 | float16.
      topk, use_pre_softmax, scaling_factor, score_function: as in the forward.
      out: optional device array for grad_logits.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_logits (T, E), dtype of grad_probs.
    """
    op = OP + "_bwd"
    sf = L.score_function_code(score_function, op)
    s = L.resolve_stream(stream)
    d_saved, skind = L.device_input(saved_scores, "saved_scores", op, s, ndim=2)
    if skind != L.F32:
        raise TypeError(f"{op}: saved_scores must be float32, got {d_saved.dtype}.")
    d_grad, kind = L.device_input(grad_probs, "grad_probs", op, s, ndim=2)
    shape = tuple(int(v) for v in d_saved.shape)
    to_host = not L.any_on_device(routing_map, saved_scores, grad_probs) and out is None
    if tuple(d_grad.shape) != shape:
        raise ValueError(f"{op}: grad_probs shape {tuple(d_grad.shape)} != saved_scores {shape}.")
    d_map = L.bool_input(routing_map, "routing_map", op, s)
    if tuple(d_map.shape) != shape:
        raise ValueError(f"{op}: routing_map shape {tuple(d_map.shape)} != saved_scores {shape}.")
    plan = topk_with_score_function_bwd_plan(L.spec_of(shape, kind), int(topk), bool(use_pre_softmax),
                                             np.float32(scaling_factor), sf)
    return L.execute(plan, [d_map, d_saved, d_grad], out, s, to_host)[0]


@functools.cache
def topk_with_score_function_bwd_plan(grad_probs: L.Spec, topk: int, pre: bool, scale: np.float32,
                                      sf: int) -> L.Plan:
    """The launches of the backward (inputs: map, saved, grad_probs; output: grad_logits)."""
    shape = grad_probs.shape
    ins = (L.Spec(shape, np.bool_), L.spec_of(shape, L.F32), grad_probs)
    outs = (grad_probs,)
    if shape[0] == 0:
        return L.Plan(OP + "_bwd", ins, outs)
    grid, threads, tb, shared = L.row_tiling(shape[0], shape[1], planes=2)
    step = L.Step(_topk_bwd_kernel(grad_probs.kind), grid, threads, shared,
                  (L.In(0), L.In(1), L.In(2), L.Out(0), int(topk), int(sf), bool(pre),
                   np.float32(scale), tb))
    return L.Plan(OP + "_bwd", ins, outs, (), (step,))
