"""Router z-loss (ST-MoE): Numba-CUDA kernels and launchers.

``lse_t = logsumexp_e(logits[t])`` in fp32 (0 for a row of all ``-inf``: it adds
nothing and gets no gradient; NaN for a row with a NaN) and
``loss = coeff * (sum_t lse_t^2 / N)`` with ``N = total_num_tokens`` (the global
token count under sharding; default T).  The reference is
``gpurouter.reference.router_z_loss``.

Layout (``z_loss_tiling``; the measured knobs are below): a row's experts are cut into *units* of four (a
quad of ``E % 4 == 0`` rows, seen flat through ``topk.array_views``: bf16 as one
8-byte uint64, fp32 as one 16-byte load; otherwise four elements loaded one by
one, those past E masked), and a row is owned by W lanes (threads), lane ``l``
taking units ``l, l + W, ...``, ``Z_HOLD`` of them per step, all their loads
issued before any value is used (indices clamped into the row; the values of
units past the end are ignored), so that several loads per thread are in
flight: the kernels are bandwidth-bound only with enough bytes in flight.
Consecutive lanes read consecutive units: every load of a warp is coalesced.

Forward, kernel 1 (a block of TB rows x W lanes): each lane keeps an online
``(max m, sum s of exp(x - m))`` over its units (one rescale per step of
``Z_HOLD`` units, not one per element); a fixed-pairing tree in shared memory
(log2 W levels) combines the lanes; lane 0 writes ``lse`` and ``lse^2``; thread 0
sums the block's TB squares in row order into ``partial[b]``.  Kernel 2 (one
block): a fixed-shape tree of the partials, ``loss = coeff * (S / N)``.  No
atomics, every order fixed: the loss is bit-identical run to run.  The
partials are a plan scratch array (an extra XLA output under the zero-copy
transport).

Backward: purely elementwise, ``grad[t, e] = (g * 2 coeff / N) lse_t exp(x - lse_t)``
(0 on a dead row, where the saved ``lse_t`` is 0 and ``exp(-inf) = 0``), the same
lanes and units, ``lse_t`` and ``grad_loss`` read once per thread, a unit per
store (bf16: one 8-byte store; fp32: one 16-byte store).

No warp intrinsics: shared memory and ``cuda.syncthreads()`` only (the CUDA
simulator runs the same kernels).  ``exp(x - m)`` is ``2^(fma(x, log2 e, -m log2 e))``,
one ``ex2.approx`` (``_exp2``; Python on the simulator).
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools
import math

import numpy as np
from numba import cuda

from . import _launch as L
from ._plan import In, Out, Plan, Ref, Spec, Step, Tmp, execute, spec_of
from .topk import _NEG_INF, _ZERO, _fmax, _u64, array_views, flat_io, loader, nb_f32, storer

OP = "router_z_loss"

# Measured on an H200 (tools/z_loss_probe.py --sweep, T = 65536, E = 256, bf16,
# kernel times behind a sleep kernel, median of 100):
#   forward  (hold, threads): (16, 128) 28.3 us, (16, 256) 29.7, (8, 128) 31.1,
#            (32, 256) 30.4, (8, 256) 32.7, (16, 512) 35.4, (4, 256) 39.3;
#   backward (hold, threads): (8, 128) 23.3 us, (8, 256) 23.9, (4, 256) 24.0,
#            (16, 128) 28.0, (16, 256) 28.3, (32, 256) 125 (registers spill).
#: threads per block of the forward's row kernel at most (a block: TB rows x W lanes)
Z_THREADS = 128
#: units (four experts each) a lane loads at once, before using any: its
#: loads in flight together (E = 256: W = 4 lanes, one step of 16 units)
Z_HOLD = 16
#: the backward's threads per block and held units (E = 256: W = 8 lanes of 8 units)
Z_BWD_THREADS = 128
Z_BWD_HOLD = 8
#: lanes per row at most (E >= 4 * Z_HOLD * Z_MAX_LANES: several steps per lane)
Z_MAX_LANES = 32
#: threads of the final single-block kernel at most
Z_FINAL_THREADS = 1024
# Shared-array sizes must be compile-time constants (a module global is frozen
# as one; a module attribute of another module is typed as a plain int64).
_FINAL_WORDS = Z_FINAL_THREADS


def z_loss_tiling(num_tokens: int, num_experts: int, backward: bool = False):
    """``(grid, threads, lanes, units, quads)`` of the z-loss forward's row kernel
    (``backward``: of the backward kernel).

    ``units = ceil(E / 4)``; ``quads``: E % 4 == 0 (a unit is one vector
    access), else a unit is four masked element accesses.  W = ``lanes``: the
    smallest power of two with ``W * hold >= units`` (``Z_HOLD`` or
    ``Z_BWD_HOLD``), at most ``Z_MAX_LANES``; a block holds ``TB = threads / W``
    rows (``Z_THREADS`` or ``Z_BWD_THREADS``; at most T), ``threads = TB * W``;
    ``grid = ceil(T / TB)`` (0 when T == 0).
    """
    hold, threads = (Z_BWD_HOLD, Z_BWD_THREADS) if backward else (Z_HOLD, Z_THREADS)
    units = -(-int(num_experts) // 4)
    lanes = min(Z_MAX_LANES, L.pow2_at_least(-(-units // hold)))
    tb = max(1, min(max(1, threads // lanes), int(num_tokens)))
    grid = -(-int(num_tokens) // tb)
    return grid, tb * lanes, lanes, units, num_experts % 4 == 0


# ----------------------------------------------------------------------------
# Device helpers
#
# Exponentials in base 2: exp(x - m) = 2^(x log2(e) - m log2(e)), one fma and
# one ex2.approx per element (topk._exp is a mul and an ex2 after the
# subtraction).  The row's shift is kept as ``sh2 = f32(m * log2(e))`` (0 for
# m = -inf), so every term of a sum is ``2^(fma(x, log2 e, -sh2))`` and
# ``lse = (sh2 + log2(s)) ln 2`` is consistent with the terms whatever the
# rounding of ``sh2``.
# ----------------------------------------------------------------------------

_LOG2E = np.float32(1.4426950408889634)
_LN2 = np.float32(0.6931471805599453)
_EXP2_CLAMP = np.float32(126.0)

if L.simulator_enabled():

    @cuda.jit(device=True)
    def _exp2(a):
        """fp32 ``2^a`` (the simulator's: Python doubles, the argument capped so
        that ``math.pow`` never raises OverflowError; arguments are <= 0 here)."""
        if a > _EXP2_CLAMP:
            a = _EXP2_CLAMP
        return np.float32(math.pow(2.0, a))

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _exp2(a):
        """fp32 ``2^a``: libdevice's exp2f, one ``ex2.approx.f32`` (2 ulp)."""
        return libdevice.exp2f(a)


