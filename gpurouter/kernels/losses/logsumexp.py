"""Device helpers of the router z-loss kernels (``z_loss.py``): a row's
logsumexp in base 2, online (a running ``(max, sum)`` rescaled when the max
moves) and combined pairwise in a fixed order, and the loads of a row's
*units* (four experts each) held in registers.

Exponentials in base 2: exp(x - m) = 2^((x - m) log2(e)), a subtraction, a
multiply and one ex2.approx per element.  The shift is the row maximum ``m``
itself (0 for m = -inf: ``shift_of``), subtracted before the multiply: the
older ``fma(x, log2 e, -f32(m log2 e))`` form overflowed to NaN for logits
above 2.4e38 (``m log2 e`` is inf) and its rounding of ``m log2 e`` grew with
``m``.  ``lse = m + ln(s)`` in fp32 (``lse_of``), and the forward saves
``(m, log2 s)`` per row, not ``lse``: the backward's softmax is
``2^((x - m) log2 e - log2 s)``, accurate at any logit magnitude, where
``exp(x - f32(lse))`` carried lse's rounding (up to ulp(1e8) = 8 at 1e8:
docs/contract.md section 3).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools
import math

import numpy as np
from numba import cuda

from .._base.access import flat_io, loader_2d
from .._base.device import NEG_INF, ZERO, fmax_f32, u64
from .._base.launch import F32, simulator_enabled

LOG2E = np.float32(1.4426950408889634)
LN2 = np.float32(0.6931471805599453)
EXP2_CLAMP = np.float32(126.0)

if simulator_enabled():

    @cuda.jit(device=True)
    def exp2_f32(a):
        """fp32 ``2^a`` (the simulator's: Python doubles, the argument capped so
        that ``math.pow`` never raises OverflowError; arguments are <= 0 here)."""
        if a > EXP2_CLAMP:
            a = EXP2_CLAMP
        return np.float32(math.pow(2.0, a))

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def exp2_f32(a):
        """fp32 ``2^a``: libdevice's exp2f, one ``ex2.approx.f32`` (2 ulp)."""
        return libdevice.exp2f(a)


@cuda.jit(device=True)
def shift_of(m):
    """The shift of a row maximum ``m``: ``m``, 0 for -inf (every term then 2^-inf = 0)."""
    return m if m != NEG_INF else ZERO


@cuda.jit(device=True)
def exp2_term(x, sh):
    """``2^((x - sh) log2 e)``: exp(x - m) for the row's shift (0 for x = -inf)."""
    return exp2_f32(np.float32(np.float32(x - sh) * LOG2E))


@cuda.jit(device=True)
def rescale_sum(s, m_old, m_new):
    """A sum of terms shifted by ``m_old``, shifted by ``m_new >= m_old`` instead:
    unchanged when the max did not move; 0 (NaN stays NaN) when the old max
    was -inf (every old term 0); else times ``2^((m_old - m_new) log2 e) <= 1``."""
    if m_old == m_new:
        return s
    if m_old == NEG_INF:
        return np.float32(s * ZERO)
    return np.float32(s * exp2_f32(np.float32(np.float32(m_old - m_new) * LOG2E)))


@cuda.jit(device=True)
def merge_max_sum(ma, sa, mb, sb):
    """Two ``(max, sum of exp(x - max))`` pairs as one.  A side whose max is the
    new max keeps its sum (both -inf: sums of 0, no ``-inf - -inf``); the other
    is rescaled by ``exp(m_side - m) <= 1`` (0 from -inf).  NaN sums stay NaN."""
    m = fmax_f32(ma, mb)
    return m, np.float32(rescale_sum(sa, ma, m) + rescale_sum(sb, mb, m))


@cuda.jit(device=True)
def saved_pair(m, s, lg2s):
    """What the forward saves of a row, ``(m, l)``: ``l = log2(s)`` (``lg2s``, computed
    by the caller); for an all -inf row (m is -inf) ``l`` is its sum, 0 (or NaN
    where a NaN entered it: fmaxf drops NaN from the max but not from the sum)."""
    if m == NEG_INF:
        return m, s
    return m, lg2s


