"""NumPy oracles of the router variants (docs/contract.md sections 9-12),
tests only, tiny sizes, plain Python loops; independent of
:mod:`gpurouter.reference` (never import it here).

Scores and weights are float64 (as in :mod:`tests.oracles`); the QB counts
are integers whose bins the contract defines in float32, so the histogram
oracle does that arithmetic in ``np.float32``, one value at a time.
"""

from __future__ import annotations

import math

import numpy as np

from gpurouter.testing import oracle as oracles


def group_score(values, rule: str, per_group: int) -> float:
    """One group's score by ``rule`` (NaN as -inf, descending sum)."""
    vals = sorted((oracles.selection_key(v) for v in values), reverse=True)
    n = {"sum_topk": per_group, "top2_sum": 2, "max": 1}[rule]
    total = vals[0]
    for v in vals[1:n]:
        total = total + v
    return total


def eligible_row(r, topk, num_groups, group_topk, rule) -> list[bool]:
    n = len(r)
    size = n // num_groups
    gs = [group_score(r[g * size:(g + 1) * size], rule, topk // group_topk) for g in range(num_groups)]
    kept = set(oracles.select_topk(gs, group_topk))
    return [(i // size) in kept for i in range(n)]


def ordered_selection(r, topk, num_groups=-1, group_topk=-1, rule="sum_topk") -> list[int]:
    """The selected experts of one row in selection order (larger ``r``
    first, the lower index among equal values)."""
    elig = None if group_topk <= 0 else eligible_row(r, topk, num_groups, group_topk, rule)
    sel = oracles.select_topk(r, topk, elig)
    return sorted(sel, key=lambda i: (-oracles.selection_key(r[i]), i))


def route(logits, topk, score_function="sigmoid", expert_bias=None, num_groups=-1, group_topk=-1,
          rule="sum_topk", scaling_factor=1.0):
    """``(probs f64 [T, E], ordered ids [T, K])`` of the top-k with a group rule."""
    x_all = np.asarray(logits, np.float64)
    num_tokens, num_experts = x_all.shape
    probs = np.zeros((num_tokens, num_experts))
    ids = np.zeros((num_tokens, topk), np.int64)
    for t in range(num_tokens):
        x = x_all[t]
        s = [oracles.activation(v, score_function) for v in x] if score_function != "softmax" else list(x)
        r = list(s) if expert_bias is None else [s[i] + float(expert_bias[i]) for i in range(num_experts)]
        order = ordered_selection(r, topk, num_groups, group_topk, rule)
        ids[t] = order
        probs[t] = oracles.weights_given_map(x, sorted(order), topk, False, score_function, scaling_factor)
    return probs, ids


def _sigmoid32(x) -> np.float32:
    return np.float32(oracles.sigmoid(float(np.float32(x))))


def qb_counts(logits, expert_bias, topk, num_bins, bounds, num_groups=-1, group_topk=-1,
              rule="sum_topk", mask=None) -> np.ndarray:
    """This call's QB counts, int64 ``[E, B]``: per valid token the cutoff is
    the (k+1)-th largest ``r = s + b`` (float32; among the kept groups), and
    every expert adds one count to ``bin(cutoff - s)`` (float32), clamped."""
    x_all = np.asarray(logits, np.float32)
    num_tokens, num_experts = x_all.shape
    b = np.asarray(expert_bias, np.float32)
    lower, upper = (np.float32(v) for v in np.asarray(bounds, np.float32))
    counts = np.zeros((num_experts, num_bins), np.int64)
    for t in range(num_tokens):
        if mask is not None and not mask[t]:
            continue
        s = [_sigmoid32(v) for v in x_all[t]]
        r = [np.float32(s[i] + b[i]) for i in range(num_experts)]
        cand = list(range(num_experts))
        if group_topk > 0:
            elig = eligible_row([float(v) for v in r], topk, num_groups, group_topk, rule)
            cand = [i for i in cand if elig[i]]
        keys = sorted((oracles.selection_key(r[i]) for i in cand), reverse=True)
        alpha = np.float32(keys[topk])
        for e in range(num_experts):
            rb = np.float32(alpha - s[e])
            v = np.float32(np.float32(rb - lower) * np.float32(np.float32(num_bins) / np.float32(upper - lower)))
            if math.isnan(float(v)):
                k = 0
            else:
                k = int(min(max(math.floor(float(v)), 0), num_bins - 1))
            counts[e, k] += 1
    return counts


def qb_update(histogram, bounds, topk):
    """``(bias, bounds)`` in float64: per expert the smallest ``x`` with the
    piecewise-linear CDF ``>= topk / E * N_e``, mean-centred; bounds ``[min - 1, max + 1]``."""
    h = np.asarray(histogram, np.float64)
    num_experts, num_bins = h.shape
    lower, upper = (float(v) for v in np.asarray(bounds, np.float64))
    width = (upper - lower) / num_bins
    xs = []
    for e in range(num_experts):
        total = sum(h[e])
        target = topk * total / num_experts
        cum = 0.0
        x = lower
        for i in range(num_bins):
            if cum + h[e, i] >= target:
                frac = (target - cum) / h[e, i] if h[e, i] > 0 else 0.0
                x = lower + (i + frac) * width
                break
            cum += h[e, i]
        xs.append(x)
    mean = sum(xs) / num_experts
    bias = np.array([x - mean for x in xs])
    return bias, np.array([bias.min() - 1, bias.max() + 1])
