"""The oracles of the #37 audit tests (``tests/ops/test_audit_*.py``), and the
backends they run on.

The tests are written from the semantics as TE #3395 (QB), the Kimi K3 report
section 2.3.3 with Megatron #6637 (the bias update), DeepSeek-V3/V2 (the
group-score rules), Megatron #3096 (padding masks) and TE #3129 (dense
indices) state them, against these oracles: NumPy float64 (exact integers
for the counts), independent of :mod:`gpurouter.reference` and of
``tests/variant_oracles.py``. Where the contract settles something those
sources leave open, the test follows the contract and says so."""

from __future__ import annotations

import numpy as np
import pytest

from gpurouter import _backend

NUMBA = pytest.param("numba", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not _backend.numba_usable(),
                       reason="backend='numba' needs numba-cuda and a GPU or NUMBA_ENABLE_CUDASIM=1")])
BACKENDS = ["jax", NUMBA]
EPS = 1e-20
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- oracles (float64 / exact)

def _sig(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _order(values):
    """Indices by value, larger first, the lower index on ties; NaN as -inf."""
    v = np.where(np.isnan(values), -np.inf, np.asarray(values, np.float64))
    return sorted(range(v.shape[0]), key=lambda i: (-v[i], i))


def _kept_groups(r, num_groups, group_topk, topk, rule):
    """The eligible-expert mask of one token: groups scored by ``rule``."""
    gs = r.shape[0] // num_groups
    take = {"sum_topk": topk // group_topk, "top2_sum": 2, "max": 1}[rule]
    scores = [sum(sorted(r[g * gs:(g + 1) * gs], reverse=True)[:take]) for g in range(num_groups)]
    keep = np.zeros(r.shape[0], bool)
    for g in _order(np.array(scores))[:group_topk]:
        keep[g * gs:(g + 1) * gs] = True
    return keep


def _route(r, topk, groups=None):
    """(selected ids in selection order, the (K+1)-th eligible value or None)."""
    eligible = np.ones(r.shape[0], bool) if groups is None else _kept_groups(r, *groups)
    ranked = [i for i in _order(np.where(eligible, r, -np.inf)) if eligible[i]]
    return ranked[:topk], (r[ranked[topk]] if len(ranked) > topk else None)


def _sigmoid_router(x, topk, bias, scaling=1.0, groups=None):
    """probs [T, E], map [T, E], ids [T, K], cutoff [T] of a sigmoid router (contract sec. 2, 12)."""
    s = _sig(x)
    r = s + np.asarray(bias, np.float64)
    t, e = x.shape
    probs, rmap = np.zeros((t, e)), np.zeros((t, e), bool)
    ids, cut = np.zeros((t, topk), np.int64), np.zeros(t)
    for i in range(t):
        sel, alpha = _route(r[i], topk, groups)
        w = s[i, sel] / (s[i, sel].sum() + EPS) if topk > 1 else s[i, sel]
        probs[i, sel], rmap[i, sel], ids[i], cut[i] = scaling * w, True, sel, alpha
    return probs, rmap, ids, cut


def _positions(x, bias, topk, bounds, num_bins, groups=None):
    """QB bin positions before the floor, float64: (alpha_t - s[t, e] - lower) * B / (upper - lower)."""
    s = _sig(x)
    cut = _sigmoid_router(x, topk, bias, groups=groups)[3]
    lower, upper = (float(v) for v in bounds)
    return (cut[:, None] - s - lower) * num_bins / (upper - lower)


def _counts(pos, num_bins, valid=None):
    """Exact int64 histogram [E, B] of the floor'ed, clamped positions of the valid tokens."""
    t, e = pos.shape
    valid = np.ones(t, bool) if valid is None else valid
    bins = np.clip(np.floor(np.nan_to_num(pos, nan=0.0, posinf=num_bins, neginf=-1)), 0, num_bins - 1)
    hist = np.zeros((e, num_bins), np.int64)
    for i in range(t):
        if valid[i]:
            for j in range(e):
                hist[j, int(bins[i, j])] += 1
    return hist


def _clean_logits(t, e, seed, bias, topk, bounds, num_bins, groups=None, scale=1.5, margin=1e-3, gap=1e-4):
    """Logits whose QB bin positions are >= ``margin`` bins from every edge, and whose expert
    (and group) scores are tie-free by ``gap``: float32 vs float64 rounding cannot move a
    count or a choice."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        x = np.asarray(rng.normal(size=(t, e)) * scale, np.float32)
        pos = _positions(x, bias, topk, bounds, num_bins, groups)
        frac = pos - np.floor(pos)
        r = _sig(x) + np.asarray(bias, np.float64)
        ok = np.min(np.minimum(frac, 1 - frac)) > margin and np.min(np.diff(np.sort(r, axis=1), axis=1)) > gap
        if ok and groups is not None:
            take = {"sum_topk": groups[2] // groups[1], "top2_sum": 2, "max": 1}[groups[3]]
            gs = -np.sort(-r.reshape(t, groups[0], -1), axis=2)[:, :, :take].sum(2)
            ok = np.min(np.diff(np.sort(gs, axis=1), axis=1)) > gap
        if ok:
            return x
    raise AssertionError("no clean draw")


def _sigmoid_grad(x, rmap, cot, scaling=1.0):
    """d sum(probs * cot) / dx of the sigmoid router, K > 1 (contract section 3), float64."""
    a, m = _sig(x), rmap.astype(np.float64)
    g = cot * scaling
    ssum = (m * a).sum(1, keepdims=True)
    d = (m * g * a).sum(1, keepdims=True)
    return m * (g - d / (ssum + EPS)) / (ssum + EPS) * a * (1 - a)


def _qb_bias_update(hist, bounds, topk):
    """Kimi K3 / Megatron #6637 in float64: the k/E quantile linear in its bin, mean-centred."""
    e, b = hist.shape
    lower, upper = (float(v) for v in bounds)
    w = (upper - lower) / b
    x = np.zeros(e)
    for j in range(e):
        n = hist[j].sum()
        target = n * topk / e
        if n == 0:
            x[j] = lower
            continue
        cum = 0
        for i in range(b):
            if cum + hist[j, i] >= target and hist[j, i] > 0:
                x[j] = lower + (i + (target - cum) / hist[j, i]) * w
                break
            cum += hist[j, i]
    bias = x - x.mean()
    return bias, np.array([bias.min() - 1, bias.max() + 1])
