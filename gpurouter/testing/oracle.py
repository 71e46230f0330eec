"""NumPy float64 brute-force oracles of the router ops (tests only, tiny sizes).

Written from docs/contract.md sections 2-4, row by row with plain Python loops, and
independent of :mod:`gpurouter.reference` (never import it here): the oracle
checks the reference, the reference checks the kernels.

Every function takes NumPy arrays (any float dtype; upcast to float64) and
returns float64 values (bool for routing maps). The low-level pairs mirror the
reference's dense ``[T, E]`` forward/backward, saved intermediate included, in
TransformerEngine's convention (see ``gpurouter/reference/topk.py``):

- sigmoid: ``sigmoid(x)``; sqrtsoftplus: raw ``x``;
- softmax pre (and aux scores): softmax over all E;
- softmax post: the softmax over the selected experts, ``-inf`` elsewhere.
"""

from __future__ import annotations

import math

import numpy as np

# the losses' oracles live in loss_oracle.py; their names are part of this module too
from .loss_oracle import aux_loss_bwd as aux_loss_bwd
from .loss_oracle import aux_loss_coeff as aux_loss_coeff
from .loss_oracle import aux_loss_fwd as aux_loss_fwd
from .loss_oracle import deepseek_sequence_balance_loss as deepseek_sequence_balance_loss
from .loss_oracle import update_expert_bias as update_expert_bias
from .loss_oracle import z_loss as z_loss
from .loss_oracle import z_loss_grad as z_loss_grad

EPS = 1e-20
SOFTPLUS_THRESHOLD = 20.0
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _sf(score_function) -> str:
    name = getattr(score_function, "name", score_function)
    name = str(name).lower()
    assert name in SCORE_FUNCTIONS, name
    return name


# ----------------------------------------------------------------------------
# Selection (docs/contract.md section 2, "Selection order, ties, -inf, NaN")
# ----------------------------------------------------------------------------


def selection_key(v: float) -> float:
    """The value a selection compares: NaN counts as -inf, -0.0 as +0.0."""
    v = float(v)
    if math.isnan(v):
        return -math.inf
    if v == 0.0:
        return 0.0
    return v


def select_topk(values, k: int, eligible=None) -> list[int]:
    """Indices of the top ``k`` eligible entries of one row, ascending.

    Larger value first, the lower index among equal values; exactly ``k``
    distinct indices (fillers: the lowest-index eligible entries at -inf).
    """
    n = len(values)
    cand = [i for i in range(n) if eligible is None or eligible[i]]
    assert len(cand) >= k, (len(cand), k)
    cand.sort(key=lambda i: (-selection_key(values[i]), i))
    return sorted(cand[:k])


def group_scores(r, num_groups: int, per_group: int) -> list[float]:
    """Sum of the top ``per_group`` values (NaN as -inf) of each group of one row."""
    size = len(r) // num_groups
    out = []
    for g in range(num_groups):
        vals = sorted((selection_key(v) for v in r[g * size : (g + 1) * size]), reverse=True)
        total = 0.0
        for v in vals[:per_group]:
            total = total + v
        out.append(total)
    return out


