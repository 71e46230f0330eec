"""Comparison tolerances (docs/contract.md section 7) and the comparators built on them.

| kind      | fp32                     | bf16 / fp16                    |
| --------- | ------------------------ | ------------------------------ |
| probs     | atol 1e-6, rtol 1e-5     | one ulp of the output dtype    |
| grads     | atol 1e-5*sqrt(E), rtol 1e-4 | atol 1e-2, rtol 1e-2       |
| aux_loss  | rtol 1e-5                | rtol 1e-2                      |

The conformance checks hold half-precision probs to a tighter rule than one
ulp: :func:`assert_rounded_once` (half an ulp of the float64 oracle, plus
float32 rounding), since the contract rounds them once from float32.
``probs`` also covers the dense aux scores (always float32 out) and the saved
float32 intermediates. Sources: JAX's default test tolerances (fp32 1e-6,
bf16 1e-2), JAX's ~10x looser gradient tolerances, Tokamax's sqrt(n) atol
scaling for reductions over n terms. Tighten from measurements; never loosen
one without a comment giving the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

HALF = ("bfloat16", "float16")


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float
    ulp: bool = False  # compare within one ulp of the output dtype instead


TOL: dict[tuple[str, str], Tol] = {
    ("probs", "fp32"): Tol(atol=1e-6, rtol=1e-5),
    ("probs", "half"): Tol(atol=0.0, rtol=0.0, ulp=True),
    ("grads", "fp32"): Tol(atol=1e-5, rtol=1e-4),  # atol times sqrt(E)
    ("grads", "half"): Tol(atol=1e-2, rtol=1e-2),
    ("aux_loss", "fp32"): Tol(atol=0.0, rtol=1e-5),
    ("aux_loss", "half"): Tol(atol=0.0, rtol=1e-2),
}


def _name(dtype) -> str:
    return np.dtype(dtype).name


def _family(dtype) -> str:
    return "half" if _name(dtype) in HALF else "fp32"


def tolerance(kind: str, dtype, E: int | None = None) -> Tol:
    """The tolerance of ``kind`` for inputs of ``dtype`` (float64 counts as fp32)."""
    tol = TOL[(kind, _family(dtype))]
    if kind == "grads" and _family(dtype) == "fp32":
        assert E is not None, "grads tolerances scale with sqrt(E): pass E"
        tol = Tol(atol=tol.atol * math.sqrt(E), rtol=tol.rtol)
    return tol


def spacing(x: np.ndarray, dtype) -> np.ndarray:
    """One ulp of ``dtype`` at ``|x|`` (as float32)."""
    if _name(dtype) == "bfloat16":
        dt = ml_dtypes.bfloat16
    else:
        dt = np.dtype(dtype).type
    ax = np.abs(np.asarray(x, np.float32)).astype(dt)
    return np.abs(np.spacing(ax)).astype(np.float32)


def _f32(a) -> np.ndarray:
    return np.asarray(np.asarray(a).astype(np.float32))


def _report(actual, expected, bad, err, bound, what) -> str:
    idx = np.unravel_index(int(np.argmax(np.where(bad, err - bound, -np.inf))), bad.shape) \
        if bad.ndim else ()
    return (
        f"{what}: {int(bad.sum())} of {bad.size} elements out of tolerance; worst at "
        f"{tuple(int(i) for i in idx)}: actual {actual[idx]!r}, expected {expected[idx]!r}, "
        f"|diff| {err[idx]!r} > bound {bound[idx]!r}"
    )


def assert_close(actual, expected, kind: str, dtype, E: int | None = None,
                 *, check_dtype: bool = True, err_msg: str = "") -> None:
    """Asserts ``actual`` matches ``expected`` within the contract tolerance of ``kind``.

    Both sides are upcast to float32 first. ``dtype`` is the dtype of the inputs
    (it picks the tolerance row); with ``check_dtype`` the dtype of ``actual``
    must equal ``dtype`` of ``expected`` when ``expected`` carries one that is
    not float64 (a float64 oracle carries none). NaN must match NaN and
    infinities must match exactly.
    """
    if check_dtype and hasattr(expected, "dtype") and _name(expected.dtype) != "float64":
        assert _name(actual.dtype) == _name(expected.dtype), (
            f"{err_msg}: dtype {actual.dtype} != expected {expected.dtype}")
    a = _f32(actual)
    e = _f32(expected)
    assert a.shape == e.shape, f"{err_msg}: shape {a.shape} != {e.shape}"
    tol = tolerance(kind, dtype, E)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), f"{err_msg}: NaN positions differ: {a} vs {e}"
    inf = np.isinf(a) | np.isinf(e)
    assert np.array_equal(a[inf], e[inf]), f"{err_msg}: infinities differ: {a} vs {e}"
    ok = ~(nan_a | inf)
    a0, e0 = np.where(ok, a, 0), np.where(ok, e, 0)
    err = np.abs(a0 - e0)
    if tol.ulp:
        out_dtype = actual.dtype if hasattr(actual, "dtype") else dtype
        bound = spacing(np.maximum(np.abs(a0), np.abs(e0)), out_dtype)
    else:
        bound = tol.atol + tol.rtol * np.abs(e0)
    bad = err > bound
    if bad.any():
        raise AssertionError(_report(a0, e0, bad, err, bound, err_msg or kind))


def assert_rounded_once(actual, expected, *, err_msg: str = "") -> None:
    """Asserts half-precision ``actual`` is the float64 ``expected`` rounded once to its dtype.

    The contract computes probs in float32 and casts them once to the logits
    dtype (docs/contract.md section 2, step 6), so each value is within half an
    ulp of the exact value, plus float32 rounding: the bound is
    ``0.5 * ulp + 1e-5 * |expected| + 2**-126`` (the ulp of ``actual``'s dtype
    at the larger magnitude; the last term forgives float32 intermediates
    flushed to 0). A value rounded twice (to the half dtype, then scaled or
    normalised, then rounded again) lands on the wrong neighbour, more than
    half an ulp away, which :func:`assert_close`'s one-ulp bound lets pass.
    NaN must match NaN and infinities must match exactly.
    """
    a = _f32(actual)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{err_msg}: shape {a.shape} != {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), f"{err_msg}: NaN positions differ: {a} vs {e}"
    inf = np.isinf(a) | np.isinf(e)
    assert np.array_equal(a[inf], e[inf]), f"{err_msg}: infinities differ: {a} vs {e}"
    ok = ~(nan_a | inf)
    a0, e0 = np.where(ok, a, 0).astype(np.float64), np.where(ok, e, 0)
    err = np.abs(a0 - e0)
    ulp = spacing(np.maximum(np.abs(a0), np.abs(e0)).astype(np.float32), actual.dtype).astype(np.float64)
    bound = 0.5 * ulp + 1e-5 * np.abs(e0) + 2.0**-126
    bad = err > bound
    if bad.any():
        raise AssertionError(_report(a0, e0, bad, err, bound, err_msg or "probs"))


def assert_dtype(actual, dtype, what: str = "") -> None:
    assert _name(actual.dtype) == _name(dtype), f"{what}: dtype {actual.dtype} != {_name(dtype)}"


def assert_topk_equivalent(map_a, map_b, values, k: int, *, err_msg: str = "") -> None:
    """Tie-aware comparison of two routing maps (the FlashInfer pattern).

    Both maps must have exactly ``k`` True per row. Where they differ, the
    experts picked by only one side must tie (as selection keys: NaN as -inf,
    -0.0 == +0.0) with experts picked by only the other side.
    ``values`` are the selection scores the choice was made on (``[T, E]``).
    """
    a = np.asarray(map_a, bool).reshape(-1, np.shape(map_a)[-1])
    b = np.asarray(map_b, bool).reshape(a.shape)
    v = np.asarray(values, np.float32).reshape(a.shape)
    v = np.where(np.isnan(v), -np.inf, v)
    assert (a.sum(-1) == k).all(), f"{err_msg}: row sums {a.sum(-1)} != {k}"
    assert (b.sum(-1) == k).all(), f"{err_msg}: row sums {b.sum(-1)} != {k}"
    for t in range(a.shape[0]):
        only_a = np.flatnonzero(a[t] & ~b[t])
        only_b = np.flatnonzero(b[t] & ~a[t])
        assert len(only_a) == len(only_b)
        if len(only_a):
            va, vb = np.sort(v[t, only_a]), np.sort(v[t, only_b])
            assert np.array_equal(va, vb), (
                f"{err_msg}: row {t}: maps differ at {only_a.tolist()} vs {only_b.tolist()} "
                f"with values {va.tolist()} vs {vb.tolist()} (not a tie)")
