"""NumPy float64 oracles of the router losses (tests only, tiny sizes).

The aux loss (docs/contract.md section 4), the router z-loss, the expert-bias
update and DeepSeek-V3's sequence-wise balance loss, written with plain Python
loops and independent of :mod:`gpurouter.reference`. Re-exported by
:mod:`gpurouter.testing.oracle`, next to the router top-k oracle.
"""

from __future__ import annotations

import math

import numpy as np


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


# ----------------------------------------------------------------------------
# Aux loss (docs/contract.md section 4)
# ----------------------------------------------------------------------------


def aux_loss_coeff(num_experts, coeff, topk, total_num_tokens) -> float:
    t = float(total_num_tokens)
    return float(num_experts) * float(coeff) / (float(topk) * t * t)


def aux_loss_fwd(probs, tokens_per_expert, topk, coeff, total_num_tokens=None,
                 num_experts=None):
    """Oracle of ``moe_aux_loss_fwd``: ``(loss f64, C f64)``."""
    p = _f64(probs)
    tpe = _f64(tokens_per_expert)
    rows, cols = p.shape
    total = rows if total_num_tokens is None else total_num_tokens
    e = cols if num_experts is None else num_experts
    c = aux_loss_coeff(e, coeff, topk, total)
    acc = 0.0
    for j in range(cols):
        col = 0.0
        for i in range(rows):
            col += p[i, j]
        acc += col * tpe[j]
    return c * acc, c


def aux_loss_bwd(saved_coeff, tokens_per_expert, grad_loss, num_rows) -> np.ndarray:
    """Oracle of ``moe_aux_loss_bwd``: ``grad_probs[r, c] = C * tpe[c] * grad_loss``."""
    tpe = _f64(tokens_per_expert)
    out = np.zeros((num_rows, len(tpe)))
    for i in range(num_rows):
        for j in range(len(tpe)):
            out[i, j] = float(saved_coeff) * tpe[j] * float(grad_loss)
    return out


# ----------------------------------------------------------------------------
# Router z-loss and the expert-bias update (docs/losses.md)
# ----------------------------------------------------------------------------


def _row_lse(row) -> float:
    """logsumexp of one row in float64; 0 for a row of all -inf (docs/losses.md)."""
    m = max(row)
    if m == -math.inf:
        return 0.0
    if math.isnan(m) or any(math.isnan(v) for v in row):
        return math.nan
    return m + math.log(sum(math.exp(v - m) for v in row))


def z_loss(logits, coeff, total_num_tokens=None) -> float:
    """ST-MoE's z-loss: ``coeff / T * sum_t lse_t^2``."""
    x = _f64(logits).reshape(-1, np.shape(logits)[-1])
    total = x.shape[0] if total_num_tokens is None else total_num_tokens
    return float(coeff) * sum(_row_lse(list(r)) ** 2 for r in x) / max(total, 1)


def z_loss_grad(logits, coeff, total_num_tokens=None) -> np.ndarray:
    """d z_loss / d logits: ``coeff / T * 2 lse_t softmax(x_t)`` (0 on an all -inf row)."""
    shape = np.shape(logits)
    x = _f64(logits).reshape(-1, shape[-1])
    total = x.shape[0] if total_num_tokens is None else total_num_tokens
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        lse = _row_lse(list(row))
        if max(row) == -math.inf:
            continue
        # softmax as exp(v - m) / sum: exp(v - lse) loses lse's rounding,
        # which grows with the logits (lse = 1e30 + 2.8 rounds to 1e30 in float64)
        m = max(row)
        total_exp = sum(math.exp(v - m) for v in row)
        out[t] = [float(coeff) / max(total, 1) * 2 * lse * (math.exp(v - m) / total_exp) for v in row]
    return out.reshape(shape)


def update_expert_bias(bias, counts, rate) -> np.ndarray:
    """DeepSeek-V3's rule: ``bias + rate * sign(mean(load) - load)``."""
    load = _f64(counts)
    mean = sum(load) / len(load)
    return np.array([float(b) + float(rate) * float(np.sign(mean - n)) for b, n in zip(_f64(bias), load, strict=True)])


def deepseek_sequence_balance_loss(scores, topk_mask, alpha) -> float:
    """DeepSeek-V3's sequence-wise balance loss (technical report, eqs. 17-20),
    averaged over sequences: for each sequence of T tokens,
    ``f_i = E / (K T) * #{t: i in TopK_t}``, ``P_i = 1 / T * sum_t s'_{i,t}``
    (``s'`` the affinities normalised over all E), ``L = alpha * sum_i f_i P_i``.

    ``scores``, ``topk_mask``: ``[B, T, E]``.
    """
    s = _f64(scores)
    m = np.asarray(topk_mask)
    b, t, e = s.shape
    k = int(m[0, 0].sum())
    total = 0.0
    for q in range(b):
        loss = 0.0
        for i in range(e):
            f = e / (k * t) * sum(bool(m[q, r, i]) for r in range(t))
            p = sum(s[q, r, i] for r in range(t)) / t
            loss += f * p
        total += alpha * loss
    return total / b
