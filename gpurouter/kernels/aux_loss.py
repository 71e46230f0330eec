"""Switch load-balancing aux loss: Numba-CUDA kernels and launchers (CONTRACT section 4).

``C = num_experts * coeff / (topk * T * T)`` (fp32, host, in that order) and
``loss = C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c]``.

Deterministic by construction (≠TE, which uses float atomics): a grid of
blocks writes per-block column partials ``[nblocks, C]`` (block b sums a fixed
row range, thread t columns ``t, t + threads, ...``); one single-block kernel
then reduces them in a fixed order (blocks in order per column, then a
shared-memory tree over the threads) and multiplies by C.  No atomics.
"""

from __future__ import annotations

from . import _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda

from .._host import aux_loss_coeff
from . import _launch as L
from .topk import _ZERO, loader1, nb_f32, storer, storer1

OP = "moe_aux_loss"
_FINAL_THREADS_MAX = L.MAX_THREADS  # static shared size of the final reduction


@functools.cache
def _aux_loss_partial_kernel(kind: str):
    from .topk import loader

    load = loader(kind)

    @cuda.jit
    def kernel(
        probs,  # [T, C] kind
        partial,  # [nblocks, C] fp32, out
        rows_per_block,
    ):
        num_rows = probs.shape[0]
        num_cols = probs.shape[1]
        b = cuda.blockIdx.x
        r0 = b * rows_per_block
        r1 = min(num_rows, r0 + rows_per_block)
        # Thread t owns columns t, t + threads, ...: each row read is coalesced.
        for c in range(cuda.threadIdx.x, num_cols, cuda.blockDim.x):
            acc = _ZERO
            for r in range(r0, r1):  # fixed order: deterministic
                acc += load(probs, r, c)
            partial[b, c] = acc

    return kernel


@functools.cache
def _aux_loss_final_kernel(tpe_kind: str, out_kind: str):
    load_tpe = loader1(tpe_kind)
    store = storer1(out_kind)

    @cuda.jit
    def kernel(
        partial,  # [nblocks, C] fp32
        tokens_per_expert,  # [C] tpe_kind
        coeff,  # fp32 scalar: C
        loss,  # [1] out_kind, out
        saved_coeff,  # [1] fp32, out: C again, for the backward
    ):
        # One block; blockDim.x is a power of two <= _FINAL_THREADS_MAX.
        red = cuda.shared.array(_FINAL_THREADS_MAX, nb_f32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        nblocks = partial.shape[0]
        acc = _ZERO
        for c in range(tid, partial.shape[1], nthreads):
            col = _ZERO
            for b in range(nblocks):  # blocks in order
                col += partial[b, c]
            acc += np.float32(col * load_tpe(tokens_per_expert, c))
        red[tid] = acc
        # Barrier: the tree reads other threads' sums.
        cuda.syncthreads()
        width = nthreads // 2
        while width > 0:
            if tid < width:
                red[tid] = np.float32(red[tid] + red[tid + width])
            # Barrier: the next level reads this level's results.
            cuda.syncthreads()
            width //= 2
        if tid == 0:
            store(loss, 0, np.float32(coeff * red[0]))
            saved_coeff[0] = coeff

    return kernel


@functools.cache
def _aux_loss_bwd_kernel(tpe_kind: str, out_kind: str):
    load_tpe = loader1(tpe_kind)
    load_grad = loader1(out_kind)
    store = storer(out_kind)

    @cuda.jit
    def kernel(
        coeff,  # [1] fp32: C
        tokens_per_expert,  # [C] tpe_kind
        grad_loss,  # [1] out_kind
        grad_probs,  # [R, C] out_kind, out
    ):
        num_cols = grad_probs.shape[1]
        n = grad_probs.shape[0] * num_cols
        step = cuda.gridDim.x * cuda.blockDim.x
        c0 = coeff[0]
        g = load_grad(grad_loss, 0)
        # Grid-stride over the flattened [R, C] output: coalesced writes.
        for i in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, n, step):
            r = i // num_cols
            c = i - r * num_cols
            store(grad_probs, r, c, np.float32(np.float32(c0 * load_tpe(tokens_per_expert, c)) * g))

    return kernel


