"""Switch load-balancing aux loss: Numba-CUDA kernels and launchers (docs/contract.md section 4).

``C = num_experts * coeff / (topk * T * T)`` (fp32, host, in that order) and
``loss = C * sum_c (sum_r probs[r, c]) * tokens_per_expert[c]``.

Deterministic by construction (≠TE, which uses float atomics): one kernel; each block
(``tiling.column_tiling``) writes one fp32 partial, the sum over its rows of ``probs[r, c] *
tokens_per_expert[c]`` (row lanes x column lanes, each summing its rows of a column or column
quad with several loads in flight, ``column_sums.py``, times the column's count; a fixed tree
over the block), and takes a ticket (``last_block.ticket``: a ``_plan.Counter`` increment that
wraps to zero at the last block); the last block adds every partial in a fixed order, times C.
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)
from .._base.parallel import recipe

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32  # array declarations take numba types

from ..._host import aux_loss_coeff
from .._base.access import array_views, loader_1d, quad_words, storer_1d
from .._base.device import ZERO
from .._base.launch import BF16, F16, F32, any_on_device, device_input, kernel_jit, resolve_stream, scalar_input
from .._base.plan import Counter, In, Out, Plan, Spec, Step, Tmp, execute, spec_for, spec_of
from .aux_loss_bwd import aux_loss_bwd_kernel, aux_loss_bwd_quad_kernel, staged_fill, staged_flag_bytes
from .column_sums import block_tree_sum, block_tree_sum2, lane_column_sum, lane_quad_sum
from .last_block import finish_pieces, load_l2
from .masks import mask_input, mask_spec
from .tiling import AUX_LOSS_TILING, AuxLossTiling, column_tiling, fill_tiling

OP = "moe_aux_loss"

# The shared array's size must be a compile-time constant: numba freezes module
# globals as constants, but types ``AUX_LOSS_TILING.column_threads`` (an attribute)
# as a plain int64, which cuda.shared.array rejects on the GPU (the
# simulator accepts anything).
_RED_WORDS = AUX_LOSS_TILING.column_threads
#: the probs' kinds whose forward sums column quads when C % 4 == 0 (a load a quad: fp32 16 bytes,
#: bf16 and fp16 8, as uint64 words; bf16 since 2026-11-28, fp16 since 2026-11-29, an element a
#: load before)
QUAD_KINDS = (F32, BF16, F16)
#: the register cap (``kernel_jit``) of the bf16, fp16 and masked forwards: without one, ptxas kept
#: one load in flight where four were written (docs/kernels.md, "The aux loss forward's register cap")
FWD_MAX_REGISTERS = 64


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def aux_loss_fwd_kernel(kind: str, tpe_kind: str, out_kind: str, quads: bool = False, has_mask: bool = False,
                        count_valid: bool = False):
    """The forward; ``quads``: probs with C % 4 == 0, seen flat (bf16 and fp16 as
    uint64 words), a column quad per column lane (``lane_quad_sum``), else an element
    per column lane.
    ``has_mask`` (compile-time): the kernel takes ``mask`` (bool ``[T]``, the
    valid rows) and ``n`` (fp32 ``[1]``, the device count T) after
    ``tokens_per_expert``; the masked rows add nothing (each row's mask byte
    loaded with the row's values, a bitwise select: ``column_sums``) and
    ``coeff`` is the partial ``f32(E coeff) / K``, divided by T twice in the
    last block (C in ``aux_loss_coeff``'s order); without it the kernel is the
    unmasked one, its C a constant.  ``count_valid`` (with ``has_mask``): T is
    ``max(valid rows, 1)``, counted here (``n`` is not read): each block's
    count is added to word 1 of the ``Counter`` (integer atomics: any order
    gives the same count) before its ticket, and the last block takes it and
    leaves it 0."""
    column_sum = lane_column_sum(kind, has_mask)
    quad_sum = lane_quad_sum(has_mask, kind)
    regs = FWD_MAX_REGISTERS if kind != F32 or has_mask else 0  # fp32 unmasked: the same SASS uncapped
    load_tpe = loader_1d(tpe_kind)
    store = storer_1d(out_kind)
    ticket = finish_pieces("acq_rel", False)[0]  # one acquire-release atom.inc (not the z-loss probe's knob)
    load_partial = load_l2()
    count_words = _RED_WORDS if count_valid else 1  # a compile-time constant (shared array sizes must be)

    @cuda.jit(device=True)
    def run(probs, num_rows, num_cols, tokens_per_expert, mask, partial, count, coeff, loss, saved_coeff,
            rows_per_block, col_lanes, red, last, t, red2):
        # Thread (rl, cl): its row lane's sum of each of its columns, times
        # that column's count, added over its columns; the block's tree; the
        # partial and a ticket; the last block adds every partial in a fixed order.
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        nrl = nthreads // col_lanes
        rl = tid // col_lanes
        cl = tid - rl * col_lanes
        b = cuda.blockIdx.x
        r0 = b * rows_per_block
        r1 = min(num_rows, r0 + rows_per_block)
        total = ZERO
        k = ZERO  # (count_valid) the thread's valid rows
        if count_valid:  # the block's valid rows, their loads before the sums' (in flight with them)
            r = r0 + tid
            while r < r1:
                if mask[r]:
                    k += np.float32(1)
                r += nthreads
        if quads:
            eq = num_cols // 4
            cq = cl
            while cq < eq:
                s0, s1, s2, s3 = quad_sum(probs, r0, r1, cq, eq, rl, nrl, mask)
                c = 4 * cq
                total += np.float32(s0 * load_tpe(tokens_per_expert, c))
                total += np.float32(s1 * load_tpe(tokens_per_expert, c + 1))
                total += np.float32(s2 * load_tpe(tokens_per_expert, c + 2))
                total += np.float32(s3 * load_tpe(tokens_per_expert, c + 3))
                cq += col_lanes
        else:
            c = cl
            while c < num_cols:
                total += np.float32(column_sum(probs, r0, r1, c, rl, nrl, mask)
                                    * load_tpe(tokens_per_expert, c))
                c += col_lanes
        red[tid] = total
        if count_valid:  # the block's valid rows too: exact integers in fp32, the same tree
            red2[tid] = k
            block_tree_sum2(red, red2, tid, nthreads)
        else:
            block_tree_sum(red, tid, nthreads)
        if tid == 0:
            partial[b] = red[0]
            if count_valid:
                cuda.atomic.add(count, 1, np.uint32(red2[0]))  # before the ticket (its release)
            last[0] = ticket(count)
        # Barrier: every thread reads the flag (block-uniform below).
        cuda.syncthreads()
        if last[0] != ZERO:
            acc = ZERO
            i = tid
            while i < cuda.gridDim.x:
                acc += load_partial(partial, i)
                i += nthreads
            red[tid] = acc
            block_tree_sum(red, tid, nthreads)
            if tid == 0:
                c = coeff
                if has_mask:
                    if count_valid:  # every block's count is in (the ticket's acquire); leave the word 0
                        t = np.float32(max(cuda.atomic.exch(count, 1, np.uint32(0)), np.uint32(1)))
                    c = np.float32(np.float32(coeff / t) / t)  # aux_loss_coeff's order, on the device
                store(loss, 0, np.float32(c * red[0]))
                saved_coeff[0] = c

    if has_mask:

        @kernel_jit(regs)
        def aux_loss_fwd_masked(
            probs,  # [T, C] kind (``quads``: flat [T*C] fp32)
            num_rows,
            num_cols,
            tokens_per_expert,  # [C] tpe_kind
            mask,  # [T] bool: the valid rows
            n,  # [1] fp32: T of C (the valid count, or the caller's)
            partial,  # [nblocks] fp32, scratch
            count,  # [2] uint32 (``_plan.Counter``): the ticket, the valid rows (count_valid)
            coeff,  # fp32 scalar: f32(E coeff) / K
            loss,  # [1] out_kind, out
            saved_coeff,  # [1] fp32, out: C, for the backward
            rows_per_block,
            col_lanes,
        ):
            red = cuda.shared.array(_RED_WORDS, nb_f32)
            last = cuda.shared.array(1, nb_f32)
            red2 = cuda.shared.array(count_words, nb_f32)  # the counts' tree
            t = np.float32(1) if count_valid else np.float32(n[0])  # count_valid: n is never read
            run(probs, num_rows, num_cols, tokens_per_expert, mask, partial, count, coeff, loss, saved_coeff,
                rows_per_block, col_lanes, red, last, t, red2)

        return aux_loss_fwd_masked

    @kernel_jit(regs)
    def aux_loss_fwd(
        probs,  # [T, C] kind (``quads``: flat [T*C] fp32)
        num_rows,
        num_cols,
        tokens_per_expert,  # [C] tpe_kind
        partial,  # [nblocks] fp32, scratch: sum of probs[r, c] * tpe[c] over block b's rows, all c
        count,  # [1] uint32 (``_plan.Counter``): zero whenever no launch runs
        coeff,  # fp32 scalar: C
        loss,  # [1] out_kind, out
        saved_coeff,  # [1] fp32, out: C again, for the backward
        rows_per_block,
        col_lanes,  # CL; blockDim.x == RL * CL
    ):
        red = cuda.shared.array(_RED_WORDS, nb_f32)
        last = cuda.shared.array(1, nb_f32)
        # ``mask``: never read without has_mask (tokens_per_expert stands in for it)
        run(probs, num_rows, num_cols, tokens_per_expert, tokens_per_expert, partial, count, coeff, loss,
            saved_coeff, rows_per_block, col_lanes, red, last, coeff, red)

    return aux_loss_fwd


def moe_aux_loss_fwd(probs, tokens_per_expert, topk, coeff, total_num_tokens=None,
                     num_experts=None, *, token_mask=None, tiling=None, out=None, stream=0):
    """Aux loss forward.

    Args:
      probs: (T, C) float32 | bfloat16 | float16; ``C % num_experts == 0``.
      tokens_per_expert: (C,) int32 | int64 | float32 | bfloat16.
      topk: K.
      coeff: the loss coefficient.
      total_num_tokens: T of the formula (default ``probs.shape[0]``; the
        global count when token-sharded).
      num_experts: E of the formula (default C).
      token_mask: None, or (T,) bool | uint8 (nonzero: a valid row): the
        masked rows are left out of the column sums, T defaults to
        ``max(valid count, 1)`` (counted by the kernel) and may be a device
        scalar (``masks.mask_input``); C is then computed on the device, in
        ``aux_loss_coeff``'s order.
      tiling: an ``AuxLossTiling`` (None: the library's).
      out: optional ``(loss, saved_coeff)`` device arrays of shape ().
      stream: numba stream or int CUDA stream handle.

    Returns:
      ``(loss () probs dtype, saved_coeff () float32)``; bit-identical run to run.
    """
    op = OP + "_fwd"
    s = resolve_stream(stream)
    d_probs, kind = device_input(probs, "probs", op, s, ndim=2)
    d_tpe, tpe_kind = device_input(tokens_per_expert, "tokens_per_expert", op, s,
                                     allow_int=True, ndim=1)
    if tpe_kind == F16:
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
    if token_mask is not None:
        counted = total_num_tokens is None  # the kernel counts the valid rows
        d_mask, d_n = mask_input(token_mask, op, s, num_rows, 1 if counted else total_num_tokens)
        to_host = not any_on_device(probs, tokens_per_expert, token_mask, total_num_tokens) and out is None
        plan = moe_aux_loss_fwd_plan(spec_of(d_probs.shape, kind), spec_for(d_tpe.shape, d_tpe.dtype),
                                     aux_loss_partial_coeff(n_exp, coeff, int(topk)), tiling, True, counted)
        return execute(plan, [d_probs, d_tpe, d_mask] + ([] if counted else [d_n]), out, s, to_host)
    total = num_rows if total_num_tokens is None else int(total_num_tokens)
    c_host = aux_loss_coeff(n_exp, coeff, int(topk), total)
    to_host = not any_on_device(probs, tokens_per_expert) and out is None
    plan = moe_aux_loss_fwd_plan(spec_of(d_probs.shape, kind), spec_for(d_tpe.shape, d_tpe.dtype),
                                 c_host, tiling)
    return execute(plan, [d_probs, d_tpe], out, s, to_host)


def aux_loss_partial_coeff(num_experts, coeff, topk) -> np.float32:
    """``f32(f32(E) * f32(coeff)) / f32(K)``: C before its two divisions by T
    (``aux_loss_coeff``'s first steps; the masked kernel divides on the device)."""
    f = np.float32
    return f(f(f(num_experts) * f(coeff)) / f(topk))


@functools.cache
def moe_aux_loss_fwd_plan(probs: Spec, tokens_per_expert: Spec, c: np.float32,
                          tiling: AuxLossTiling | None = None, has_mask: bool = False,
                          count_valid: bool = False) -> Plan:
    """The launches of the forward (inputs: probs, tokens_per_expert; outputs: loss,
    saved_coeff; scratch: the per-block partials). ``c`` is the fp32 C; ``tiling``:
    an ``AuxLossTiling`` (None: the library's). ``has_mask``: two more inputs,
    the mask (bool ``[T]``) and T (fp32 ``()``), and ``c`` is
    ``aux_loss_partial_coeff`` (C before its divisions by T); ``count_valid``
    (with ``has_mask``): the mask alone, T = max(valid rows, 1) counted by the
    kernel."""
    tiling = tiling or AUX_LOSS_TILING
    num_rows, num_cols = probs.shape
    outs = (spec_of((), probs.kind), spec_of((), F32))
    quads = probs.kind in QUAD_KINDS and num_cols % 4 == 0
    grid, threads, cl, rows = column_tiling(num_rows, num_cols // 4 if quads else num_cols, tiling)
    tmps = (spec_of((grid,), F32),)
    src = In(0, quad_words(probs.kind, (num_rows, num_cols))) if quads else In(0)
    ins = (probs, tokens_per_expert)
    masked = ()
    flag = ()  # the unmasked kernel's cache key as before
    if count_valid and not has_mask:
        raise ValueError(f"{OP}_fwd_plan: count_valid needs has_mask.")
    if has_mask:
        ins += (mask_spec(num_rows),) + (() if count_valid else (spec_of((), F32),))
        masked = (In(2), Tmp(0) if count_valid else In(3, spec_of((1,), F32)))  # count_valid: n never read
        flag = (True, count_valid)
    kern = aux_loss_fwd_kernel(probs.kind, tokens_per_expert.kind, probs.kind, quads, *flag)
    steps = (Step(kern, grid, threads, 0,
                  (src, num_rows, num_cols, In(1), *masked, Tmp(0), Counter(2 if has_mask else 1), np.float32(c),
                   Out(0, spec_of((1,), probs.kind)), Out(1, spec_of((1,), F32)), rows, cl)),)
    return Plan(OP + "_fwd", ins, outs, tmps, steps)


def moe_aux_loss_bwd(saved_coeff, tokens_per_expert, grad_loss, num_rows, *, token_mask=None, tiling=None,
                     out=None, stream=0):
    """Aux loss backward: ``grad_probs[r, c] = C * f32(tpe[c]) * f32(grad_loss)``.

    Args:
      saved_coeff: () float32 C from the forward (host scalar or device array).
      tokens_per_expert: (C,) int32 | int64 | float32 | bfloat16.
      grad_loss: () float32 | bfloat16 | float16 (host scalar or device array).
      num_rows: R, the rows of probs.
      token_mask: None, or (R,) bool | uint8, the forward's: its False (zero)
        rows get 0.
      tiling: an ``AuxLossTiling`` (None: the library's).
      out: optional device array for grad_probs.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_probs (R, C), dtype of grad_loss.
    """
    op = OP + "_bwd"
    s = resolve_stream(stream)
    d_coeff, ckind = scalar_input(saved_coeff, "saved_coeff", op, s)
    if ckind != F32:
        raise TypeError(f"{op}: saved_coeff must be float32, got {d_coeff.dtype}.")
    d_grad, kind = scalar_input(grad_loss, "grad_loss", op, s)
    d_tpe, tpe_kind = device_input(tokens_per_expert, "tokens_per_expert", op, s,
                                     allow_int=True, ndim=1)
    ins = [d_coeff, d_tpe, d_grad]
    if token_mask is not None:
        ins.append(mask_input(token_mask, op, s, int(num_rows), 1)[0])
    to_host = not any_on_device(saved_coeff, tokens_per_expert, grad_loss, token_mask) and out is None
    plan = moe_aux_loss_bwd_plan(spec_for(d_tpe.shape, d_tpe.dtype), spec_of((), kind), int(num_rows), tiling,
                                 token_mask is not None)
    return execute(plan, ins, out, s, to_host)[0]


@functools.cache
def moe_aux_loss_bwd_plan(tokens_per_expert: Spec, grad_loss: Spec, num_rows: int,
                          tiling: AuxLossTiling | None = None, has_mask: bool = False) -> Plan:
    """The launches of the backward (inputs: saved_coeff, tokens_per_expert,
    grad_loss, and with ``has_mask`` the mask (bool ``[num_rows]``); output:
    grad_probs [num_rows, C] in grad_loss's kind, 0 on the masked rows);
    ``tiling``: an ``AuxLossTiling`` (None: the library's)."""
    tiling = tiling or AUX_LOSS_TILING
    num_cols = tokens_per_expert.shape[0]
    kind = grad_loss.kind
    ins = (spec_of((), F32), tokens_per_expert, grad_loss) + ((mask_spec(num_rows),) if has_mask else ())
    outs = (spec_of((num_rows, num_cols), kind),)
    flag = (True,) if has_mask else ()  # the unmasked kernels' cache keys as before
    mask = (In(3),) if has_mask else ()
    if num_rows == 0 or num_cols == 0:
        return Plan(OP + "_bwd", ins, outs)
    if num_cols % 4 == 0:  # a quad of columns per store
        grid, threads, cl = fill_tiling(num_rows, num_cols // 4, tiling)
        words = array_views(kind, (num_rows, num_cols))[0]
        shared = 0
        if has_mask and staged_fill(kind):  # the rows' staged flags, at most mask_stage_bytes a block:
            # more blocks where T needs it
            while staged_flag_bytes(num_rows, grid, threads // cl) > max(tiling.mask_stage_bytes, threads // cl):
                grid *= 2
            shared = staged_flag_bytes(num_rows, grid, threads // cl)
        step = Step(aux_loss_bwd_quad_kernel(tokens_per_expert.kind, kind, *flag), grid, threads, shared,
                      (In(0, spec_of((1,), F32)), In(1), In(2, spec_of((1,), kind)),
                       Out(0, words), num_rows, num_cols, *mask, cl))
        return Plan(OP + "_bwd", ins, outs, (), (step,))
    grid, threads, cl, rows = column_tiling(num_rows, num_cols, tiling)
    step = Step(aux_loss_bwd_kernel(tokens_per_expert.kind, kind, *flag), 2 * grid, threads, 0,
                  (In(0, spec_of((1,), F32)), In(1), In(2, spec_of((1,), kind)), Out(0), *mask,
                   -(-num_rows // (2 * grid)), cl))
    return Plan(OP + "_bwd", ins, outs, (), (step,))