def select_row(r, topk: int, num_groups: int = -1, group_topk: int = -1) -> list[int]:
    """The selected set ``I`` of one row of selection scores, groups included."""
    n = len(r)
    if group_topk <= 0:
        return select_topk(r, topk)
    size = n // num_groups
    gs = group_scores(r, num_groups, topk // group_topk)
    kept = set(select_topk(gs, group_topk))
    eligible = [(i // size) in kept for i in range(n)]
    return select_topk(r, topk, eligible)


# ----------------------------------------------------------------------------
# Score functions (float64, one value or one row)
# ----------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    x = float(x)
    if math.isnan(x):
        return math.nan
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def softplus(x: float) -> float:
    x = float(x)
    if math.isnan(x):
        return math.nan
    if x > SOFTPLUS_THRESHOLD:
        return x
    return math.log1p(math.exp(x))


def sqrtsoftplus(x: float) -> float:
    return math.sqrt(softplus(x)) if not math.isnan(float(x)) else math.nan


def sqrtsoftplus_grad(x: float) -> float:
    v = sqrtsoftplus(x)
    num = 1.0 if float(x) > SOFTPLUS_THRESHOLD else sigmoid(x)
    return num / (2.0 * v + EPS)


def softmax(row) -> np.ndarray:
    """Softmax of one row; an all -inf row (or one with NaN) gives NaN, as jax.nn.softmax."""
    x = _f64(row)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - np.max(x))
        return e / np.sum(e)


def activation(x: float, score_function: str) -> float:
    return sigmoid(x) if _sf(score_function) == "sigmoid" else sqrtsoftplus(x)


# ----------------------------------------------------------------------------
# Top-k forward / backward
# ----------------------------------------------------------------------------


def _scores_row(x: np.ndarray, sf: str, use_pre_softmax: bool) -> np.ndarray:
    if sf == "softmax":
        return softmax(x) if use_pre_softmax else x.copy()
    return np.array([activation(v, sf) for v in x])


def weights_given_map(logits_row, selected, topk, use_pre_softmax, score_function,
                      scaling_factor=1.0) -> np.ndarray:
    """Dense ``probs`` of one row (float64) for a given selected set (steps 5-6)."""
    sf = _sf(score_function)
    x = _f64(logits_row)
    s = _scores_row(x, sf, use_pre_softmax)
    out = np.zeros(len(x))
    sel = list(selected)
    if sf == "softmax" and not use_pre_softmax:
        q = softmax(x[sel])
        for j, i in enumerate(sel):
            out[i] = q[j]
    elif sf == "softmax":
        for i in sel:
            out[i] = s[i]
    else:
        total = 0.0
        for i in sel:
            total += s[i]
        for i in sel:
            out[i] = s[i] / (total + EPS) if topk > 1 else s[i]
    return scaling_factor * out


def topk_fwd(logits, topk, use_pre_softmax=False, num_groups=-1, group_topk=-1,
             scaling_factor=1.0, score_function="softmax", expert_bias=None):
    """Oracle of ``topk_with_score_function_fwd`` on ``[T, E]``.

    Returns ``(probs f64, routing_map bool, saved f64)``; probs are not cast.
    """
    sf = _sf(score_function)
    x_all = _f64(logits)
    num_tokens, num_experts = x_all.shape
    probs = np.zeros((num_tokens, num_experts))
    rmap = np.zeros((num_tokens, num_experts), bool)
    saved = np.zeros((num_tokens, num_experts))
    bias = None if expert_bias is None else _f64(expert_bias)
    for t in range(num_tokens):
        x = x_all[t]
        s = _scores_row(x, sf, use_pre_softmax)
        r = s.copy()
        if bias is not None and sf != "softmax":
            r = np.array([s[i] + bias[i] for i in range(num_experts)])
        sel = select_row(r, topk, num_groups, group_topk)
        rmap[t, sel] = True
        probs[t] = weights_given_map(x, sel, topk, use_pre_softmax, sf, scaling_factor)
        if sf == "softmax" and not use_pre_softmax:
            saved[t] = -np.inf
            q = softmax(x[sel])
            for j, i in enumerate(sel):
                saved[t, i] = q[j]
        elif sf == "softmax" or sf == "sigmoid":
            saved[t] = s
        else:
            saved[t] = x
    return probs, rmap, saved


def _normalised_bwd_row(a, da, g, m, normalise: bool) -> np.ndarray:
    n = len(a)
    dx = np.zeros(n)
    if not normalise:
        for j in range(n):
            dx[j] = g[j] * da[j] if m[j] else 0.0
        return dx
    big_s = 0.0
    big_d = 0.0
    for j in range(n):
        if m[j]:
            big_s += a[j]
            big_d += g[j] * a[j]
    big_s += EPS
    for j in range(n):
        if m[j]:
            dx[j] = (g[j] / big_s - big_d / (big_s * big_s)) * da[j]
    return dx


def _act_and_grad_from_saved(saved_row, sf: str):
    if sf == "sigmoid":
        a = np.array(saved_row, np.float64)
        return a, a * (1.0 - a)
    a = np.array([sqrtsoftplus(v) for v in saved_row])
    return a, np.array([sqrtsoftplus_grad(v) for v in saved_row])


def topk_bwd(routing_map, saved, grad_probs, topk, use_pre_softmax=False,
             scaling_factor=1.0, score_function="softmax") -> np.ndarray:
    """Oracle of ``topk_with_score_function_bwd`` (docs/contract.md section 3), float64."""
    sf = _sf(score_function)
    m_all = np.asarray(routing_map, bool)
    sv_all = _f64(saved)
    g_all = _f64(grad_probs) * float(scaling_factor)
    num_tokens, n = m_all.shape
    dx = np.zeros((num_tokens, n))
    for t in range(num_tokens):
        m, sv, g = m_all[t], sv_all[t], g_all[t]
        if sf == "softmax" and use_pre_softmax:
            p = sv
            acc = sum(g[i] * p[i] for i in range(n) if m[i])
            for j in range(n):
                dx[t, j] = p[j] * ((g[j] if m[j] else 0.0) - acc)
        elif sf == "softmax":
            acc = sum(g[i] * sv[i] for i in range(n) if m[i])
            for j in range(n):
                dx[t, j] = sv[j] * (g[j] - acc) if m[j] else 0.0
        else:
            a, da = _act_and_grad_from_saved(sv, sf)
            dx[t] = _normalised_bwd_row(a, da, g, m, normalise=topk > 1)
    return dx


# ----------------------------------------------------------------------------
# Aux-loss scores
# ----------------------------------------------------------------------------


def aux_scores_fwd(logits, topk, score_function="softmax"):
    """Oracle of ``score_for_aux_loss_fwd``: ``(scores f64, routing_map, saved f64)``."""
    sf = _sf(score_function)
    x_all = _f64(logits)
    num_tokens, n = x_all.shape
    scores = np.zeros((num_tokens, n))
    rmap = np.zeros((num_tokens, n), bool)
    saved = np.zeros((num_tokens, n))
    for t in range(num_tokens):
        x = x_all[t]
        if sf == "softmax":
            scores[t] = softmax(x)
            saved[t] = scores[t]
        else:
            v = [activation(xi, sf) for xi in x]
            total = 0.0
            for vi in v:
                total += vi
            scores[t] = [vi / (total + EPS) for vi in v]
            saved[t] = v if sf == "sigmoid" else x
        rmap[t, select_topk(scores[t], topk)] = True
    return scores, rmap, saved


def aux_scores_bwd(saved, grad_scores, score_function="softmax") -> np.ndarray:
    """Oracle of ``score_for_aux_loss_bwd``, float64."""
    sf = _sf(score_function)
    sv_all = _f64(saved)
    g_all = _f64(grad_scores)
    num_tokens, n = sv_all.shape
    dx = np.zeros((num_tokens, n))
    for t in range(num_tokens):
        sv, g = sv_all[t], g_all[t]
        if sf == "softmax":
            acc = sum(g[i] * sv[i] for i in range(n))
            dx[t] = [sv[j] * (g[j] - acc) for j in range(n)]
        else:
            a, da = _act_and_grad_from_saved(sv, sf)
            dx[t] = _normalised_bwd_row(a, da, g, [True] * n, normalise=True)
    return dx
