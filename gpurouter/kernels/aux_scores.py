"""Aux-loss scores (``compute_aux_scores=True``): Numba-CUDA kernels and launchers.

docs/contract.md sections 2 (last paragraph) and 3: scores over all E, fp32, no bias,
no groups, no scaling; softmax, or sigmoid / sqrtsoftplus normalised over all
E (``v / (sum_all v + 1e-20)``, every K); the routing map is the plain top-K
of the scores.  Same tiling and the same device functions as ``topk.py``:
a block owns TB tokens of W lanes each, a padded fp32 tile of them in shared
memory; W lanes per token for the row statistics and the selection, all
threads for the coalesced loads and stores.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .._checks import check_topk_args
from . import _launch as L
from ._limits import check_limits
from ._plan import In, Out, Plan, Spec, Step, execute, map_spec, spec_of
from .topk import (
    _SOFTMAX,
    _adv,
    _normalise,
    _pack_flags,
    _row_stats,
    _select,
    _stager,
    _stream_bwd_kernel,
    _walk,
    array_views,
    map_view,
    nb_f32,
    nb_i32,
    nb_u8,
    quad_bwd_kernel,
    topk_capacity,
)

OP = "score_for_aux_loss"


@functools.cache
def _aux_scores_fwd_kernel(kind: str, kcap: int, bitmap: bool = False, indices: bool = False):
    """The W-lane aux-score forward; ``bitmap`` (compile-time): the routing map
    is BITMAP_U8 (``topk._pack_flags``), else the bool map; ``indices``
    (compile-time): lane-0's list (the selection order) into ``xarr``
    (``[T, K]`` int32; never read otherwise)."""
    stage = _stager(kind)

    @cuda.jit
    def kernel(
        logits,  # [T, E] kind
        scores,  # [T, E] fp32, out
        routing_map,  # [T, E] bool (bitmap: [T, ceil(E/8)] uint8), out
        saved,  # [T, E] fp32, out: softmax p / sigmoid a / raw x (sqrtsoftplus)
        topk,
        sf,
        tile_tokens,  # TB, tokens per block
        lanes,  # W, threads per token
        stride,  # P, tile row stride (words)
        lstride,  # LS, per-lane list stride (words)
        o_list,  # word offsets of the layout (_launch.select_layout, no groups)
        o_idx,
        o_cnt,
        o_flag,  # byte offset of the flags
        xarr,  # [T, K] int32, out (``indices``; else unused)
    ):
        num_tokens = logits.shape[0]
        num_experts = logits.shape[1]
        smem = cuda.shared.array(0, nb_f32)  # one dynamic allocation, three views
        ism = cuda.shared.array(0, nb_i32)
        flags = cuda.shared.array(0, nb_u8)
        tv = cuda.local.array(kcap, nb_f32)
        ti = cuda.local.array(kcap, nb_i32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        t0 = cuda.blockIdx.x * tile_tokens
        nt = min(tile_tokens, num_tokens - t0)
        tok = tid // lanes
        lane = tid - tok * lanes
        valid = tok < nt
        row = tok * stride
        softmax = sf == _SOFTMAX

        # Phase 1 (all threads, coalesced): x -> activation (or x for softmax).
        stage(logits, saved[0], saved, smem, flags, o_flag, t0, nt, stride, sf, False, tid,
              nthreads)
        # Phase 2 (W lanes per token): softmax max and sum, or sum_all v.
        _row_stats(smem, o_list, row, valid, num_experts, tid, lane, lanes, nthreads, softmax)
        # Phase 3 (all threads, coalesced): the scores, in place and to memory.
        _normalise(smem, o_list, scores, saved, softmax, t0, nt, num_experts, stride, lanes,
                   tid, nthreads, softmax)
        # Phase 4 (W lanes per token): plain top-K of the scores, then lane
        # q flags list entries q, q + W, ...
        _select(smem, ism, row, tok, valid, lane, tid, lanes, num_experts, topk, False, 1, -1,
                1, o_list, o_idx, o_cnt, 0, 0, lstride, tv, ti)
        if valid:
            lead = o_idx + (tid - lane) * lstride
            for q in range(lane, topk, lanes):
                flags[o_flag + row + ism[lead + q]] = 1
                if indices:
                    xarr[t0 + tok, q] = ism[lead + q]
        # Barrier: phase 5 reads the flags.
        cuda.syncthreads()

        # Phase 5 (all threads, coalesced): the routing map.
        if bitmap:
            _pack_flags(flags, o_flag, routing_map, t0, nt, num_experts, stride, tid, nthreads)
        else:
            t, j, dt, dj = _walk(tid, nthreads, num_experts)
            while t < nt:
                routing_map[t0 + t, j] = flags[o_flag + t * stride + j] != 0
                t, j = _adv(t, j, dt, dj, num_experts)

    return kernel


# Backward (mask all ones, docs/contract.md section 3):
# - softmax: dx = p (g - sum g p);
# - sigmoid / sqrtsoftplus: scores = v / (S + eps), S = sum_all v, so
#   d/dv_e = g_e / (S + eps) - D / (S + eps)^2 with D = sum g v, then
#   dx = that * dv/dx (for every K, K == 1 included).


@functools.cache
def _aux_scores_bwd_kernel(out_kind: str):
    """The aux-score backward: ``topk._stream_bwd_kernel`` with every expert
    selected (no map), fp32 gradients, scale 1 and the K > 1 normalisation:
    softmax ``p (g - D)``; sigmoid / sqrtsoftplus normalised over all E
    ``(g / (S + eps) - D / (S + eps)^2) dv/dx``, S = sum v, D = sum g v."""
    return _stream_bwd_kernel(L.F32, out_kind, False)


def score_for_aux_loss_fwd(logits, topk, score_function="softmax", routing_map_format=0, *,
                           return_indices=False, out=None, stream=0):
    """Aux-loss scores and their plain top-K routing map.

    Args:
      logits: (T, E) float32 | bfloat16 | float16, host or device.
      topk: K, ``1 <= K <= E`` (only the routing map depends on it).
      score_function: "softmax" | "sigmoid" | "sqrtsoftplus" | 0..2.
      routing_map_format: 0 (BYTEMAP, (T, E) bool) or 1 (BITMAP_U8,
        (T, ceil(E/8)) uint8, LSB first along the expert axis).
      return_indices: also return ``indices (T, K) int32``, the top-K in
        selection order (larger score first, the lower index among equal
        ones, NaN as -inf), written by the selecting kernel.
      out: optional ``(scores, routing_map, saved_scores[, indices])`` device arrays.
      stream: numba stream or int CUDA stream handle.

    Returns:
      ``(scores (T, E) float32, routing_map (T, E) bool or (T, ceil(E/8))
      uint8, saved_scores (T, E) float32)``, and ``indices`` with
      ``return_indices``.
    """
    op = OP + "_fwd"
    sf = L.score_function_code(score_function, op)
    fmt = L.map_format_code(routing_map_format, op)
    s = L.resolve_stream(stream)
    d_logits, kind = L.device_input(logits, "logits", op, s, ndim=2)
    num_tokens, num_experts = (int(v) for v in d_logits.shape)
    # the rules of gpurouter._checks, the one place they are written
    topk = check_topk_args((1, num_experts), np.float32, topk, False, -1, -1, 1.0, sf, None, None, True, fmt,
                           op=op).topk
    check_limits(op, num_experts, topk)
    to_host = not L.any_on_device(logits) and out is None
    plan = score_for_aux_loss_fwd_plan(spec_of(d_logits.shape, kind), topk, sf, fmt, bool(return_indices))
    return execute(plan, [d_logits], out, s, to_host)


@functools.cache
def score_for_aux_loss_fwd_plan(logits: Spec, topk: int, sf: int, map_format: int = 0,
                                return_indices: bool = False) -> Plan:
    """The launches of the forward (input: logits; outputs: scores, map, saved
    and, with ``return_indices``, ``indices`` ``int32 [T, K]``); the map's
    Spec: ``bool [T, E]`` (``map_format`` 0) or ``uint8 [T, ceil(E/8)]``
    (1, BITMAP_U8)."""
    fmt = L.map_format_code(map_format, OP + "_fwd_plan", "map_format")
    bitmap = fmt == L.BITMAP_U8
    indices = bool(return_indices)
    ind = (True,) if indices else ()
    shape = logits.shape
    outs = (spec_of(shape, L.F32), map_spec(shape[0], shape[1], fmt), spec_of(shape, L.F32))
    if indices:
        outs += (Spec((shape[0], int(topk)), np.int32),)
    if shape[0] == 0:
        return Plan(OP + "_fwd", (logits,), outs)
    if L.token_path(shape[1], int(topk)):
        from .token_rows import aux_scores_fwd_kernel

        lay = L.token_layout(shape[0], shape[1])
        words, quads, flat = array_views(logits.kind, shape)
        xarr = Out(3, Spec((shape[0] * int(topk),), np.int32)) if indices else Out(2, Spec((1,), np.int32))
        step = Step(aux_scores_fwd_kernel(logits.kind, int(topk), int(sf), bitmap, *ind), lay.grid,
                      lay.threads, lay.shared,
                      (In(0, words), Out(0, flat), Out(1, map_view(outs[1], quads)), Out(2, flat),
                       shape[0], shape[1], lay.tb, lay.stride, lay.o_flag, lay.o_red, lay.o_thr, xarr))
        return Plan(OP + "_fwd", (logits,), outs, (), (step,))
    lay = L.select_layout(shape[0], shape[1], int(topk))
    step = Step(_aux_scores_fwd_kernel(logits.kind, topk_capacity(topk), bitmap, *ind), lay.grid,
                  lay.threads, lay.shared,
                  (In(0), Out(0), Out(1), Out(2), int(topk), int(sf), lay.tb, lay.lanes,
                   lay.stride, lay.list_stride, lay.o_list, lay.o_idx, lay.o_cnt, lay.o_flag,
                   Out(3) if indices else Out(2, Spec((1, 1), np.int32))))
    return Plan(OP + "_fwd", (logits,), outs, (), (step,))


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
    plan = score_for_aux_loss_bwd_plan(spec_of(shape, L.F32), sf, out_kind)
    return execute(plan, [d_saved, d_grad], out, s, to_host)[0]


@functools.cache
def score_for_aux_loss_bwd_plan(saved: Spec, sf: int, out_kind: str) -> Plan:
    """The launches of the backward (inputs: saved, grad_scores; output: grad_logits)."""
    shape = saved.shape
    ins, outs = (saved, saved), (spec_of(shape, out_kind),)
    if shape[0] == 0:
        return Plan(OP + "_bwd", ins, outs)
    # (map: saved, never read; topk 2: the normalised form; pre False; scale 1)
    if shape[1] % 4 == 0:
        grid, threads, lanes = L.quad_tiling(shape[0], shape[1], dense=True)
        hold = L.quad_hold(shape[1], lanes)
        words, _, flat = array_views(out_kind, shape)
        step = Step(quad_bwd_kernel(L.F32, out_kind, False, int(sf), False, hold), grid, threads,
                      8 * threads,
                      (In(0, flat), In(0, flat), In(1, flat), Out(0, words), shape[0],
                       shape[1], 2, np.float32(1.0), lanes))
        return Plan(OP + "_bwd", ins, outs, (), (step,))
    grid, threads, lanes = L.stream_tiling(shape[0], shape[1])
    step = Step(_aux_scores_bwd_kernel(out_kind), grid, threads, 8 * threads,
                  (In(0), In(0), In(1), Out(0), 2, int(sf), False, np.float32(1.0), lanes))
    return Plan(OP + "_bwd", ins, outs, (), (step,))
