"""Quantile Balancing's fp32 math on the device: the sigmoid, bit for bit
``jax.nn.sigmoid`` on the platform, and the bin (docs/contract.md section 12).

XLA lowers ``jax.nn.sigmoid`` to ``1 / (1 + exp(-x))``; negation, addition,
subtraction and multiplication are IEEE everywhere, so the ``exp`` and the
division decide. XLA:CPU divides as IEEE does (numba's ``/``, ``div.rn``);
XLA:GPU divides approximately, as PTX's ``div.full.f32``: CUDA's ``__fdividef``
with both operands scaled by 1/4 where the divisor is ``>= 2^126`` (measured
on an H200 with jax 0.11.2: ``1 / (1 + e)`` by ``div.rn`` differs from XLA's
in 23,091 of 163,840 values; by ``__fdividef`` alone in the 917 values of
``x`` in ``[-88.72, -87.34]`` of 163,840 in ``[-100, 100]``; scaled, in none).
``exp_mode``:

- ``"libdevice"`` (a GPU's default): numba's ``math.exp``, libdevice's
  ``__nv_expf``, the function XLA:GPU calls for an fp32 ``exp`` (equal to
  XLA's on all 163,840 values above), and that division;
- ``"libdevice_ftz"``: the same, a denormal sigmoid flushed to 0 (XLA:GPU
  run with ``--xla_gpu_ftz``: only ``x < -87.3`` differs);
- ``"cephes"``: the Cephes polynomial with FMAs, XLA:CPU's fp32 ``exp``, and
  the IEEE division
  (measured bit for bit against jax 0.10's XLA:CPU on 4M values in
  ``[-100, 100]``, denormal results flushed to 0 as XLA:CPU does): the CUDA
  simulator's only mode, so that the simulator tests compare bit for bit with
  jnp on the CPU; on a GPU it runs with ``cuda.fma``.

:func:`qb_sigmoid_probe` runs a mode's sigmoid on a vector: the public op
compares it once a process with ``jax.nn.sigmoid`` on the device
(``gpurouter/_ops/qb.py``) and counts in jnp where no mode matches.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools
import math

import numpy as np
from numba import cuda

from .._base.access import loader_1d
from .._base.device import ONE, ZERO
from .._base.launch import F32, device_input, resolve_stream, simulator_enabled
from .._base.plan import In, Out, Plan, Step, execute, spec_of

EXP_MODES = ("libdevice", "libdevice_ftz", "cephes")


def default_exp_mode() -> str:
    """The simulator's only mode is ``"cephes"`` (XLA:CPU's exp); a GPU's default is ``"libdevice"``."""
    return "cephes" if simulator_enabled() else "libdevice"

# ----------------------------------------------------------------------------
# The sigmoid (bit for bit XLA's) and the bin
# ----------------------------------------------------------------------------

# Cephes' expf (XLA:CPU's fp32 exp): n = floor(x log2 e + 1/2), the reduction
# by ln 2 in two parts, a degree-5 polynomial, then 2^n.
_EXP_HI = np.float32(88.3762626647949)
_EXP_LO = np.float32(-88.3762626647949)
_LOG2E = np.float32(1.44269504088896341)
_HALF = np.float32(0.5)
_C1 = np.float32(-0.693359375)
_C2 = np.float32(2.12194440e-4)
_P0, _P1, _P2, _P3, _P4, _P5 = (np.float32(v) for v in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_TINY = np.float32(np.finfo(np.float32).tiny)

if simulator_enabled():

    @cuda.jit(device=True)
    def _fma(a, b, c):
        # fp32 fma: the exact product and sum in double, rounded once more to
        # fp32 (a double rounding: off by an ulp only in ties ~2^-29 apart)
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))

    @cuda.jit(device=True)
    def _ldexp(y, n):
        return np.float32(math.ldexp(float(y), int(n)))

    @cuda.jit(device=True)
    def _floor(v):
        return np.float32(math.floor(v))

    @cuda.jit(device=True)
    def _libdevice_exp(a):
        return np.float32(math.exp(min(float(a), 88.8)))

    @cuda.jit(device=True)
    def _gpu_div(a, b):  # (no __fdividef here: the simulator runs "cephes" only)
        return np.float32(a / b)

