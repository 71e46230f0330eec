"""Whether a top-k forward or backward takes the warp-per-token kernels
(``use_warp_path``, ``use_warp_bwd``), the dense forward's warp step
(``warp_fwd_step``) and the compact forward's plan (``compact_plan``: the warp
forward's compact mode, docs/ops/topk.md)."""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import numpy as np

from .._base.access import array_views, map_view
from .._base.launch import F32
from .._base.plan import In, Out, Plan, Spec, Step, spec_of
from .warp.bwd import WARP_BWD_MAX_EXPERTS, warp_bwd_path
from .warp.fwd import warp_launch, warp_path, warp_topk_fwd_kernel
from .warp.groups import WARP_GROUP_SCORES
from .warp.lanes import warp_auto

OP = "topk_with_score_function"


def use_warp_path(path: str, op: str, num_experts: int, topk: int, num_groups: int, group_topk: int,
                  score_fn: int, pre_softmax: bool, forced: bool) -> bool:
    """Whether the forward takes the warp-per-token kernel: ``"auto"`` where
    ``warp_path`` takes the shape and ``warp_auto`` says so (on a GPU),
    ``"warp"`` wherever ``warp_path`` takes it, else a ValueError naming
    ``op``.  Never for the replay: it takes the thread-per-token kernel, which
    sums a token's weights in the warp kernel's order (the same bits)."""
    fits = warp_path(num_experts, topk, num_groups, score_fn, pre_softmax, group_topk)
    if path == "warp" and not fits:
        raise ValueError(f"{op}: path='warp' needs sigmoid, sqrtsoftplus or softmax after the top-k "
                         "(use_pre_softmax=False), E a multiple of 128 up to 512, K <= 31 "
                         "and, with groups, at most 32 groups of 4 to 128 experts (a divisor of 128), "
                         "K // group_topk <= 2 and K <= group_topk * E / num_groups "
                         f"(E={num_experts}, K={topk}, num_groups={num_groups}, group_topk={group_topk}).")
    auto = path == "auto" and warp_auto()
    return fits and (auto or path == "warp") and not forced


def use_warp_bwd(path: str, op: str, num_experts: int, score_fn: int, pre_softmax: bool) -> bool:
    """Whether the backward takes the warp-per-token kernel: ``"auto"`` where
    ``warp_bwd_path`` takes the shape on a GPU (``warp_auto``), ``"warp"``
    wherever it takes it (else a ValueError naming ``op``), never ``"quad"``."""
    if path not in ("auto", "warp", "quad"):
        raise ValueError(f"{op}: path must be 'auto', 'warp' or 'quad', got {path!r}.")
    fits = warp_bwd_path(num_experts, score_fn, pre_softmax)
    if path == "warp" and not fits:
        raise ValueError(f"{op}: path='warp' needs a routing map outside softmax-pre and E a multiple of 128 "
                         f"up to {WARP_BWD_MAX_EXPERTS} (E={num_experts}, use_pre_softmax={pre_softmax}).")
    return fits and (path == "warp" or (path == "auto" and warp_auto()))


def warp_fwd_step(logits: Spec, outs: tuple, bias_in: bool, bitmap: bool, indices: bool, topk: int,
                  score_fn: int, groups: int, group_topk: int, rule: str, scale: np.float32, save: bool,
                  qb_cutoff: str) -> Step:
    """The dense forward's launch of the warp kernel (``plans.topk_with_score_function_fwd_plan``'s
    ``outs``: probs, map, [saved with ``save``], [indices], [alpha with ``qb_cutoff``]; inputs:
    logits, [bias with ``bias_in``]).  Arrays the kernel is given but never reads or writes (no
    bias, no saved scores, ...) are one-word views of the probs."""
    num_tokens, num_experts = logits.shape
    cut = (False, qb_cutoff) if qb_cutoff else ()  # (compact, cutoff); without: the cache key as before
    kern = warp_topk_fwd_kernel(logits.kind, num_experts, int(topk), int(score_fn), bias_in, bitmap, indices,
                                groups, group_topk, rule, *cut)
    words, quads, flat = array_views(logits.kind, (num_tokens, num_experts))
    unused = Out(0, Spec((1,), np.float32))
    saved = Out(2, flat) if save else unused
    xarr = Out(2 + bool(save), Spec((num_tokens * int(topk),), np.int32)) if indices else Out(0, Spec((1,), np.int32))
    alpha = Out(len(outs) - 1) if qb_cutoff else unused
    return Step(kern, *warp_launch(num_tokens), 0,
                (In(0, words), In(1) if bias_in else unused, Out(0, words), Out(1, map_view(outs[1], quads)),
                 saved, xarr, num_tokens, np.float32(scale), 0, alpha, int(bool(save))))


def compact_plan(logits: Spec, has_bias: bool, topk: int, pre_softmax: bool, num_groups, group_topk,
                  scale: np.float32, score_fn: int, forced: bool, path: str, group_score: str) -> Plan:
    """The compact forward (inputs: logits, bias; outputs: weights ``[T, K]`` of
    the logits' kind and indices ``[T, K]`` int32): the warp kernel's compact mode."""
    op = OP + "_fwd_plan"
    if forced:
        raise ValueError(f"{op}: compact with forced indices: a replay's compact output is its dense "
                         "probs gathered at the forced indices.")
    if group_score not in WARP_GROUP_SCORES:
        raise ValueError(f"{op}: group_score must be one of {WARP_GROUP_SCORES}, got {group_score!r}.")
    num_tokens, num_experts = logits.shape
    grouped = group_topk is not None and group_topk > 0
    G, Kg = (int(num_groups), int(group_topk)) if grouped else (0, 0)
    if not use_warp_path(path, op, num_experts, int(topk), G, Kg, int(score_fn), bool(pre_softmax), False):
        raise ValueError(f"{op}: compact runs on the warp kernel only (path='warp', or 'auto' on a GPU, where "
                         f"it takes the shape; E={num_experts}, K={topk}, num_groups={num_groups}, "
                         f"group_topk={group_topk}, path={path!r}).")
    k = int(topk)
    outs = (spec_of((num_tokens, k), logits.kind), Spec((num_tokens, k), np.int32))
    ins = (logits, spec_of((num_experts,), F32)) if has_bias else (logits,)
    if num_tokens == 0:
        return Plan(OP + "_fwd", ins, outs)
    # the map and saved arguments are never written: views of the indices' first word
    bias = In(1) if has_bias else Out(1, Spec((1,), np.float32))
    kern = warp_topk_fwd_kernel(logits.kind, num_experts, k, int(score_fn), bool(has_bias), False, True, G, Kg,
                                group_score if grouped else "sum_topk", True)
    words = array_views(logits.kind, (num_tokens, num_experts))[0]
    flat_w = spec_of((num_tokens * k,), logits.kind)
    step = Step(kern, *warp_launch(num_tokens), 0,
                (In(0, words), bias, Out(0, flat_w), Out(1, Spec((1,), np.uint32)), Out(1, Spec((1,), np.float32)),
                 Out(1, Spec((num_tokens * k,), np.int32)), num_tokens, np.float32(scale), 0,
                 Out(1, Spec((1,), np.float32)), 0))
    return Plan(OP + "_fwd", ins, outs, (), (step,))
