"""Router top-k with a score function: the forward's launcher and plan
(docs/contract.md section 2; the backward's are in ``bwd_plans.py``).

The forward plan picks the kernel: the warp-per-token kernel
(``warp/fwd.py``) when ``use_warp_path`` takes the shape (sigmoid,
sqrtsoftplus or softmax after the top-k, E a multiple of 128 up to 512, K <= 31, no groups or
``warp_groups``'s; under "auto" on a GPU: ``warp_auto``),
else the thread-per-token kernel (``token/fwd.py``) when
``token.tiling.token_path`` takes it (K <= 64, E a multiple of 4), else the
W-lane kernel (``lane/fwd.py``).
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
    SIGMOID,
    SOFTMAX,
    any_on_device,
    device_input,
    index_input,
    map_format_code,
    resolve_stream,
    score_function_code,
)
from .._base.limits import check_limits, pow2_at_least
from .._base.plan import In, Out, Plan, Spec, Step, execute, map_spec, spec_of
from .lane.fwd import lane_topk_fwd_kernel
from .lane.lists import topk_capacity
from .lane.tiling import select_layout
from .tiling import TOPK_TILING, TopkTiling
from .token.fwd import token_topk_fwd_kernel
from .token.tiling import token_lanes, token_layout, use_token_path
from .warp.groups import WARP_GROUP_SCORES
from .warp_paths import compact_plan, use_warp_path, warp_fwd_step

OP = "topk_with_score_function"


def _check_config(op, num_experts, topk, num_groups, group_topk, score_fn, pre_softmax, scaling_factor, bias_given,
                  fmt):
    """The launcher's configuration, by the rules of ``gpurouter._checks`` (the
    one place they are written; the public ops apply them at trace time), then
    the kernel limits."""
    cfg = check_topk_args((1, num_experts), np.float32, topk, pre_softmax, num_groups, group_topk, scaling_factor,
                          score_fn, (num_experts,) if bias_given else None, np.float32, False, fmt, op=op)
    check_limits(op, num_experts, cfg.topk, cfg.num_groups if cfg.grouped else 1)
    return cfg.grouped


def topk_with_score_function_fwd(
    logits,
    topk,
    use_pre_softmax=False,
    num_groups=-1,
    group_topk=-1,
    scaling_factor=1.0,
    score_function="softmax",
    expert_bias=None,
    routing_map_format=0,
    *,
    return_indices=False,
    forced_indices=None,
    group_score="sum_topk",
    compact=False,
    path="auto",
    tiling=None,
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
      routing_map_format: 0 (BYTEMAP): the map is (T, E) bool; 1 (BITMAP_U8):
        (T, ceil(E/8)) uint8, bit ``e % 8`` of byte ``e // 8`` set iff the
        token routes to expert ``e`` (``np.packbits(map, -1, bitorder="little")``).
      return_indices: also return ``indices (T, K) int32``, the selected
        experts in selection order (larger ``s + bias`` first, the lower index
        among equal scores, NaN as -inf), written by the selecting kernel.
      forced_indices: (T, K) integers, host or device (int32 on the device):
        the routing replay.  No selection: token t's experts are
        ``forced_indices[t]`` (entries outside [0, E) select nothing, a repeat
        selects its expert once); the bias is not read and the groups are
        ignored; everything after the selection is the normal call's.  An
        ``expert_bias`` given here only says that the replayed call had one
        (the weights' normaliser is then summed in that call's order, so a
        replay of returned indices is bit for bit the call).  Not with
        ``return_indices``.
      group_score: the group-score rule (docs/contract.md section 9):
        "sum_topk", "top2_sum" or "max"; a rule other than "sum_topk" with
        groups runs on the warp-per-token kernel only (``path`` "warp", or
        "auto" where it takes the warp path; else a ValueError naming the op).
      compact: write only ``(weights (T, K) logits dtype, indices (T, K)
        int32)``: the selected experts in the selection order and the
        values the probs hold there (bit for bit), no probs, map or saved
        scores; the warp-per-token kernel only (else a ValueError naming
        the op); not with ``forced_indices``.
      path: the kernel family: "auto" (warp-per-token, else thread-per-token,
        else W-lane: the first that takes the shape), "warp", "token" or
        "lane" (``use_warp_path``, ``token.tiling.use_token_path``).
      tiling: a ``TopkTiling`` (None: the library's).
      out: optional ``(probs, routing_map, saved_scores[, indices])`` device arrays to write.
      stream: numba stream or int CUDA stream handle (0: default).

    Returns:
      ``(probs (T, E) logits dtype, routing_map (T, E) bool or (T, ceil(E/8))
      uint8, saved_scores (T, E) float32)``, and ``indices (T, K) int32``
      with ``return_indices``; probs and saved_scores are the same bits in
      both formats.

    Notes:
      fp32 math throughout.  Ties: the lower expert index wins; NaN counts
      as -inf for selection; exactly K experts per token.
    """
    op = OP + "_fwd"
    score_fn = score_function_code(score_function, op)
    fmt = map_format_code(routing_map_format, op)
    s = resolve_stream(stream)
    d_logits, kind = device_input(logits, "logits", op, s, ndim=2)
    num_tokens, num_experts = (int(v) for v in d_logits.shape)
    topk = int(topk)
    _check_config(op, num_experts, topk, num_groups, group_topk, score_fn, use_pre_softmax, scaling_factor,
                  expert_bias is not None, fmt)
    forced = forced_indices is not None
    if forced and return_indices:
        raise ValueError(f"{op}: return_indices with forced_indices: the indices are the forced ones.")
    to_host = not any_on_device(logits, expert_bias, forced_indices) and out is None
    d_bias = None
    if expert_bias is not None and score_fn != SOFTMAX:
        d_bias, bkind = device_input(expert_bias, "expert_bias", op, s, ndim=1)
        if bkind != F32 or tuple(d_bias.shape) != (num_experts,):
            raise ValueError(f"{op}: expert_bias must be float32 of shape ({num_experts},), "
                             f"got {tuple(d_bias.shape)} {d_bias.dtype}.")
    plan = topk_with_score_function_fwd_plan(
        spec_of(d_logits.shape, kind), d_bias is not None, topk, bool(use_pre_softmax),
        num_groups, group_topk, np.float32(scaling_factor), score_fn, fmt, bool(return_indices), forced, path, tiling,
        str(group_score), bool(compact))
    if forced:
        d_forced = index_input(forced_indices, "forced_indices", op, s, (num_tokens, topk))
        return execute(plan, [d_logits, d_forced], out, s, to_host)
    return execute(plan, [d_logits] if d_bias is None else [d_logits, d_bias], out, s, to_host)


