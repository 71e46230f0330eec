"""Aux-loss scores (``compute_aux_scores=True``): the launchers and plans.

docs/contract.md sections 2 (last paragraph) and 3: scores over all E, fp32, no bias,
no groups, no scaling; softmax, or sigmoid / sqrtsoftplus normalised over all
E (``v / (sum_all v + 1e-20)``, every K); the routing map is the plain top-K
of the scores.  The forward plan takes the thread-per-token kernel
(``token_aux_scores_fwd.py``) when ``token.tiling.token_path`` says so, else the
W-lane kernel (``lane_aux_scores_fwd.py``); the backward plan the kernels of
the top-k backward (``quad_bwd.py``, ``stream_bwd.py``) with every expert
selected.

Backward (mask all ones, docs/contract.md section 3):

- softmax: dx = p (g - sum g p);
- sigmoid / sqrtsoftplus: scores = v / (S + eps), S = sum_all v, so
  d/dv_e = g_e / (S + eps) - D / (S + eps)^2 with D = sum g v, then
  dx = that * dv/dx (for every K, K == 1 included): the K > 1
  normalisation of the top-k backward, with scale 1.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np

from ..._checks import check_topk_args
from .._base.access import array_views, map_view
from .._base.launch import (
    BITMAP_U8,
    F32,
    any_on_device,
    device_input,
    kind_of_dtype,
    map_format_code,
    resolve_stream,
    score_function_code,
)
from .._base.limits import check_limits
from .._base.plan import In, Out, Plan, Spec, Step, execute, map_spec, spec_of
from .bwd_quad import quad_bwd_kernel
from .bwd_stream import stream_bwd_kernel
from .bwd_tiling import quad_hold, quad_tiling, stream_tiling
from .lane.aux_fwd import lane_aux_scores_fwd_kernel
from .lane.lists import topk_capacity
from .lane.tiling import select_layout
from .tiling import TOPK_TILING, TopkTiling
from .token.aux_fwd import token_aux_scores_fwd_kernel
from .token.tiling import token_layout, use_token_path

OP = "score_for_aux_loss"


def score_for_aux_loss_fwd(logits, topk, score_function="softmax", routing_map_format=0, *,
                           return_indices=False, path="auto", tiling=None, out=None, stream=0):
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
      path: the kernel family, as for ``topk_with_score_function_fwd``.
      tiling: a ``tiling.TopkTiling`` (None: the library's).
      out: optional ``(scores, routing_map, saved_scores[, indices])`` device arrays.
      stream: numba stream or int CUDA stream handle.

    Returns:
      ``(scores (T, E) float32, routing_map (T, E) bool or (T, ceil(E/8))
      uint8, saved_scores (T, E) float32)``, and ``indices`` with
      ``return_indices``.
    """
    op = OP + "_fwd"
    score_fn = score_function_code(score_function, op)
    fmt = map_format_code(routing_map_format, op)
    s = resolve_stream(stream)
    d_logits, kind = device_input(logits, "logits", op, s, ndim=2)
    num_tokens, num_experts = (int(v) for v in d_logits.shape)
    # the rules of gpurouter._checks, the one place they are written
    topk = check_topk_args((1, num_experts), np.float32, topk, False, -1, -1, 1.0, score_fn, None, None, True, fmt,
                           op=op).topk
    check_limits(op, num_experts, topk)
    to_host = not any_on_device(logits) and out is None
    plan = score_for_aux_loss_fwd_plan(spec_of(d_logits.shape, kind), topk, score_fn, fmt, bool(return_indices),
                                       path, tiling)
    return execute(plan, [d_logits], out, s, to_host)


