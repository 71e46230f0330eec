"""What the checks draw: one helper per drawing stanza, and the tie-robustness filter.

Every property of a check draws through these helpers (a config, its bias and
its logits; a cotangent), so a stanza is written once. ``data`` is hypothesis's
``st.data()`` object; each draw carries a label, which names it in the
counterexample hypothesis prints.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
from hypothesis import assume

from .. import oracle
from ..strategies import (
    RouterConfig,
    biases,
    random_cotangent,
    router_configs,
    selection_scores,
    tie_biases,
    tie_configs,
    tie_free_logits,
)

#: Largest shapes the checks draw (tiny: the float64 oracle is plain Python loops,
#: and kernels on the CUDA simulator pay per launch).
MAX_TOKENS = 4
MAX_EXPERTS = 32
#: Largest E of the tied and masked draws (ties need few experts to be common).
MAX_TIE_EXPERTS = 16
#: Cotangents of the scalar losses: positive, negative, and not 1 (a missing
#: multiplication by the cotangent shows).
LOSS_COTANGENTS = (1.0, -0.5, 3.0)


def _exclusive(cfg: RouterConfig, exclude_a_group: bool) -> RouterConfig:
    if exclude_a_group:
        assume(cfg.grouped and cfg.group_topk < cfg.num_groups)
    return cfg


def draw_config(data, dtypes, score_functions, *, max_experts: int = MAX_EXPERTS, exclude_a_group: bool = False,
                **kw) -> RouterConfig:
    """A valid :class:`RouterConfig` of at most ``MAX_TOKENS`` x ``max_experts``.

    ``kw`` goes to :func:`~gpurouter.testing.strategies.router_configs`; with
    ``exclude_a_group`` the config is grouped and ``group_topk < num_groups``
    (some group is always left out)."""
    cfg = data.draw(router_configs(max_tokens=MAX_TOKENS, max_experts=max_experts, dtypes=dtypes,
                                   score_functions=score_functions, **kw), label="config")
    return _exclusive(cfg, exclude_a_group)


def draw_tie_free(data, dtypes, score_functions, **kw) -> tuple[RouterConfig, np.ndarray, np.ndarray | None]:
    """``(cfg, logits, expert_bias)``: a config, its bias (or None) and tie-free logits for them."""
    cfg = draw_config(data, dtypes, score_functions, **kw)
    bias = data.draw(biases(cfg), label="expert_bias")
    x = data.draw(tie_free_logits(cfg, bias), label="logits")
    return cfg, x, bias


def draw_tie_config(data, dtypes, score_functions, **kw) -> tuple[RouterConfig, np.ndarray | None]:
    """``(cfg, expert_bias)`` for tied or masked logits (:func:`~gpurouter.testing.strategies.tie_configs`,
    :func:`~gpurouter.testing.strategies.tie_biases`; E <= ``MAX_TIE_EXPERTS``)."""
    exclude_a_group = kw.pop("exclude_a_group", False)
    cfg = data.draw(tie_configs(max_tokens=MAX_TOKENS, max_experts=MAX_TIE_EXPERTS, dtypes=dtypes,
                                score_functions=score_functions, **kw), label="config")
    return _exclusive(cfg, exclude_a_group), data.draw(tie_biases(cfg), label="expert_bias")


def draw_cotangent(data, shape, dtype: str = "float32") -> np.ndarray:
    """A standard-normal cotangent of ``shape``, exactly representable in ``dtype``."""
    return random_cotangent(data.draw(st.integers(0, 2**16), label="cotangent seed"), shape, dtype)


def draw_loss_cotangent(data) -> float:
    """The cotangent of a scalar loss, one of :data:`LOSS_COTANGENTS`."""
    return data.draw(st.sampled_from(LOSS_COTANGENTS), label="cotangent")


def assume_robust(cfg: RouterConfig, x, bias=None, r=None) -> None:
    """Rejects the draw unless its selection is decided by the tie rule alone (see :func:`_robust`).

    ``r`` defaults to the selection scores of ``x`` under ``cfg`` and ``bias``."""
    r = selection_scores(x, cfg, bias) if r is None else r
    assume(_robust(x, r, _groups_of(cfg), bias))


# ----------------------------------------------------------------------------
# Tie robustness: ties are decided by the rule; near-ties that are not ties are skipped
# ----------------------------------------------------------------------------


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b)) + 1e-6


def _ambiguous_row(keys, ident, num_groups: int, per_group: int) -> bool:
    """True when two entries (or groups) are within float32 rounding without being
    structurally equal (same logit and bias): float32 may order them either way."""
    n = len(keys)
    for i in range(n):
        for j in range(i + 1, n):
            a, b = keys[i], keys[j]
            if math.isinf(a) or math.isinf(b) or ident[i] == ident[j]:
                continue
            if _near(a, b):
                return True
    if num_groups > 0:
        size = n // num_groups
        tops = [sorted(keys[g * size:(g + 1) * size], reverse=True)[:per_group] for g in range(num_groups)]
        sums = [float(sum(t)) for t in tops]
        for g in range(num_groups):
            for h in range(g + 1, num_groups):
                if tops[g] == tops[h] or math.isinf(sums[g]) or math.isinf(sums[h]):
                    continue
                if _near(sums[g], sums[h]):
                    return True
    return False


def _robust(x, r, cfg_groups: tuple[int, int], bias=None) -> bool:
    """Every row of selection scores ``r`` is free of non-structural near-ties."""
    num_groups, per_group = cfg_groups
    x = np.asarray(x, np.float64)
    for t in range(x.shape[0]):
        keys = [oracle.selection_key(v) for v in r[t]]
        ident = [("nan",) if math.isnan(x[t, i]) else (float(x[t, i]), 0.0 if bias is None else float(bias[i]))
                 for i in range(x.shape[1])]
        if _ambiguous_row(keys, ident, num_groups, per_group):
            return False
    return True


def _groups_of(cfg: RouterConfig) -> tuple[int, int]:
    return (cfg.num_groups, cfg.topk // cfg.group_topk) if cfg.grouped else (0, 0)
