"""NumPy float64 brute-force oracles of the token-level MoE ops (tests only).

Written from docs/ops/moe_ops.md with plain Python loops, independent of
:mod:`gpurouter.reference.moe_ops` (never import it here). Inputs are NumPy
arrays of any float dtype (upcast to float64); ``row_id_map`` is gpurouter's
``[T, E]`` layout (the padded output row, or -1).
"""

from __future__ import annotations

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def group_of_rows(offsets, num_rows: int) -> list[int]:
    """``g(i)`` for each row, -1 for rows no group owns."""
    offsets = [int(o) for o in np.asarray(offsets)]
    out = [-1] * num_rows
    for g in range(len(offsets) - 1):
        for i in range(max(offsets[g], 0), min(offsets[g + 1], num_rows)):
            out[i] = g
    return out


def grouped_dbias_dscales(dy, scales, bias, offsets):
    dy, bias = _f64(dy), _f64(bias)
    n, h = dy.shape
    num_groups = bias.shape[0]
    s = _f64(scales) if scales is not None else np.ones(n)
    dbias = np.zeros((num_groups, h))
    dscales = np.zeros(n)
    for i, g in enumerate(group_of_rows(offsets, n)):
        if g < 0:
            continue
        for c in range(h):
            dbias[g, c] += dy[i, c] * s[i]
            dscales[i] += dy[i, c] * bias[g, c]
    return dbias, dscales


def grouped_dbias(dy, offsets, num_groups: int):
    return grouped_dbias_dscales(dy, None, np.zeros((num_groups, np.shape(dy)[1])), offsets)[0]


def scaled_bias_add(y, bias, scales, group_sizes):
    y, bias, s = _f64(y), _f64(bias), _f64(scales)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(group_sizes))])
    out = y.copy()
    for i, g in enumerate(group_of_rows(offsets, y.shape[0])):
        if g >= 0:
            out[i] = y[i] + bias[g] * s[i]
    return out


def dispatch(inp, routing_map, num_out_tokens: int, probs=None, align_size=None):
    """``(output, permuted_probs, row_id_map, pad_offsets, tokens_per_expert)``, loops."""
    inp = _f64(inp)
    m = np.asarray(routing_map, bool)
    t_count, e_count = m.shape
    counts = [int(m[:, e].sum()) for e in range(e_count)]
    if align_size is None:
        padded = counts
        rows = num_out_tokens
    else:
        a = align_size
        padded = [-(-c // a) * a for c in counts]
        rows = ((num_out_tokens + e_count * (a - 1)) // a) * a
    pad_offsets = []
    acc = 0
    for e in range(e_count):
        pad_offsets.append(acc)
        acc += padded[e] - counts[e]
    out = np.zeros((rows, inp.shape[1]))
    pp = np.zeros(rows)
    rid = -np.ones((t_count, e_count), np.int64)
    row = 0
    for e in range(e_count):
        block = row
        for t in range(t_count):
            if m[t, e]:
                if row < rows:
                    rid[t, e] = row
                    out[row] = inp[t]
                    if probs is not None:
                        pp[row] = float(np.asarray(probs, np.float64)[t, e])
                row += 1
        row = block + padded[e]
    return (out, pp if probs is not None else None, rid,
            np.array(pad_offsets) if align_size is not None else None, np.array(padded))


def dispatch_bwd(d_out, d_pp, rid):
    """``(d_inp [T, H], d_probs [T, E])``."""
    d_out = _f64(d_out)
    t_count, e_count = rid.shape
    d_inp = np.zeros((t_count, d_out.shape[1]))
    d_probs = np.zeros((t_count, e_count))
    for t in range(t_count):
        for e in range(e_count):
            r = int(rid[t, e])
            if r >= 0:
                d_inp[t] += d_out[r]
                if d_pp is not None:
                    d_probs[t, e] = float(_f64(d_pp)[r])
    return d_inp, d_probs


def combine(inp, rid, merging_probs=None):
    inp = _f64(inp)
    t_count, e_count = rid.shape
    out = np.zeros((t_count, inp.shape[1]))
    for t in range(t_count):
        for e in range(e_count):
            r = int(rid[t, e])
            if r >= 0:
                w = 1.0 if merging_probs is None else float(_f64(merging_probs)[t, e])
                out[t] += w * inp[r]
    return out


def combine_bwd(dy, inp, rid, merging_probs=None):
    """``(d_inp [R, H], d_merging_probs [T, E])``; rows no pair points to get 0."""
    dy, inp = _f64(dy), _f64(inp)
    t_count, e_count = rid.shape
    d_inp = np.zeros_like(inp)
    d_w = np.zeros((t_count, e_count))
    for t in range(t_count):
        for e in range(e_count):
            r = int(rid[t, e])
            if r >= 0:
                w = 1.0 if merging_probs is None else float(_f64(merging_probs)[t, e])
                d_inp[r] = w * dy[t]
                d_w[t, e] = float(np.dot(inp[r], dy[t]))
    return d_inp, d_w
