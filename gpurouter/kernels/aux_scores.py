"""Aux-loss scores (``compute_aux_scores=True``): Numba-CUDA kernels and launchers.

CONTRACT sections 2 (last paragraph) and 3: scores over all E, fp32, no bias,
no groups, no scaling; softmax, or sigmoid / sqrtsoftplus normalised over all
E (``v / (sum_all v + 1e-20)``, every K); the routing map is the plain top-K
of the scores.  Same tiling as ``topk.py``: a block owns TB tokens, a padded
fp32 tile of them in shared memory, one thread per token for the serial
parts, all threads for the coalesced loads and stores.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from . import _launch as L
from ._limits import check_limits
from .topk import (
    _EPS,
    _NEG_INF,
    _SIGMOID,
    _SOFTMAX,
    _SQRTSOFTPLUS,
    _ZERO,
    _activation,
    _activation_grad,
    _exp,
    _insert,
    _sqrtsoftplus,
    loader,
    nb_f32,
    nb_i32,
    nb_u8,
    storer,
    topk_capacity,
)

OP = "score_for_aux_loss"


@functools.cache
def _aux_scores_fwd_kernel(kind: str, kcap: int):
    load = loader(kind)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind
        scores,  # [T, E] fp32, out
        routing_map,  # [T, E] bool, out
        saved,  # [T, E] fp32, out: softmax p / sigmoid a / raw x (sqrtsoftplus)
        topk,
        sf,
        tile_tokens,
    ):
        num_tokens = logits.shape[0]
        num_experts = logits.shape[1]
        stride = num_experts | 1  # odd row stride: conflict-free per-token rows
        # fp32 [2*TB] stats | fp32 [TB, P] tile | uint8 [TB, P] flags
        smem = cuda.shared.array(0, nb_f32)
        flags = cuda.shared.array(0, nb_u8)
        tile = 2 * tile_tokens
        flag0 = (tile + tile_tokens * stride) * 4
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)
        n = nt * num_experts

        # Phase 1 (all threads, coalesced): x -> activation (or x for softmax).
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            x = load(logits, t0 + t, j)
            v = x
            if sf != _SOFTMAX:
                v = _activation(x, sf)
                saved[t0 + t, j] = v if sf == _SIGMOID else x
            smem[tile + t * stride + j] = v
            flags[flag0 + t * stride + j] = 0
        # Barrier: the row sums read whole rows.
        cuda.syncthreads()

        # Phase 2 (one thread per token): softmax max and sum, or sum_all v.
        if tid < nt:
            row = tile + tid * stride
            m = _NEG_INF
            if sf == _SOFTMAX:
                for j in range(num_experts):
                    if smem[row + j] > m:
                        m = smem[row + j]
            total = _ZERO
            for j in range(num_experts):
                if sf == _SOFTMAX:
                    total += _exp(smem[row + j] - m)
                else:
                    total += smem[row + j]
            smem[2 * tid] = m
            smem[2 * tid + 1] = total
        # Barrier: the normalisation needs every row's stats.
        cuda.syncthreads()

        # Phase 3 (all threads, coalesced): the scores, in place and to memory.
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            idx = tile + t * stride + j
            if sf == _SOFTMAX:
                p = np.float32(_exp(smem[idx] - smem[2 * t]) / smem[2 * t + 1])
                saved[t0 + t, j] = p
            else:
                p = np.float32(smem[idx] / np.float32(smem[2 * t + 1] + _EPS))
            smem[idx] = p
            scores[t0 + t, j] = p
        # Barrier: the selection reads whole score rows.
        cuda.syncthreads()

        # Phase 4 (one thread per token): plain top-K of the scores.
        if tid < nt:
            row = tile + tid * stride
            topv = cuda.local.array(kcap, nb_f32)
            topi = cuda.local.array(kcap, nb_i32)
            cnt = 0
            for j in range(num_experts):
                cnt = _insert(topv, topi, cnt, topk, smem[row + j], j)
            for q in range(topk):
                flags[flag0 + tid * stride + topi[q]] = 1
        # Barrier: phase 5 reads the flags.
        cuda.syncthreads()

        # Phase 5 (all threads, coalesced): the routing map.
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            routing_map[t0 + t, j] = flags[flag0 + t * stride + j] != 0

    return kernel


# Backward (mask all ones, CONTRACT section 3):
# - softmax: dx = p (g - sum g p);
# - sigmoid / sqrtsoftplus: scores = v / (S + eps), S = sum_all v, so
#   d/dv_e = g_e / (S + eps) - D / (S + eps)^2 with D = sum g v, then
#   dx = that * dv/dx (for every K, K == 1 included).


@functools.cache
def _aux_scores_bwd_kernel(out_kind: str):
    store = storer(out_kind)

    @cuda.jit
    def kernel(
        saved,  # [T, E] fp32
        grad_scores,  # [T, E] fp32
        grad_logits,  # [T, E] out_kind, out
        sf,
        tile_tokens,
    ):
        num_tokens = saved.shape[0]
        num_experts = saved.shape[1]
        stride = num_experts | 1
        # fp32 [2*TB] stats (S, D) | fp32 [TB, P] v-plane | fp32 [TB, P] g-plane
        smem = cuda.shared.array(0, nb_f32)
        pa = 2 * tile_tokens
        pg = pa + tile_tokens * stride
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)
        n = nt * num_experts

        # Phase 1 (all threads, coalesced): stage v (or p) and g.
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            v = saved[t0 + t, j]
            if sf == _SQRTSOFTPLUS:
                v = _sqrtsoftplus(v)  # saved holds the raw x
            off = t * stride + j
            smem[pa + off] = v
            smem[pg + off] = grad_scores[t0 + t, j]
        # Barrier: the per-token sums read whole rows.
        cuda.syncthreads()

        # Phase 2 (one thread per token): S = sum v, D = sum g v.
        if tid < nt:
            total = _ZERO
            dot = _ZERO
            for j in range(num_experts):
                off = tid * stride + j
                total += smem[pa + off]
                dot += np.float32(smem[pg + off] * smem[pa + off])
            smem[2 * tid] = total
            smem[2 * tid + 1] = dot
        # Barrier: every element needs its token's sums.
        cuda.syncthreads()

        # Phase 3 (all threads, coalesced): elementwise gradient.
        for e in range(tid, n, nthreads):
            t = e // num_experts
            j = e - t * num_experts
            off = t * stride + j
            a = smem[pa + off]
            g = smem[pg + off]
            dot = smem[2 * t + 1]
            if sf == _SOFTMAX:
                dx = np.float32(a * (g - dot))
            else:
                den = np.float32(smem[2 * t] + _EPS)
                gp = np.float32(g / den - dot / np.float32(den * den))
                dx = np.float32(gp * _activation_grad(saved[t0 + t, j], a, sf))
            store(grad_logits, t0 + t, j, dx)

    return kernel


def score_for_aux_loss_fwd(logits, topk, score_function="softmax", *, out=None, stream=0):
    """Aux-loss scores and their plain top-K routing map.

    Args:
      logits: (T, E) float32 | bfloat16 | float16, host or device.
      topk: K, ``1 <= K <= E`` (only the routing map depends on it).
      score_function: "softmax" | "sigmoid" | "sqrtsoftplus" | 0..2.
      out: optional ``(scores, routing_map, saved_scores)`` device arrays.
      stream: numba stream or int CUDA stream handle.

    Returns:
      ``(scores (T, E) float32, routing_map (T, E) bool, saved_scores (T, E) float32)``.
    """
    op = OP + "_fwd"
    sf = L.score_function_code(score_function, op)
    s = L.resolve_stream(stream)
    d_logits, kind = L.device_input(logits, "logits", op, s, ndim=2)
    num_tokens, num_experts = (int(v) for v in d_logits.shape)
    topk = int(topk)
    if num_experts < 1 or not 1 <= topk <= num_experts:
        raise ValueError(f"{op}: topk ({topk}) must be in [1, num_experts ({num_experts})].")
    check_limits(op, num_experts, topk)
    to_host = not L.any_on_device(logits) and out is None
    plan = score_for_aux_loss_fwd_plan(L.spec_of(d_logits.shape, kind), topk, sf)
    return L.execute(plan, [d_logits], out, s, to_host)


@functools.cache
def score_for_aux_loss_fwd_plan(logits: L.Spec, topk: int, sf: int) -> L.Plan:
    """The launches of the forward (input: logits; outputs: scores, map, saved)."""
    shape = logits.shape
    outs = (L.spec_of(shape, L.F32), L.Spec(shape, np.bool_), L.spec_of(shape, L.F32))
    if shape[0] == 0:
        return L.Plan(OP + "_fwd", (logits,), outs)
    grid, threads, tb, shared = L.row_tiling(shape[0], shape[1], planes=1)
    step = L.Step(_aux_scores_fwd_kernel(logits.kind, topk_capacity(topk)), grid, threads, shared,
                  (L.In(0), L.Out(0), L.Out(1), L.Out(2), int(topk), int(sf), tb))
    return L.Plan(OP + "_fwd", (logits,), outs, (), (step,))


def score_for_aux_loss_bwd(saved_scores, grad_scores, score_function="softmax",
                           out_dtype=np.float32, *, out=None, stream=0):
    """Aux-score backward: ``grad_scores`` (fp32) -> ``grad_logits``.

    Args:
      saved_scores: (T, E) float32 from the forward.
      grad_scores: (T, E) float32.
      score_function: as in the forward.
      out_dtype: float32 | bfloat16 | float16 (the logits dtype).
      out: optional device array for grad_logits.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_logits (T, E) out_dtype.
    """
    op = OP + "_bwd"
    sf = L.score_function_code(score_function, op)
    s = L.resolve_stream(stream)
    out_kind = L.kind_of_dtype(out_dtype, "out_dtype", op)
    d_saved, k1 = L.device_input(saved_scores, "saved_scores", op, s, ndim=2)
    d_grad, k2 = L.device_input(grad_scores, "grad_scores", op, s, ndim=2)
    if k1 != L.F32 or k2 != L.F32:
        raise TypeError(f"{op}: saved_scores and grad_scores must be float32, "
                        f"got {d_saved.dtype} and {d_grad.dtype}.")
    shape = tuple(int(v) for v in d_saved.shape)
    if tuple(d_grad.shape) != shape:
        raise ValueError(f"{op}: grad_scores shape {tuple(d_grad.shape)} != saved_scores {shape}.")
    to_host = not L.any_on_device(saved_scores, grad_scores) and out is None
    plan = score_for_aux_loss_bwd_plan(L.spec_of(shape, L.F32), sf, out_kind)
    return L.execute(plan, [d_saved, d_grad], out, s, to_host)[0]


@functools.cache
def score_for_aux_loss_bwd_plan(saved: L.Spec, sf: int, out_kind: str) -> L.Plan:
    """The launches of the backward (inputs: saved, grad_scores; output: grad_logits)."""
    shape = saved.shape
    ins, outs = (saved, saved), (L.spec_of(shape, out_kind),)
    if shape[0] == 0:
        return L.Plan(OP + "_bwd", ins, outs)
    grid, threads, tb, shared = L.row_tiling(shape[0], shape[1], planes=2)
    step = L.Step(_aux_scores_bwd_kernel(out_kind), grid, threads, shared,
                  (L.In(0), L.In(1), L.Out(0), int(sf), tb))
    return L.Plan(OP + "_bwd", ins, outs, (), (step,))
