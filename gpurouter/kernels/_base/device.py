"""fp32 device helpers shared by every kernel: the fp32 constants, the fast
``exp`` / ``1/x`` / ``fmax`` / ``fmin`` (GPU instructions, with simulator twins
chosen once per process), the score functions and their derivatives, and the
unsigned index casts.

Every float literal that meets fp32 data is one of these constants: numba
types bare Python floats as float64.
"""

from __future__ import annotations

from . import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import math

import numpy as np
from numba import cuda

from .launch import SIGMOID, SOFTMAX, SQRTSOFTPLUS, simulator_enabled

__all__ = [
    "ALL_SET", "B0", "B1", "B2", "B3", "N0", "N1", "N2", "N3",
    "EPS", "EXP_CLAMP", "NAN", "NEG_INF", "ONE", "SIGMOID", "SOFTMAX", "SOFTPLUS_THRESHOLD", "SQRTSOFTPLUS",
    "TWO", "ZERO", "activation", "activation_grad", "exp_f32", "fmax_f32", "fmin_f32", "inline_device",
    "nan_as_neg_inf", "rcp_f32", "sigmoid", "sqrtsoftplus", "u32", "u64",
]

def inline_device(fn):
    """``@cuda.jit(device=True)`` for a small device function whose callers pass
    constants (a sort stage's ``(k, j)``, a shuffle's lane distance): compiled
    once for its argument types and inlined at every call.

    numba types a constant argument by its value (``Literal[int](4)``) and
    compiles a device function once for each value it meets: a 32-sort's 15
    stages were 15 compiles of one stage, about 0.1 s each (docs/cache.md,
    "Fewer compiles"). Here the constants are typed as their plain type, so
    one compile serves every call, and the function carries LLVM's
    ``alwaysinline``: NVVM inlines each call and folds its constants, as it
    did into each single-use copy before. The simulator compiles nothing, so
    there it is a plain device function."""
    if simulator_enabled():
        return cuda.jit(device=True)(fn)
    from numba.core import types

    disp = cuda.jit(device=True, forceinline=True)(fn)
    compile_device = disp.compile_device

    def compile_unliteral(args, return_type=None):
        return compile_device(tuple(types.unliteral(a) for a in args), return_type)

    disp.compile_device = compile_unliteral  # (called by the dispatcher's call template, per call site)
    return disp


# fp32 constants: numba types bare Python floats as float64, so every literal
# that meets fp32 data is one of these.
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
TWO = np.float32(2.0)
EPS = np.float32(1e-20)  # TE's epsilon in every normalisation denominator
SOFTPLUS_THRESHOLD = np.float32(20.0)  # softplus(x) = x above this
EXP_CLAMP = np.float32(88.0)  # exp() argument cap: see exp_f32
NEG_INF = np.float32(-np.inf)
NAN = np.float32(np.nan)

# Global-memory indices go through u64: numba wraps signed indices (``i < 0``:
# ``i + n``), a few 64-bit instructions per access; unsigned ones it takes as
# they are.  Shared-memory indices go through u32 likewise.
u64 = np.uint64
u32 = np.uint32

# Routing-map words of a quad (four consecutive experts): the bool map's
# uint32 word (a byte per expert) and the BITMAP_U8 map's nibble (a bit each).
ALL_SET = np.uint32(0x01010101)  # the map word of a quad of four selected experts
B0, B1, B2, B3 = (np.uint32(0xFF << (8 * i)) for i in range(4))  # a quad word's bytes
N0, N1, N2, N3 = (np.uint32(1 << i) for i in range(4))  # a BITMAP_U8 quad nibble's bits


# ----------------------------------------------------------------------------
# Fast math (GPU instructions; Python on the simulator)
# ----------------------------------------------------------------------------


if simulator_enabled():

    @cuda.jit(device=True)
    def exp_f32(a):
        """fp32 ``exp(a)`` (the simulator's: Python doubles, the argument capped at
        88 so that ``math.exp`` never raises OverflowError; the cap only matters
        where expf overflows to inf anyway)."""
        if a > EXP_CLAMP:
            a = EXP_CLAMP
        return np.float32(math.exp(a))

    @cuda.jit(device=True)
    def rcp_f32(a):
        return np.float32(ONE / a)

    @cuda.jit(device=True)
    def fmax_f32(a, b):
        return max(a, b)

    @cuda.jit(device=True)
    def fmin_f32(a, b):
        return min(a, b)

    @cuda.jit(device=True)
    def nan_as_neg_inf(a):
        return NEG_INF if a != a else a

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def exp_f32(a):
        """fp32 ``exp(a)`` as ``ex2.approx(a * log2 e)``: two instructions instead of
        libdevice's accurate ten (relative error ~2e-7, ~2e-6 at |a| = 20,
        inside docs/contract.md section 7's 1e-5; the stage's sigmoid was a third of
        the thread-per-token forward's instructions).  exp(+-inf) = inf, 0;
        NaN stays NaN."""
        return libdevice.fast_expf(a)

    @cuda.jit(device=True)
    def rcp_f32(a):
        """fp32 ``1 / a`` by ``rcp.approx`` (within 1 ulp; 0 for a = inf) instead of
        the IEEE division's range checks and slow-path call."""
        return libdevice.fast_fdividef(ONE, a)

    @cuda.jit(device=True)
    def fmax_f32(a, b):
        """fp32 max, one instruction (numba's ``max`` is a compare and a select).
        Callers pass no NaN (fmaxf would drop it; Python's max keeps ``a``)."""
        return libdevice.fmaxf(a, b)

    @cuda.jit(device=True)
    def fmin_f32(a, b):
        return libdevice.fminf(a, b)

    @cuda.jit(device=True)
    def nan_as_neg_inf(a):
        """``a``, NaN as -inf: one fmaxf (the max of NaN and -inf is -inf)."""
        return libdevice.fmaxf(a, NEG_INF)


@cuda.jit(device=True)
def sigmoid(x):
    return rcp_f32(np.float32(ONE + exp_f32(-x)))


@cuda.jit(device=True)
def sqrtsoftplus(x):
    """``sqrt(softplus(x))``, softplus taking ``x`` itself above 20 (PyTorch's threshold),
    and ``exp(x / 2)`` below -20 (``softplus(x) = exp(x)`` there to fp32 rounding;
    ``exp(x)`` is subnormal below -87.3, ``exp(x / 2)`` normal down to -174.6:
    docs/contract.md section 2)."""
    if x > SOFTPLUS_THRESHOLD:
        return np.float32(math.sqrt(x))
    if x < -SOFTPLUS_THRESHOLD:
        return exp_f32(np.float32(x * np.float32(0.5)))
    return np.float32(math.sqrt(np.float32(math.log1p(exp_f32(x)))))


@cuda.jit(device=True)
def activation(x, score_fn):
    """sigmoid or sqrtsoftplus of an fp32 logit (``score_fn`` is the score-function code)."""
    if score_fn == SIGMOID:
        return sigmoid(x)
    return sqrtsoftplus(x)


@cuda.jit(device=True)
def activation_grad(x, a, score_fn):
    """d activation / dx given the logit ``x`` and the activation ``a``.

    sigmoid: ``a (1 - a)``; sqrtsoftplus: ``sigmoid(x) / (2 v + eps)`` for
    ``x <= 20`` and ``1 / (2 v + eps)`` above.
    """
    if score_fn == SIGMOID:
        return np.float32(a * (ONE - a))
    num = ONE if x > SOFTPLUS_THRESHOLD else sigmoid(x)
    return np.float32(num / (TWO * a + EPS))