@cuda.jit(device=True)
def lse_of_saved(m, lg):
    """``lse`` from a saved ``(m, lg)``: ``f32(m + f32(lg ln 2))``; ``lg`` (0 or NaN)
    for an all -inf row.  The forward's loss and the backward use this one
    expression: the same ``lse`` bit for bit."""
    if m == NEG_INF:
        return lg
    return np.float32(m + np.float32(lg * LN2))


@cuda.jit(device=True)
def backward_row(m, lg):
    """A row's backward constants from its saved ``(m, lg)``: ``(lse, sh, l2)``
    with ``exp(x - lse) = softmax_term(x, sh, l2)``; an all -inf row gives
    ``(lg, 0, 0)`` (its terms 2^-inf = 0, its lse 0 or NaN)."""
    if m == NEG_INF:
        return lg, ZERO, ZERO
    return lse_of_saved(m, lg), m, lg


@cuda.jit(device=True)
def softmax_term(x, sh, l2):
    """``exp(x - lse) = 2^((x - m) log2 e - log2 s)``: one subtraction, one fma and
    one exp2 an element, as the forward's terms (``backward_row`` gives the constants)."""
    return exp2_f32(cuda.fma(np.float32(x - sh), LOG2E, -l2))


@cuda.jit(device=True)
def lse_of(m, s):
    """``lse`` from the row's ``(max, sum)`` (see ``lse_of_saved``)."""
    mm, ll = saved_pair(m, s, np.float32(math.log2(s)) if m != NEG_INF else ZERO)
    return lse_of_saved(mm, ll)


@functools.cache
def unit_fetchers(kind: str, quads: bool):
    """``(aligned(a) -> bool, fetch_fast(a, t, u, units, n), fetch(a, t, u, units, n))``:
    device functions returning unit ``u`` of row ``t`` as four fp32 values.

    quads: ``a`` is the flat view (``array_views``), unit ``u`` its quad
    ``t * units + u``; fp32 ``fetch_fast`` is the 16-byte load without the
    alignment test (callers test ``aligned(a)`` once), else ``fetch``.
    Otherwise ``a`` is the 2-D array and unit ``u`` experts ``4u .. 4u + 3``,
    those ``>= n`` (E) read as -inf.
    """
    from .._base.vec import _always, quad_f32_unchecked

    if quads:
        load4 = flat_io(kind)[0]

        @cuda.jit(device=True)
        def fetch(a, t, u, units, n):
            return load4(a, np.int64(t) * units + u)

        if kind != F32:
            return _always, fetch, fetch
        aligned, load_v4 = quad_f32_unchecked()

        @cuda.jit(device=True)
        def fetch_fast(a, t, u, units, n):
            return load_v4(a, np.int64(t) * units + u)

        return aligned, fetch_fast, fetch

    load = loader_2d(kind)

    @cuda.jit(device=True)
    def element(a, t, j, n):
        if j < n:
            return load(a, u64(t), u64(j))
        return NEG_INF

    @cuda.jit(device=True)
    def fetch_elements(a, t, u, units, n):
        j = 4 * u
        return element(a, t, j, n), element(a, t, j + 1, n), element(a, t, j + 2, n), element(a, t, j + 3, n)

    return _always, fetch_elements, fetch_elements


def held_unit_loader(fetch, hold: int):
    """Device function ``load_held(held, a, t, u0, lanes, units, n)``: the lane's
    ``hold`` units ``u0, u0 + lanes, ...`` of row ``t`` into ``held`` (a local
    array indexed by constants once unrolled: registers), every load before
    any use; units past the row's end read its last unit and are not used."""

    @cuda.jit(device=True)
    def load_held(held, a, t, u0, lanes, units, n):
        for h in range(hold):
            u = min(np.int32(u0 + h * lanes), np.int32(units - 1))
            v0, v1, v2, v3 = fetch(a, t, u, units, n)
            held[4 * h] = v0
            held[4 * h + 1] = v1
            held[4 * h + 2] = v2
            held[4 * h + 3] = v3

    return load_held