@cuda.jit(device=True)
def _shift2(m):
    """The base-2 shift of a row maximum ``m``: ``f32(m log2 e)``, 0 for -inf."""
    return np.float32(m * _LOG2E) if m != _NEG_INF else _ZERO


@cuda.jit(device=True)
def _term(x, sh2):
    """``2^(x log2 e - sh2)``: exp(x - m) for the row's shift (0 for x = -inf)."""
    return _exp2(cuda.fma(x, _LOG2E, -sh2))


@cuda.jit(device=True)
def _rescale(s, m_old, m_new):
    """A sum of terms shifted by ``m_old``, shifted by ``m_new >= m_old`` instead:
    unchanged when the max did not move; 0 (NaN stays NaN) when the old max
    was -inf (every old term 0); else times ``2^(sh2(m_old) - sh2(m_new)) <= 1``."""
    if m_old == m_new:
        return s
    if m_old == _NEG_INF:
        return np.float32(s * _ZERO)
    return np.float32(s * _exp2(np.float32(_shift2(m_old) - _shift2(m_new))))


@cuda.jit(device=True)
def _merge(ma, sa, mb, sb):
    """Two ``(max, sum of exp(x - max))`` pairs as one.  A side whose max is the
    new max keeps its sum (both -inf: sums of 0, no ``-inf - -inf``); the other
    is rescaled by ``exp(m_side - m) <= 1`` (0 from -inf).  NaN sums stay NaN."""
    m = _fmax(ma, mb)
    return m, np.float32(_rescale(sa, ma, m) + _rescale(sb, mb, m))