else:

    @cuda.jit(device=True)
    def _fma(a, b, c):
        return cuda.fma(a, b, c)

    @cuda.jit(device=True)
    def _ldexp(y, n):
        # y in [0.5, 2): 2^n in two halves (n in [-128, 128])
        h = np.int32(n) // np.int32(2)
        a = np.int32(np.int32(h + np.int32(127)) << np.int32(23)).view(np.float32)
        b = np.int32(np.int32(np.int32(n - h) + np.int32(127)) << np.int32(23)).view(np.float32)
        return np.float32(np.float32(y * a) * b)

    @cuda.jit(device=True)
    def _floor(v):
        return np.float32(math.floor(v))

    @cuda.jit(device=True)
    def _libdevice_exp(a):
        return math.exp(a)  # fp32 in, fp32 out: libdevice's __nv_expf

    from numba.cuda import libdevice as _libdevice

    _BIG = np.float32(2.0**126)
    _QUARTER = np.float32(0.25)

    @cuda.jit(device=True)
    def _gpu_div(a, b):
        # XLA:GPU's fp32 division (PTX div.full.f32): __fdividef, with both
        # operands scaled by 1/4 where |b| >= 2^126 (where __fdividef alone
        # returns 0); measured equal to XLA's on an H200 for x in [-100, 100]
        if abs(b) >= _BIG:
            return _libdevice.fast_fdividef(a * _QUARTER, b * _QUARTER)
        return _libdevice.fast_fdividef(a, b)


@cuda.jit(device=True)
def _flush(v):
    """``v``, a denormal flushed to 0 (as XLA:CPU, or XLA:GPU with ftz, computes)."""
    return ZERO if abs(v) < _TINY else v


@cuda.jit(device=True)
def _cephes_exp(a):
    if a != a:
        return a
    x = a
    if x > _EXP_HI:
        x = _EXP_HI
    if x < _EXP_LO:
        x = _EXP_LO
    m = _floor(np.float32(np.float32(x * _LOG2E) + _HALF))
    r = _fma(m, _C1, x)
    r = _fma(m, _C2, r)
    y = _P0
    y = _fma(y, r, _P1)
    y = _fma(y, r, _P2)
    y = _fma(y, r, _P3)
    y = _fma(y, r, _P4)
    y = _fma(y, r, _P5)
    y = _fma(y, np.float32(r * r), r)
    y = np.float32(y + ONE)
    return _flush(_ldexp(y, m))


@functools.cache
def qb_sigmoid_fn(exp_mode: str):
    """Device function ``sigmoid(x) = 1 / (1 + exp(-x))`` (fp32) with ``exp_mode``'s exp and division."""
    if exp_mode not in EXP_MODES:
        raise ValueError(f"qb_counts: exp_mode must be one of {EXP_MODES}, got {exp_mode!r}.")
    flush = exp_mode != "libdevice"
    if exp_mode == "cephes":
        @cuda.jit(device=True)
        def sigmoid(x):
            s = np.float32(ONE / np.float32(ONE + _cephes_exp(np.float32(-x))))
            return _flush(s) if flush else s
    else:
        @cuda.jit(device=True)
        def sigmoid(x):
            s = np.float32(_gpu_div(ONE, np.float32(ONE + _libdevice_exp(np.float32(-x)))))
            return _flush(s) if flush else s

    return sigmoid


@cuda.jit(device=True)
def qb_bin(rb, lower, scale, top_f):
    """``floor((rb - lower) * scale)`` clamped into ``[0, B - 1]``, NaN to 0
    (``scale`` = fp32 ``B / (upper - lower)``, ``top_f`` = fp32 (B - 1)): the
    reference's ``qb_bins`` (reference/variants.py), rounding for rounding."""
    q = np.float32(np.float32(rb - lower) * scale)
    if not q >= ZERO:  # negative (floor < 0 or in [-1, 0): clamped to 0) or NaN
        return np.int32(0)
    if q >= top_f:  # floor(q) >= B - 1, +inf included
        return np.int32(top_f)
    return np.int32(q)  # q in [0, B - 1): truncation is floor


@functools.cache
def qb_sigmoid_probe_kernel(exp_mode: str):
    sigmoid = qb_sigmoid_fn(exp_mode)
    load = loader_1d(F32)

    @cuda.jit
    def probe(x, out, n):
        i = np.int64(cuda.grid(1))
        if i < n:
            out[i] = sigmoid(load(x, i))

    return probe


def qb_sigmoid_probe(x, exp_mode: str | None = None, stream=0):
    """``1 / (1 + exp(-x))`` of float32 ``x`` (flattened) by the QB kernels' sigmoid
    of ``exp_mode`` (None: :func:`default_exp_mode`); NumPy in and out."""
    exp_mode = exp_mode or default_exp_mode()
    s = resolve_stream(stream)
    d, kind = device_input(np.ascontiguousarray(np.asarray(x, np.float32).reshape(-1)), "x", "qb_sigmoid_probe", s)
    n = int(d.shape[0])
    threads = 32 if simulator_enabled() else 256
    steps = (Step(qb_sigmoid_probe_kernel(exp_mode), max(1, -(-n // threads)), threads, 0, (In(0), Out(0), n)),)
    plan = Plan("qb_sigmoid_probe", (spec_of((n,), F32),), (spec_of((n,), F32),), (), steps if n else ())
    return execute(plan, [d], None, s, True)[0]


__all__ = ["EXP_MODES", "default_exp_mode", "qb_bin", "qb_sigmoid_fn", "qb_sigmoid_probe"]