#: an SM of the GPUs the kernels are tuned on (sm_90: H100, H200): shared
#: memory (of which 1 KiB is reserved per block), 32-bit registers, threads
SM_SHARED, BLOCK_RESERVED, SM_REGISTERS, SM_THREADS = 233472, 1024, 65536, 2048


def _register_cap(lay) -> int:
    """The register cap of a thread-per-token forward with indices: what lets as
    many blocks be resident as its shared memory allows, so that the indices'
    live values never cost occupancy."""
    blocks = min(SM_THREADS // lay.threads, SM_SHARED // (lay.shared + BLOCK_RESERVED))
    return max(32, min(255, SM_REGISTERS // (max(1, blocks) * lay.threads) // 8 * 8))


@functools.cache
def topk_with_score_function_fwd_plan(logits: Spec, has_bias: bool, topk: int, pre_softmax: bool,
                                      num_groups, group_topk, scale: np.float32, score_fn: int,
                                      map_format: int = 0, return_indices: bool = False,
                                      forced: bool = False, path: str = "auto",
                                      tiling: TopkTiling | None = None, group_score: str = "sum_topk",
                                      compact: bool = False, qb_cutoff: str = "", save: bool = True) -> Plan:
    """The launches of the forward (inputs: logits, bias; outputs: probs, map, saved).

    Arguments are validated (by the launcher or, under JAX, at trace time);
    ``map_format`` is checked here too.  The map's Spec: ``bool [T, E]``
    (0, BYTEMAP) or ``uint8 [T, ceil(E/8)]`` (1, BITMAP_U8).
    ``return_indices``: a fourth output, ``indices`` ``int32 [T, K]`` (the
    selection order).  ``forced`` (the routing replay): the inputs are
    ``(logits, forced int32 [T, K])``, never a bias; ``has_bias`` then says
    whether the replayed call had one (the order of the weights' sum), and
    the groups choose only the kernel path the replayed call took.
    ``tiling``: a ``TopkTiling`` (None: the library's).  ``group_score``: the
    group-score rule; other than ``"sum_topk"`` (with groups, not a replay)
    only the warp kernel computes it (``use_warp_path``; else a ValueError).
    ``qb_cutoff`` (a QB ``exp_mode``; "" none): a last output ``alpha [T]`` f32, the QB
    cutoff (``warp/fwd.py``); sigmoid on the warp kernel only, no replay or compact.
    ``save`` False (the warp kernel only, else a ValueError): no saved output (a
    forward without a gradient: its [T, E] f32 is not allocated, the stores skipped).
    """
    if compact and not qb_cutoff:
        return compact_plan(logits, has_bias, topk, pre_softmax, num_groups, group_topk, scale, score_fn,
                             forced, path, group_score)
    tiling = tiling or TOPK_TILING
    tok = tiling.token
    fmt = map_format_code(map_format, OP + "_fwd_plan", "map_format")
    bitmap = fmt == BITMAP_U8
    indices = bool(return_indices) and not forced
    num_tokens, num_experts = logits.shape
    grouped = group_topk is not None and group_topk > 0
    shape = (num_tokens, num_experts)
    idx_spec = Spec((num_tokens, int(topk)), np.int32)
    saved_spec = spec_of(shape, F32)
    outs = ((spec_of(shape, logits.kind), map_spec(num_tokens, num_experts, fmt)) + ((saved_spec,) if save else ())
            + ((idx_spec,) if indices else ()))
    if qb_cutoff:
        outs += (spec_of((num_tokens,), F32),)
    bias_spec = spec_of((num_experts,), F32)
    if forced:
        ins = (logits, idx_spec)
    else:
        ins = (logits, bias_spec) if has_bias else (logits,)
    if num_tokens == 0:
        return Plan(OP + "_fwd", ins, outs)
    # without a bias the kernel gets any [E] fp32 array (never read): saved's first row
    bias = In(1) if has_bias and not forced else Out(2, bias_spec)
    G = int(num_groups) if grouped else 1
    flat_idx = Spec((num_tokens * int(topk),), np.int32)
    # indices out, forced in, or (never read) any int32 array: saved's first words
    xarr = In(1, flat_idx) if forced else Out(3, flat_idx) if indices else Out(2, Spec((1,), np.int32))
    if group_score not in WARP_GROUP_SCORES:
        raise ValueError(f"{OP}_fwd_plan: group_score must be one of {WARP_GROUP_SCORES}, got {group_score!r}.")
    rule = group_score if grouped and not forced else "sum_topk"  # (no groups: every rule selects alike)
    warp = use_warp_path(path, OP + "_fwd_plan", num_experts, int(topk), G if grouped else 0,
                         int(group_topk) if grouped else 0, int(score_fn), bool(pre_softmax), forced)
    if rule != "sum_topk" and not warp:
        raise ValueError(f"{OP}_fwd_plan: group_score={rule!r} runs on the warp kernel only (path='warp', "
                         f"or 'auto' on a GPU, where it takes the shape; E={num_experts}, K={topk}, "
                         f"num_groups={num_groups}, group_topk={group_topk}, path={path!r}).")
    if qb_cutoff and (compact or forced or not warp or score_fn != SIGMOID):
        raise ValueError(f"{OP}_fwd_plan: qb_cutoff runs on the warp kernel only, with sigmoid scores, not in a "
                         f"replay or the compact mode (E={num_experts}, K={topk}, score_fn={score_fn}, "
                         f"forced={forced}, compact={compact}, path={path!r}).")
    if not save and not warp:
        raise ValueError(f"{OP}_fwd_plan: save=False runs on the warp kernel only (E={num_experts}, K={topk}, "
                         f"path={path!r}, forced={forced}).")
    if warp:
        step = warp_fwd_step(logits, outs, bool(has_bias), bitmap, indices, int(topk), int(score_fn),
                             G if grouped else 0, int(group_topk) if grouped else 0, rule, scale, save, qb_cutoff)
        return Plan(OP + "_fwd", ins, outs, (), (step,))
    # (the replay takes the kernel path of the call it replays: the same sums)
    token_path = use_token_path("token" if path == "warp" else path, OP + "_fwd_plan", num_experts,
                                int(topk), G if grouped else 0, bool(has_bias), tok)
    if token_path:
        post = score_fn == SOFTMAX and not pre_softmax
        if forced:  # no groups, no bias: the bits say which experts
            lay = token_layout(num_tokens, num_experts, tiling=tok)
            kern = token_topk_fwd_kernel(logits.kind, int(topk), 0, int(score_fn), False,
                                         bool(pre_softmax) and score_fn == SOFTMAX,
                                   bitmap, False, True, bool(has_bias) and not post)
            G, Kg = 1, -1
        else:
            group_cap = pow2_at_least(int(topk) // int(group_topk)) if grouped else 0
            mode, slot = token_lanes(num_tokens, num_experts, int(topk), G if grouped else 0,
                                     bool(has_bias), tok)
            lay = token_layout(num_tokens, num_experts, G if grouped else 0, bool(has_bias), slot,
                               tok.lanes_min_blocks if mode == 2 else 0, tok)
            way = tok.indices_way if num_experts <= 256 and int(topk) <= 8 else 1
            kern = token_topk_fwd_kernel(logits.kind, int(topk), group_cap, int(score_fn), bool(has_bias),
                                         bool(pre_softmax) and score_fn == SOFTMAX, bitmap, way if indices else 0,
                                         False, False, _register_cap(lay) if indices else 0,
                                         mode + (mode == 2 and tok.lanes_tree))
            Kg = int(group_topk) if grouped else -1
        words, quads, flat = array_views(logits.kind, shape)
        step = Step(kern, lay.grid, lay.threads, lay.shared,
                      (In(0, words), bias, Out(0, words), Out(1, map_view(outs[1], quads)),
                       Out(2, flat),
                       num_tokens, num_experts, G, Kg,
                       np.float32(scale), lay.tb, lay.stride, lay.o_flag, lay.o_gs, lay.o_red,
                       lay.o_thr, lay.o_bias, xarr, lay.o_lists))
        return Plan(OP + "_fwd", ins, outs, (), (step,))
    if forced:
        lay = select_layout(num_tokens, num_experts, int(topk), tiling=tiling.row)
        kern = lane_topk_fwd_kernel(logits.kind, topk_capacity(topk), bitmap, False, True)
        has_bias, G, Kg = False, 1, -1
    else:
        lay = select_layout(num_tokens, num_experts, int(topk), G if grouped else 0, tiling.row)
        kern = lane_topk_fwd_kernel(logits.kind, topk_capacity(topk), bitmap, *((True,) if indices else ()))
        Kg = int(group_topk) if grouped else -1
    xarr2 = In(1) if forced else Out(3) if indices else Out(2, Spec((1, 1), np.int32))
    step = Step(kern, lay.grid, lay.threads, lay.shared,
                  (In(0), bias, Out(0), Out(1), Out(2), int(topk), int(score_fn), bool(pre_softmax),
                   bool(has_bias), G, Kg, np.float32(scale),
                   lay.tb, lay.lanes, lay.stride, lay.list_stride, lay.group_lanes, lay.o_list,
                   lay.o_idx, lay.o_cnt, lay.o_grp, lay.o_keep, lay.o_flag, xarr2))
    return Plan(OP + "_fwd", ins, outs, (), (step,))