@cuda.jit(device=True)
def _finish(m, s):
    """``lse`` from the row's ``(max, sum)``: ``(sh2 + log2(s)) ln 2``; an all -inf
    row (m is -inf) gives its sum, 0, or NaN where a NaN entered it (fmaxf
    drops NaN from the max but not from the sum)."""
    if m == _NEG_INF:
        return s
    return np.float32(np.float32(_shift2(m) + np.float32(math.log2(s))) * _LN2)


@functools.cache
def _fetchers(kind: str, quads: bool):
    """``(aligned(a) -> bool, fetch_fast(a, t, u, units, n), fetch(a, t, u, units, n))``:
    device functions returning unit ``u`` of row ``t`` as four fp32 values.

    quads: ``a`` is the flat view (``array_views``), unit ``u`` its quad
    ``t * units + u``; fp32 ``fetch_fast`` is the 16-byte load without the
    alignment test (callers test ``aligned(a)`` once), else ``fetch``.
    Otherwise ``a`` is the 2-D array and unit ``u`` experts ``4u .. 4u + 3``,
    those ``>= n`` (E) read as -inf.
    """
    from ._vec import _always, quad_f32_unchecked

    if quads:
        load4 = flat_io(kind)[0]

        @cuda.jit(device=True)
        def fetch(a, t, u, units, n):
            return load4(a, np.int64(t) * units + u)

        if kind != L.F32:
            return _always, fetch, fetch
        aligned, load_v4 = quad_f32_unchecked()

        @cuda.jit(device=True)
        def fetch_fast(a, t, u, units, n):
            return load_v4(a, np.int64(t) * units + u)

        return aligned, fetch_fast, fetch

    load = loader(kind)

    @cuda.jit(device=True)
    def element(a, t, j, n):
        if j < n:
            return load(a, _u64(t), _u64(j))
        return _NEG_INF

    @cuda.jit(device=True)
    def fetch_elements(a, t, u, units, n):
        j = 4 * u
        return element(a, t, j, n), element(a, t, j + 1, n), element(a, t, j + 2, n), element(a, t, j + 3, n)

    return _always, fetch_elements, fetch_elements


def _held_loader(fetch, hold: int):
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


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------