@functools.cache
def score_for_aux_loss_fwd_plan(logits: Spec, topk: int, score_fn: int, map_format: int = 0,
                                return_indices: bool = False, path: str = "auto",
                                tiling: TopkTiling | None = None) -> Plan:
    """The launches of the forward (input: logits; outputs: scores, map, saved
    and, with ``return_indices``, ``indices`` ``int32 [T, K]``); the map's
    Spec: ``bool [T, E]`` (``map_format`` 0) or ``uint8 [T, ceil(E/8)]``
    (1, BITMAP_U8).  ``tiling``: a ``tiling.TopkTiling`` (None: the library's)."""
    tiling = tiling or TOPK_TILING
    fmt = map_format_code(map_format, OP + "_fwd_plan", "map_format")
    bitmap = fmt == BITMAP_U8
    indices = bool(return_indices)
    ind = (True,) if indices else ()
    shape = logits.shape
    outs = (spec_of(shape, F32), map_spec(shape[0], shape[1], fmt), spec_of(shape, F32))
    if indices:
        outs += (Spec((shape[0], int(topk)), np.int32),)
    if shape[0] == 0:
        return Plan(OP + "_fwd", (logits,), outs)
    if use_token_path(path, OP + "_fwd_plan", shape[1], int(topk), tiling=tiling.token):
        lay = token_layout(shape[0], shape[1], tiling=tiling.token)
        words, quads, flat = array_views(logits.kind, shape)
        xarr = Out(3, Spec((shape[0] * int(topk),), np.int32)) if indices else Out(2, Spec((1,), np.int32))
        step = Step(token_aux_scores_fwd_kernel(logits.kind, int(topk), int(score_fn), bitmap, *ind), lay.grid,
                      lay.threads, lay.shared,
                      (In(0, words), Out(0, flat), Out(1, map_view(outs[1], quads)), Out(2, flat),
                       shape[0], shape[1], lay.tb, lay.stride, lay.o_flag, lay.o_red, lay.o_thr, xarr))
        return Plan(OP + "_fwd", (logits,), outs, (), (step,))
    lay = select_layout(shape[0], shape[1], int(topk), tiling=tiling.row)
    step = Step(lane_aux_scores_fwd_kernel(logits.kind, topk_capacity(topk), bitmap, *ind), lay.grid,
                  lay.threads, lay.shared,
                  (In(0), Out(0), Out(1), Out(2), int(topk), int(score_fn), lay.tb, lay.lanes,
                   lay.stride, lay.list_stride, lay.o_list, lay.o_idx, lay.o_cnt, lay.o_flag,
                   Out(3) if indices else Out(2, Spec((1, 1), np.int32))))
    return Plan(OP + "_fwd", (logits,), outs, (), (step,))


def score_for_aux_loss_bwd(saved_scores, grad_scores, score_function="softmax",
                           out_dtype=np.float32, *, tiling=None, out=None, stream=0):
    """Aux-score backward: ``grad_scores`` (fp32) -> ``grad_logits``.

    Args:
      saved_scores: (T, E) float32 from the forward.
      grad_scores: (T, E) float32.
      score_function: as in the forward.
      out_dtype: float32 | bfloat16 | float16 (the logits dtype).
      tiling: a ``tiling.TopkTiling`` (None: the library's; its ``bwd`` is read).
      out: optional device array for grad_logits.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_logits (T, E) out_dtype.
    """
    op = OP + "_bwd"
    score_fn = score_function_code(score_function, op)
    s = resolve_stream(stream)
    out_kind = kind_of_dtype(out_dtype, "out_dtype", op)
    d_saved, k1 = device_input(saved_scores, "saved_scores", op, s, ndim=2)
    d_grad, k2 = device_input(grad_scores, "grad_scores", op, s, ndim=2)
    if k1 != F32 or k2 != F32:
        raise TypeError(f"{op}: saved_scores and grad_scores must be float32, "
                        f"got {d_saved.dtype} and {d_grad.dtype}.")
    shape = tuple(int(v) for v in d_saved.shape)
    if tuple(d_grad.shape) != shape:
        raise ValueError(f"{op}: grad_scores shape {tuple(d_grad.shape)} != saved_scores {shape}.")
    to_host = not any_on_device(saved_scores, grad_scores) and out is None
    plan = score_for_aux_loss_bwd_plan(spec_of(shape, F32), score_fn, out_kind, tiling)
    return execute(plan, [d_saved, d_grad], out, s, to_host)[0]


@functools.cache
def score_for_aux_loss_bwd_plan(saved: Spec, score_fn: int, out_kind: str,
                                tiling: TopkTiling | None = None) -> Plan:
    """The launches of the backward (inputs: saved, grad_scores; output: grad_logits);
    ``tiling``: a ``tiling.TopkTiling`` (None: the library's)."""
    bwd = (tiling or TOPK_TILING).bwd
    shape = saved.shape
    ins, outs = (saved, saved), (spec_of(shape, out_kind),)
    if shape[0] == 0:
        return Plan(OP + "_bwd", ins, outs)
    # (map: saved, never read; topk 2: the normalised form; use_pre_softmax False; scale 1)
    if shape[1] % 4 == 0:
        grid, threads, lanes = quad_tiling(shape[0], shape[1], True, bwd)
        hold = quad_hold(shape[1], lanes, bwd)
        words, _, flat = array_views(out_kind, shape)
        step = Step(quad_bwd_kernel(F32, out_kind, False, int(score_fn), False, hold), grid, threads,
                      8 * threads,
                      (In(0, flat), In(0, flat), In(1, flat), Out(0, words), shape[0],
                       shape[1], 2, np.float32(1.0), lanes))
        return Plan(OP + "_bwd", ins, outs, (), (step,))
    grid, threads, lanes = stream_tiling(shape[0], shape[1], bwd)
    step = Step(stream_bwd_kernel(F32, out_kind, False), grid, threads, 8 * threads,
                  (In(0), In(0), In(1), Out(0), 2, int(score_fn), False, np.float32(1.0), lanes))
    return Plan(OP + "_bwd", ins, outs, (), (step,))