def moe_aux_loss_fwd(probs, tokens_per_expert, topk, coeff, total_num_tokens=None,
                     num_experts=None, *, out=None, stream=0):
    """Aux loss forward.

    Args:
      probs: (T, C) float32 | bfloat16 | float16; ``C % num_experts == 0``.
      tokens_per_expert: (C,) int32 | int64 | float32 | bfloat16.
      topk: K.
      coeff: the loss coefficient.
      total_num_tokens: T of the formula (default ``probs.shape[0]``; the
        global count when token-sharded).
      num_experts: E of the formula (default C).
      out: optional ``(loss, saved_coeff)`` device arrays of shape ().
      stream: numba stream or int CUDA stream handle.

    Returns:
      ``(loss () probs dtype, saved_coeff () float32)``; bit-identical run to run.
    """
    op = OP + "_fwd"
    s = L.resolve_stream(stream)
    d_probs, kind = L.device_input(probs, "probs", op, s, ndim=2)
    d_tpe, tpe_kind = L.device_input(tokens_per_expert, "tokens_per_expert", op, s,
                                     allow_int=True, ndim=1)
    if tpe_kind == L.F16:
        raise TypeError(f"{op}: tokens_per_expert must be int32, int64, float32 or bfloat16, "
                        "got float16.")
    num_rows, num_cols = (int(v) for v in d_probs.shape)
    if tuple(d_tpe.shape) != (num_cols,):
        raise ValueError(
            f"{op}: tokens_per_expert shape {tuple(d_tpe.shape)} must be ({num_cols},).")
    n_exp = num_cols if num_experts is None else int(num_experts)
    if n_exp < 1 or num_cols % n_exp:
        raise ValueError(f"{op}: probs columns ({num_cols}) must be a multiple of "
                         f"num_experts ({n_exp}).")
    total = num_rows if total_num_tokens is None else int(total_num_tokens)
    c_host = aux_loss_coeff(n_exp, coeff, int(topk), total)
    to_host = not L.any_on_device(probs, tokens_per_expert) and out is None
    plan = moe_aux_loss_fwd_plan(L.spec_of(d_probs.shape, kind), L.spec_for(d_tpe.shape, d_tpe.dtype),
                                 c_host)
    return L.execute(plan, [d_probs, d_tpe], out, s, to_host)


@functools.cache
def moe_aux_loss_fwd_plan(probs: L.Spec, tokens_per_expert: L.Spec, c: np.float32) -> L.Plan:
    """The launches of the forward (inputs: probs, tokens_per_expert; outputs: loss,
    saved_coeff; scratch: the per-block column partials). ``c`` is the fp32 C."""
    num_rows, num_cols = probs.shape
    outs = (L.spec_of((), probs.kind), L.spec_of((), L.F32))
    grid, threads, rows = L.reduction_tiling(max(num_rows, 1), num_cols)
    tmps = (L.spec_of((grid, num_cols), L.F32),)
    steps = (
        L.Step(_aux_loss_partial_kernel(probs.kind), grid, threads, 0, (L.In(0), L.Tmp(0), rows)),
        L.Step(_aux_loss_final_kernel(tokens_per_expert.kind, probs.kind), 1,
               L.final_threads(num_cols), 0,
               (L.Tmp(0), L.In(1), np.float32(c), L.Out(0, L.spec_of((1,), probs.kind)),
                L.Out(1, L.spec_of((1,), L.F32)))),
    )
    return L.Plan(OP + "_fwd", (probs, tokens_per_expert), outs, tmps, steps)


def moe_aux_loss_bwd(saved_coeff, tokens_per_expert, grad_loss, num_rows, *, out=None, stream=0):
    """Aux loss backward: ``grad_probs[r, c] = C * f32(tpe[c]) * f32(grad_loss)``.

    Args:
      saved_coeff: () float32 C from the forward (host scalar or device array).
      tokens_per_expert: (C,) int32 | int64 | float32 | bfloat16.
      grad_loss: () float32 | bfloat16 | float16 (host scalar or device array).
      num_rows: R, the rows of probs.
      out: optional device array for grad_probs.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_probs (R, C), dtype of grad_loss.
    """
    op = OP + "_bwd"
    s = L.resolve_stream(stream)
    d_coeff, ckind = L.scalar_input(saved_coeff, "saved_coeff", op, s)
    if ckind != L.F32:
        raise TypeError(f"{op}: saved_coeff must be float32, got {d_coeff.dtype}.")
    d_grad, kind = L.scalar_input(grad_loss, "grad_loss", op, s)
    d_tpe, tpe_kind = L.device_input(tokens_per_expert, "tokens_per_expert", op, s,
                                     allow_int=True, ndim=1)
    to_host = not L.any_on_device(saved_coeff, tokens_per_expert, grad_loss) and out is None
    plan = moe_aux_loss_bwd_plan(L.spec_for(d_tpe.shape, d_tpe.dtype), L.spec_of((), kind), int(num_rows))
    return L.execute(plan, [d_coeff, d_tpe, d_grad], out, s, to_host)[0]


@functools.cache
def moe_aux_loss_bwd_plan(tokens_per_expert: L.Spec, grad_loss: L.Spec, num_rows: int) -> L.Plan:
    """The launches of the backward (inputs: saved_coeff, tokens_per_expert,
    grad_loss; output: grad_probs [num_rows, C] in grad_loss's kind)."""
    num_cols = tokens_per_expert.shape[0]
    kind = grad_loss.kind
    ins = (L.spec_of((), L.F32), tokens_per_expert, grad_loss)
    outs = (L.spec_of((num_rows, num_cols), kind),)
    if num_rows == 0 or num_cols == 0:
        return L.Plan(OP + "_bwd", ins, outs)
    grid, threads = L.elementwise_tiling(num_rows * num_cols)
    step = L.Step(_aux_loss_bwd_kernel(tokens_per_expert.kind, kind), grid, threads, 0,
                  (L.In(0, L.spec_of((1,), L.F32)), L.In(1), L.In(2, L.spec_of((1,), kind)), L.Out(0)))
    return L.Plan(OP + "_bwd", ins, outs, (), (step,))
