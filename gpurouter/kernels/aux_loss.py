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
        coeff,  # [1] fp32: C
        loss,  # [1] out_kind, out
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
            store(loss, 0, np.float32(coeff[0] * red[0]))

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
    outs = L.outs_tuple(out, 2, op)
    d_loss = L.output((), kind, outs[0], "loss", op, s)
    d_coeff, _ = L.scalar_input(np.asarray(c_host, np.float32), "coeff", op, s)
    if outs[1] is not None:
        d_saved = L.output((), np.float32, outs[1], "saved_coeff", op, s)
        L.copy_device(d_coeff, d_saved.reshape((1,)), s)
        d_coeff = d_saved.reshape((1,))
    grid, threads, rows = L.reduction_tiling(max(num_rows, 1), num_cols)
    d_partial = L.output((grid, num_cols), np.float32, None, "partial", op, s)
    L.launch(_aux_loss_partial_kernel(kind), grid, threads, s, 0, d_probs, d_partial, rows)
    L.launch(_aux_loss_final_kernel(tpe_kind, kind), 1, L.final_threads(num_cols), s, 0,
             d_partial, d_tpe, d_coeff, d_loss.reshape((1,)))
    if to_host:
        (loss,) = L.finish((d_loss,), (kind,), True, s)
        return loss, np.asarray(c_host, np.float32)
    return d_loss, d_coeff.reshape(())


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
    num_cols = int(d_tpe.shape[0])
    shape = (int(num_rows), num_cols)
    to_host = not L.any_on_device(saved_coeff, tokens_per_expert, grad_loss) and out is None
    if shape[0] == 0 or num_cols == 0:
        return L.empty_outputs([(shape, kind)], to_host, out, op, s)[0]
    d_out = L.output(shape, kind, L.outs_tuple(out, 1, op)[0], "grad_probs", op, s)
    grid, threads = L.elementwise_tiling(shape[0] * num_cols)
    L.launch(_aux_loss_bwd_kernel(tpe_kind, kind), grid, threads, s, 0,
             d_coeff, d_tpe, d_grad, d_out)
    return L.finish((d_out,), (kind,), to_host, s)[0]
