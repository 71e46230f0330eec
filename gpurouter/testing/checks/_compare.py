"""Calling ``fn``, reading what it returned, and comparing it with the oracle (messages included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._dtypes import np_dtype
from ..tolerances import HALF, assert_close, assert_rounded_once
from ._report import _Violation

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
    """None if ``got`` matches the oracle's ``want``, else the message. Half-precision
    probs must be the oracle's value rounded once (:func:`assert_rounded_once`)."""
    try:
        if kind == "probs" and np.dtype(got.dtype).name in HALF:
            assert_rounded_once(got, want, err_msg=what)
        else:
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


def _scalar_vjp(f, a, out_dtype, g: float, ctx: str, name: str, in_dtype: str):
    """``d(g * f(a)) / da`` by ``jax.vjp``; ``f(a)`` must be a scalar of ``out_dtype`` and the
    gradient must have ``a``'s dtype (``in_dtype``), else a violation naming ``name``."""
    try:
        out, pullback = jax.vjp(f, a)
        _scalar(out, out_dtype, ctx)
        (da,) = pullback(jnp.asarray(g, out.dtype))
    except _Violation:
        raise
    except Exception as e:  # noqa: BLE001 - any exception of fn is reported as a violation
        raise _Violation(f"{ctx}\njax.vjp of fn raised {type(e).__name__}: {e}") from None
    if np.dtype(da.dtype) != np.dtype(np_dtype(in_dtype)):
        raise _Violation(f"{ctx}\n{name} must have the dtype of its input ({in_dtype}); got {da.dtype}")
    return da
