"""Calling ``fn``, reading what it returned, comparing with the oracle; tie robustness.
"""

from __future__ import annotations

import math

import numpy as np

from .. import oracle
from ..strategies import (
    RouterConfig,
)
from ..tolerances import assert_close
from ._report import _Violation

#: Largest shapes the checks draw (tiny: the float64 oracle is plain Python loops,
#: and kernels on the CUDA simulator pay per launch).
MAX_TOKENS = 4
MAX_EXPERTS = 32


# ----------------------------------------------------------------------------
# Calling fn and reading what it returned
# ----------------------------------------------------------------------------


def _describe(obj) -> str:
    if isinstance(obj, (tuple, list)):
        inner = ", ".join(_describe(o) for o in obj)
        return f"{type(obj).__name__} of {len(obj)}: ({inner})"
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"{type(obj).__name__} {np.dtype(obj.dtype).name}{list(obj.shape)}"
    return f"{type(obj).__name__} {obj!r}"[:200]


def _call(fn, args, context: str):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any exception of fn is reported as a violation
        raise _Violation(f"{context}\nfn raised {type(e).__name__}: {e}") from None


def _pair(res, shape, dtype, map_shape, context: str, names=("probs", "routing_map")):
    """``(a, b)`` from fn's result: a tuple of two arrays of ``shape``, ``dtype`` and bool."""
    ok = isinstance(res, (tuple, list)) and len(res) == 2 and all(
        hasattr(r, "shape") and hasattr(r, "dtype") for r in res)
    if not ok:
        raise _Violation(f"{context}\nfn must return ({names[0]}, {names[1]}); it returned {_describe(res)}")
    a, b = res
    want = (f"{names[0]} {np.dtype(dtype).name}{list(shape)}, {names[1]} bool{list(map_shape)}")
    if (tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) != np.dtype(dtype)
            or tuple(b.shape) != tuple(map_shape) or np.dtype(b.dtype) != np.dtype(bool)):
        raise _Violation(f"{context}\nfn returned {_describe(res)}; expected ({want})")
    return a, b


def _scalar(res, dtype, context: str):
    if not (hasattr(res, "shape") and hasattr(res, "dtype")) or tuple(res.shape) != () \
            or np.dtype(res.dtype) != np.dtype(dtype):
        raise _Violation(f"{context}\nfn returned {_describe(res)}; expected a {np.dtype(dtype).name} scalar "
                         "(shape ())")
    return res


def _arr(a) -> str:
    return np.array2string(np.asarray(a, np.float32), precision=6, separator=", ", threshold=10_000,
                           max_line_width=120)


def _close(got, want, kind, dtype, E=None, what="") -> str | None:
    try:
        assert_close(got, want, kind, dtype, E=E, check_dtype=False, err_msg=what)
    except AssertionError as e:
        return f"{e}\n  expected {what} = {_arr(want)}\n  got      {what} = {_arr(got)}"
    return None


def _map_diff(got, want, what="routing_map") -> str | None:
    got, want = np.asarray(got, bool), np.asarray(want, bool)
    if np.array_equal(got, want):
        return None
    g2, w2 = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    t = int(np.flatnonzero((g2 != w2).any(-1))[0])
    return (f"{what} differs at token {t}: expected experts {np.flatnonzero(w2[t]).tolist()}, "
            f"got {np.flatnonzero(g2[t]).tolist()}")


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
