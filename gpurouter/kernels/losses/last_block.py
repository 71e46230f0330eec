"""The z-loss vector forward's single-kernel finish (``z_loss_vec.py``): each
block's thread 0, its partial sum written, takes a ticket, an increment of a
``_plan.Counter`` (zero when the kernel starts) that wraps back to zero at the
grid's last block; the block that gets the last ticket sums every partial in
a fixed order and writes the loss.  One launch in all, instead of a second,
one-block launch (lab/journal/benchmarks.md has what each costs).

- ``load_l2(a, i)``: ``ld.global.cg.f32`` (the partials other blocks wrote,
  never through a stale L1 line);
- ``ticket_inc(count, last)``: ``atom.acq_rel.gpu.global.inc.u32``;
- ``finish_pieces(mode, full)``: the ticket and the fixed-order sum;
- ``z_loss_final_kernel``: the unit kernels' second launch, one block
  (``z_loss_final_masked_kernel``: N read from a device ``[1]``;
  ``z_loss_final_counted_kernel``: N the masked rows kernel counted).

On the simulator plain loads and ``cuda.atomic.inc`` (blocks run one at a time
there, the last block last).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types

from .._base.device import ZERO
from .._base.launch import simulator_enabled
from .tiling import Z_LOSS_TILING
from .z_io import lane_reducers

# Shared-array sizes must be compile-time constants (a module global is frozen as one)
_FINAL_WORDS = Z_LOSS_TILING.final_threads

#: the finish: "acq_rel" (one acquire-release ``atom.inc``), "fence" (``membar.gl``,
#: ``atomic.inc``, ``membar.gl``), or "none" (no finish, the loss unwritten: only
#: for timing the rows alone, ``tools/probes/z_loss_probe.py``)
FINISH = "acq_rel"


@functools.cache
def load_l2():
    """``load_l2(a, i)``: fp32 ``a[i]`` read from L2 (``ld.global.cg``: no L1 line
    that might predate another block's write; the single-kernel finish reads
    the partial sums the other blocks wrote); on the simulator ``a[i]``."""
    if simulator_enabled():

        @cuda.jit(device=True)
        def load_sim(a, i):
            return a[i]

        return load_sim
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    f32, i64 = ir.FloatType(), ir.IntType(64)

    @intrinsic
    def ld_cg(typingctx, a, i):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            ptr = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.int64)])
            fnty = ir.FunctionType(f32, [i64])
            text = "{ .reg .u64 g; cvta.to.global.u64 g, $1; ld.global.cg.f32 $0, [g]; }"
            return builder.call(ir.InlineAsm(fnty, text, "=f,l", side_effect=True), [builder.ptrtoint(ptr, i64)])

        return types.float32(a, i), codegen

    return ld_cg


@functools.cache
def ticket_inc():
    """``ticket_inc(count, last) -> old``: ``atomic.inc`` of ``count[0]`` (wrapping
    to 0 past ``last``) with release and acquire semantics at GPU scope, one
    ``atom.acq_rel.gpu.global.inc.u32`` (the thread's earlier writes are seen
    by whoever sees the increment, its later reads see what the earlier
    incrementers wrote): the fences of the single-kernel finish without two
    ``membar.gl``.  On the simulator ``cuda.atomic.inc`` (launches run one block
    at a time there)."""
    if simulator_enabled():

        @cuda.jit(device=True)
        def inc_sim(count, last):
            return cuda.atomic.inc(count, 0, last)

        return inc_sim
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    i32, i64 = ir.IntType(32), ir.IntType(64)

    @intrinsic
    def inc_acq_rel(typingctx, count, last):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            fnty = ir.FunctionType(i32, [i64, i32])
            text = "{ .reg .u64 g; cvta.to.global.u64 g, $1; atom.acq_rel.gpu.global.inc.u32 $0, [g], $2; }"
            val = context.cast(builder, args[1], sig.args[1], types.uint32)
            return builder.call(ir.InlineAsm(fnty, text, "=r,l,r", side_effect=True),
                                [builder.ptrtoint(data, i64), val])

        return types.uint32(count, last), codegen

    return inc_acq_rel


@functools.cache
def finish_pieces(mode: str, full: bool):
    """``(ticket(count), finish(partial, loss, red, tid, nthreads, coeff, total))``:
    the forward's single-kernel finish (``mode``: ``FINISH``; ``full``: blockDim.x
    a multiple of 32)."""
    rd = load_l2()
    inc = ticket_inc()
    _, warp_sum = lane_reducers(32, True)

    @cuda.jit(device=True)
    def ticket(count):
        """Thread 0 of a block, its partial written: 1.0 if the block is the grid's
        last to get here, else 0.0.  The increment wraps at the last block, so
        the counter is 0 again when the kernel ends (``_plan.Counter``)."""
        last = np.uint32(cuda.gridDim.x - 1)
        if mode == "none":
            return ZERO
        if mode == "fence":
            # Fence: the block's partial is visible to the whole GPU before its ticket.
            cuda.threadfence()
            if cuda.atomic.inc(count, 0, last) == last:
                # Fence: the last block's reads of the partials come after its ticket.
                cuda.threadfence()
                return np.float32(1)
            return ZERO
        if inc(count, last) == last:  # release: the partial before the ticket; acquire: the reads after
            return np.float32(1)
        return ZERO

    @cuda.jit(device=True)
    def finish(partial, loss, red, tid, nthreads, coeff, total):
        """The last block: ``loss = coeff * (S / N)``, S the grid's partials in a
        fixed order whatever block is last (bit-identical run to run): thread i
        sums partials i, i + n, ... in turn; then, ``full``: each warp's 32 in
        the pairwise tree of lane order (``lane_reducers``), thread 0 the warps'
        in order; else a fixed-shape tree of the n threads (pairs r, r + ceil(k/2))."""
        acc = ZERO
        for i in range(tid, cuda.gridDim.x, nthreads):
            acc = np.float32(acc + rd(partial, i))
        if full:
            first = np.int32(tid & np.int32(-32))
            acc = warp_sum(acc, red, tid, first, np.uint32(0xFFFFFFFF))
            if tid == first:
                red[nthreads + (tid >> 5)] = acc
            # Barrier: thread 0 reads every warp's sum.
            cuda.syncthreads()
            if tid == 0:
                s = ZERO
                for i in range(nthreads >> 5):
                    s = np.float32(s + red[nthreads + i])
                loss[0] = np.float32(coeff * np.float32(s / total))
            return
        red[tid] = acc
        k = nthreads
        while k > 1:
            # Barrier: this level reads the previous level's sums.
            cuda.syncthreads()
            half = np.int32((k + 1) // 2)
            if tid < k - half:
                red[tid] = np.float32(red[tid] + red[tid + half])
            k = half
        if tid == 0:  # the last level's sum is thread 0's own (no barrier needed)
            loss[0] = np.float32(coeff * np.float32(red[0] / total))

    return ticket, finish


# The unit kernels' (``z_loss.py``) second launch: one block sums the partials.


@cuda.jit(device=True)
def _final(partial, loss, nparts, coeff, total, red):  # red: the kernel's [_FINAL_WORDS] fp32 shared array
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    acc = ZERO
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


@cuda.jit
def z_loss_final_kernel(partial, loss, nparts, coeff, total):  # [>= nparts], [1] out, ., fp32, fp32 N
    """One block (a power of two of threads): thread i sums partials i, i + n,
    ... in order, a halving tree combines the threads; ``coeff * (S / N)``."""
    red = cuda.shared.array(_FINAL_WORDS, nb_f32)
    _final(partial, loss, nparts, coeff, total, red)


@cuda.jit
def z_loss_final_masked_kernel(partial, loss, nparts, coeff, n):  # as above, n: [1] fp32 N on the device
    """``z_loss_final_kernel`` with N read from the device (the masked plans)."""
    red = cuda.shared.array(_FINAL_WORDS, nb_f32)
    _final(partial, loss, nparts, coeff, n[0], red)


@cuda.jit
def z_loss_final_counted_kernel(partial, loss, nparts, coeff, count, n):  # count: [1] uint32 Counter; n: [1] out
    """``z_loss_final_kernel`` with N = max(valid rows, 1) taken from ``count[0]``
    (what the masked rows kernel added; left 0 for the next launch) and
    written to ``n`` (the backward's N)."""
    if cuda.threadIdx.x == 0:
        n[0] = np.float32(max(cuda.atomic.exch(count, 0, np.uint32(0)), np.uint32(1)))
    # Barrier: every thread reads N (the previous launch's adds are complete: a kernel boundary).
    cuda.syncthreads()
    red = cuda.shared.array(_FINAL_WORDS, nb_f32)
    _final(partial, loss, nparts, coeff, n[0], red)