@functools.cache
def _z_loss_rows_kernel(kind: str, quads: bool, hold: int):
    """Kernel 1 of the forward: ``lse`` of every row and a partial sum of
    ``lse^2`` per block (see the module docstring)."""
    aligned, fetch_fast, fetch = _fetchers(kind, quads)
    load_fast = _held_loader(fetch_fast, hold)
    load_slow = _held_loader(fetch, hold)
    held_words = 4 * hold  # a compile-time constant (local array sizes must be)

    @cuda.jit
    def kernel(
        logits,  # quads: [T*E] (bf16: [T*E/4] uint64) flat; else [T, E]; kind
        lse,  # [T] fp32, out
        partial,  # [>= grid] fp32, out: the block's sum of lse^2 (rows in order)
        num_tokens,
        num_experts,
        units,
        lanes,  # W; blockDim.x = TB * W
    ):
        red = cuda.shared.array(0, nb_f32)  # [2 * threads] lane (max, sum), then [TB] lse^2
        held = cuda.local.array(held_words, nb_f32)
        tid = np.int32(cuda.threadIdx.x)
        nthreads = np.int32(cuda.blockDim.x)
        w = np.int32(lanes)
        tok = np.int32(tid // w)
        lane = np.int32(tid - tok * w)
        tb = np.int32(nthreads // w)
        token = np.int64(cuda.blockIdx.x) * tb + tok
        live = token < num_tokens
        nu = np.int32(units)
        n = np.int32(num_experts)
        fast = aligned(logits)

        m = _NEG_INF
        s = _ZERO
        u0 = lane
        while live and u0 < nu:
            if fast:
                load_fast(held, logits, token, u0, w, nu, n)
            else:
                load_slow(held, logits, token, u0, w, nu, n)
            cm = _NEG_INF
            for h in range(hold):
                if u0 + h * w < nu:
                    cm = _fmax(cm, _fmax(_fmax(held[4 * h], held[4 * h + 1]),
                                         _fmax(held[4 * h + 2], held[4 * h + 3])))
            if cm > m:  # a new max: rescale the sum
                s = _rescale(s, m, cm)
                m = cm
            sh2 = _shift2(m)  # an all -inf step so far: 2^(-inf - 0) = 0
            for h in range(hold):
                if u0 + h * w < nu:
                    e01 = np.float32(_term(held[4 * h], sh2) + _term(held[4 * h + 1], sh2))
                    e23 = np.float32(_term(held[4 * h + 2], sh2) + _term(held[4 * h + 3], sh2))
                    s = np.float32(s + np.float32(e01 + e23))
            u0 = np.int32(u0 + hold * w)

        # The lanes of a row, combined in a fixed pairing (log2 W levels).
        red[tid] = m
        red[nthreads + tid] = s
        span = np.int32(1)
        while span < w:  # W a power of two: lane % (2 span) == lane & (2 span - 1)
            # Barrier: this level reads the previous level's (or the lanes') pairs.
            cuda.syncthreads()
            if lane & (2 * span - 1) == 0:
                mm, ss = _merge(red[tid], red[nthreads + tid], red[tid + span],
                                red[nthreads + tid + span])
                red[tid] = mm
                red[nthreads + tid] = ss
            span = np.int32(2 * span)
        # Barrier: lane 0 reads the last level's pair.
        cuda.syncthreads()
        if lane == 0:
            v = _finish(red[tid], red[nthreads + tid])
            sq = _ZERO
            if live:
                lse[_u64(token)] = v
                sq = np.float32(v * v)
            red[2 * nthreads + tok] = sq
        # The TB squares in a fixed-shape tree (pairs r, r + ceil(n/2)).
        o = 2 * nthreads
        k = tb
        while k > 1:
            # Barrier: this level reads the squares (or the previous level's sums).
            cuda.syncthreads()
            half = np.int32((k + 1) // 2)
            if tid < k - half:
                red[o + tid] = np.float32(red[o + tid] + red[o + tid + half])
            k = half
        if tid == 0:  # the last level's sum is thread 0's own (no barrier needed)
            partial[cuda.blockIdx.x] = red[o]

    return kernel


@cuda.jit
def _z_loss_final_kernel(
    partial,  # [>= nparts] fp32
    loss,  # [1] fp32, out
    nparts,
    coeff,  # fp32
    total,  # fp32: N
):
    """One block (a power of two of threads): thread i sums partials i, i + n,
    ... in order, a halving tree combines the threads; ``coeff * (S / N)``."""
    red = cuda.shared.array(_FINAL_WORDS, nb_f32)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    acc = _ZERO
    for i in range(tid, nparts, nthreads):
        acc = np.float32(acc + partial[i])
    red[tid] = acc
    half = nthreads // 2
    while half > 0:
        # Barrier: this level reads the previous level's sums.
        cuda.syncthreads()
        if tid < half:
            red[tid] = np.float32(red[tid] + red[tid + half])
        half //= 2
    if tid == 0:
        loss[0] = np.float32(coeff * np.float32(red[0] / total))


# ----------------------------------------------------------------------------
# Backward: grad[t, e] = (g * 2 coeff / N) * lse_t * exp(x - lse_t)
# ----------------------------------------------------------------------------


@functools.cache
def _z_loss_bwd_kernel(kind: str, quads: bool, hold: int):
    aligned, fetch_fast, fetch = _fetchers(kind, quads)
    load_fast = _held_loader(fetch_fast, hold)
    load_slow = _held_loader(fetch, hold)
    held_words = 4 * hold  # a compile-time constant (local array sizes must be)
    if quads:
        store4 = flat_io(kind)[1]

        @cuda.jit(device=True)
        def put(a, t, u, units, n, v0, v1, v2, v3):
            store4(a, np.int64(t) * units + u, v0, v1, v2, v3)

    else:
        store = storer(kind)

        @cuda.jit(device=True)
        def put1(a, t, j, n, v):
            if j < n:
                store(a, _u64(t), _u64(j), v)

        @cuda.jit(device=True)
        def put(a, t, u, units, n, v0, v1, v2, v3):
            j = 4 * u
            put1(a, t, j, n, v0)
            put1(a, t, j + 1, n, v1)
            put1(a, t, j + 2, n, v2)
            put1(a, t, j + 3, n, v3)

    @cuda.jit
    def kernel(
        logits,  # as in the forward
        lse,  # [T] fp32: the forward's saved lse
        grad_loss,  # [1] fp32
        grad_logits,  # as logits (bf16 quads: [T*E/4] uint64), out
        num_tokens,
        num_experts,
        units,
        lanes,  # W; blockDim.x = TB * W
        scale,  # fp32: 2 coeff / N
    ):
        held = cuda.local.array(held_words, nb_f32)
        tid = np.int32(cuda.threadIdx.x)
        w = np.int32(lanes)
        tok = np.int32(tid // w)
        lane = np.int32(tid - tok * w)
        token = np.int64(cuda.blockIdx.x) * np.int32(cuda.blockDim.x // w) + tok
        if token >= num_tokens:
            return
        nu = np.int32(units)
        n = np.int32(num_experts)
        fast = aligned(logits)
        v = lse[_u64(token)]
        a = np.float32(np.float32(grad_loss[0] * scale) * v)  # 0 on a dead row (v = 0)
        v2 = np.float32(v * _LOG2E)  # exp(x - v) = 2^(fma(x, log2 e, -v2))
        u0 = lane
        while u0 < nu:
            if fast:
                load_fast(held, logits, token, u0, w, nu, n)
            else:
                load_slow(held, logits, token, u0, w, nu, n)
            for h in range(hold):
                u = np.int32(u0 + h * w)
                if u < nu:
                    put(grad_logits, token, u, nu, n,
                        np.float32(a * _term(held[4 * h], v2)), np.float32(a * _term(held[4 * h + 1], v2)),
                        np.float32(a * _term(held[4 * h + 2], v2)), np.float32(a * _term(held[4 * h + 3], v2)))
            u0 = np.int32(u0 + hold * w)

    return kernel


# ----------------------------------------------------------------------------
# Launchers and plans
# ----------------------------------------------------------------------------


def _static_args(op: str, num_tokens: int, coeff, total_num_tokens):
    """``(coeff fp32, N)``: coeff finite, N (default max(T, 1)) >= 1."""
    c = float(coeff)
    if not math.isfinite(c):
        raise ValueError(f"{op}: coeff ({coeff!r}) must be finite.")
    total = max(num_tokens, 1) if total_num_tokens is None else int(total_num_tokens)
    if total < 1:
        raise ValueError(f"{op}: total_num_tokens ({total}) must be >= 1.")
    return np.float32(c), total


def _logits_input(logits, op: str, stream):
    d, kind = L.device_input(logits, "logits", op, stream, ndim=2)
    if int(d.shape[1]) < 1:
        raise ValueError(f"{op}: num_experts (logits.shape[-1] = 0) must be >= 1.")
    return d, kind


def _logits_arg(logits: Spec, quads: bool) -> Ref:
    """The logits as the kernels take them: flat quads (``array_views``) or 2-D."""
    return In(0, array_views(logits.kind, logits.shape)[0]) if quads else In(0)


def router_z_loss_fwd(logits, coeff, total_num_tokens=None, *, out=None, stream=0):
    """Router z-loss forward.

    Args:
      logits: (T, E) float32 | bfloat16 | float16, E >= 1, T >= 0.
      coeff: the loss coefficient (finite).
      total_num_tokens: N of ``coeff * sum_t lse_t^2 / N`` (default T, 1 when
        T == 0; the global count when token-sharded).
      out: optional ``(loss (), lse (T,))`` float32 device arrays.
      stream: numba stream or int CUDA stream handle.

    Returns:
      ``(loss () float32, saved_lse (T,) float32)``; the loss bit-identical
      run to run.
    """
    op = OP + "_fwd"
    s = L.resolve_stream(stream)
    d, kind = _logits_input(logits, op, s)
    c, total = _static_args(op, int(d.shape[0]), coeff, total_num_tokens)
    to_host = not L.any_on_device(logits) and out is None
    plan = router_z_loss_fwd_plan(spec_of(d.shape, kind), c, total)
    return tuple(execute(plan, [d], out, s, to_host))


@functools.cache
def router_z_loss_fwd_plan(logits: Spec, coeff: np.float32, total_num_tokens: int) -> Plan:
    """The launches of the forward: input logits; outputs ``loss () f32``,
    ``lse (T,) f32``; scratch: the per-block partial sums of ``lse^2``."""
    num_tokens, num_experts = logits.shape
    outs = (spec_of((), L.F32), spec_of((num_tokens,), L.F32))
    grid, threads, lanes, units, quads = z_loss_tiling(num_tokens, num_experts)
    tmps = (spec_of((max(grid, 1),), L.F32),)
    steps = []
    if grid:
        tb = threads // lanes
        steps.append(Step(_z_loss_rows_kernel(logits.kind, quads, Z_HOLD), grid, threads,
                            4 * (2 * threads + tb),
                            (_logits_arg(logits, quads), Out(1), Tmp(0), num_tokens, num_experts,
                             units, lanes)))
    final = min(Z_FINAL_THREADS, L.pow2_at_least(max(grid, 1)))
    steps.append(Step(_z_loss_final_kernel, 1, final, 0,
                        (Tmp(0), Out(0, spec_of((1,), L.F32)), grid, np.float32(coeff),
                         np.float32(total_num_tokens))))
    return Plan(OP + "_fwd", (logits,), outs, tmps, steps)


def router_z_loss_bwd(logits, saved_lse, grad_loss, coeff, total_num_tokens=None, *, out=None,
                      stream=0):
    """Router z-loss backward:
    ``grad_logits[t, e] = grad_loss * 2 coeff / N * lse_t * exp(logits[t, e] - lse_t)``.

    Args:
      logits: (T, E) float32 | bfloat16 | float16, as given to the forward.
      saved_lse: (T,) float32, the forward's second output.
      grad_loss: () float32 (host scalar, Python float or device array).
      coeff, total_num_tokens: as given to the forward.
      out: optional device array for grad_logits.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_logits (T, E), dtype of logits (0 on an all -inf row).
    """
    op = OP + "_bwd"
    s = L.resolve_stream(stream)
    d, kind = _logits_input(logits, op, s)
    num_tokens = int(d.shape[0])
    d_lse, lse_kind = L.device_input(saved_lse, "saved_lse", op, s, ndim=1)
    if lse_kind != L.F32 or tuple(d_lse.shape) != (num_tokens,):
        raise ValueError(f"{op}: saved_lse must be float32 of shape ({num_tokens},), got "
                         f"{tuple(d_lse.shape)} {d_lse.dtype}.")
    d_g, gkind = L.scalar_input(grad_loss, "grad_loss", op, s)
    if gkind != L.F32:
        raise TypeError(f"{op}: grad_loss must be float32, got {d_g.dtype}.")
    c, total = _static_args(op, num_tokens, coeff, total_num_tokens)
    to_host = not L.any_on_device(logits, saved_lse, grad_loss) and out is None
    plan = router_z_loss_bwd_plan(spec_of(d.shape, kind), c, total)
    return execute(plan, [d, d_lse, d_g], out, s, to_host)[0]


@functools.cache
def router_z_loss_bwd_plan(logits: Spec, coeff: np.float32, total_num_tokens: int) -> Plan:
    """The launches of the backward: inputs logits, ``lse (T,) f32``,
    ``grad_loss () f32``; output ``grad_logits`` (logits' shape and kind)."""
    num_tokens, num_experts = logits.shape
    ins = (logits, spec_of((num_tokens,), L.F32), spec_of((), L.F32))
    outs = (spec_of(logits.shape, logits.kind),)
    grid, threads, lanes, units, quads = z_loss_tiling(num_tokens, num_experts, backward=True)
    if not grid:
        return Plan(OP + "_bwd", ins, outs)
    # 2 coeff / N in fp32, in that order (the reference: coeff * (S / N), d/d lse_t: 2 lse_t)
    scale = np.float32(np.float32(np.float32(coeff) / np.float32(total_num_tokens)) * np.float32(2))
    grad = Out(0, array_views(logits.kind, logits.shape)[0]) if quads else Out(0)
    step = Step(_z_loss_bwd_kernel(logits.kind, quads, Z_BWD_HOLD), grid, threads, 0,
                  (_logits_arg(logits, quads), In(1), In(2, spec_of((1,), L.F32)), grad,
                   num_tokens, num_experts, units, lanes, scale))
    return Plan(OP + "_bwd", ins, outs, (), (step,))
