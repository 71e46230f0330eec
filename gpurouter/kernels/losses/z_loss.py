"""Router z-loss (ST-MoE): Numba-CUDA kernels and launchers.

``lse_t = logsumexp_e(logits[t])`` in fp32 (0 for a row of all ``-inf``: it adds
nothing and gets no gradient; NaN for a row with a NaN) and
``loss = coeff * (sum_t lse_t^2 / N)`` with ``N = total_num_tokens`` (the global
token count under sharding; default T).  The reference is
``gpurouter.reference.router_z_loss``.

Rows of whole 16-byte vectors (bf16 and fp16 ``E % 8 == 0``, fp32 ``E % 4 == 0``, up to
``ZLossTiling.vec_max_hold`` vectors a lane) take the kernels of ``z_loss_vec.py``;
the others these *unit* kernels (``tiling.z_loss_tiling``): a row's experts
cut into units of four (a quad seen flat through ``_base/access.array_views`` when
``E % 4 == 0``, else four masked element loads), W lanes a row, lane ``l``
taking units ``l, l + W, ...``, ``ZLossTiling.hold`` of them a step, all loads issued
before any use (indices clamped into the row, values past it ignored).

Forward, kernel 1 (a block of TB rows x W lanes): each lane keeps an online
``(max m, sum s of exp(x - m))`` (one rescale a step); a fixed-pairing tree in
shared memory combines the lanes; lane 0 writes ``lse``; thread 0 sums the
block's TB squares in a fixed tree into ``partial[b]`` (plan scratch).  Kernel
2 (one block): a fixed-shape tree of the partials, ``loss = coeff * (S / N)``
(the vector forward: its last block does it, ``z_loss_vec.py``).  Every order
fixed: bit-identical run to run.

The forward saves ``(m_t, log2 s_t)`` per row (``[2T]``: the maxima, then the
log sums), not ``lse_t``.  Backward: elementwise, ``grad[t, e] = (g * 2 coeff
/ N) lse_t exp(x - lse_t)`` with ``lse_t = m_t + ln s_t`` and ``exp(x -
lse_t) = 2^((x - m_t) log2 e - log2 s_t)`` (accurate at any logit magnitude;
0 on a dead row), the same lanes and units.  No warp intrinsics (the
simulator runs the same kernels).  ``exp(x - m)`` is ``2^((x - m) log2 e)``,
one ``ex2.approx`` (``logsumexp``).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools
import math

import numpy as np
from numba import cuda

from .._base.access import array_views
from .._base.launch import F32, any_on_device, device_input, resolve_stream, scalar_input
from .._base.plan import Counter, In, Out, Plan, Ref, Spec, Step, Tmp, execute, spec_of
from . import last_block as _z_loss_finish
from .last_block import z_loss_final_counted_kernel, z_loss_final_kernel, z_loss_final_masked_kernel
from .masks import mask_input, mask_spec
from .tiling import Z_LOSS_TILING, ZLossTiling, pow2_at_least, z_loss_tiling, z_loss_vec_tiling
from .z_loss_unit import z_loss_bwd_kernel, z_loss_rows_kernel
from .z_loss_vec import word_view, z_loss_vec_bwd_kernel, z_loss_vec_rows_kernel

OP = "router_z_loss"



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


def _host_number(total_num_tokens):
    """A Python or NumPy number, checked as the unmasked launches check it;
    None for an array (a device scalar, or a traced value the callback
    transport brings over: used as it is, contract section 10)."""
    if isinstance(total_num_tokens, (int, float, np.integer, np.floating)):
        return total_num_tokens
    return None


def _logits_input(logits, op: str, stream):
    d, kind = device_input(logits, "logits", op, stream, ndim=2)
    if int(d.shape[1]) < 1:
        raise ValueError(f"{op}: num_experts (logits.shape[-1] = 0) must be >= 1.")
    return d, kind


def _logits_arg(logits: Spec, quads: bool) -> Ref:
    """The logits as the kernels take them: flat quads (``array_views``) or 2-D."""
    return In(0, array_views(logits.kind, logits.shape)[0]) if quads else In(0)


def router_z_loss_fwd(logits, coeff, total_num_tokens=None, *, token_mask=None, return_count=False, tiling=None,
                      out=None, stream=0):
    """Router z-loss forward.

    Args:
      logits: (T, E) float32 | bfloat16 | float16, E >= 1, T >= 0.
      coeff: the loss coefficient (finite).
      total_num_tokens: N of ``coeff * sum_t lse_t^2 / N`` (default T, 1 when
        T == 0; the global count when token-sharded).
      token_mask: None, or (T,) bool | uint8 (nonzero: a valid row): the
        masked rows' squares are not added (their pairs are saved as any
        row's), N defaults to ``max(valid count, 1)`` (counted by the
        kernels) and may be a device scalar (``masks.mask_input``).
      return_count: with ``token_mask`` and no ``total_num_tokens``: a third
        output, the N the kernels counted (() float32).
      tiling: a ``ZLossTiling`` (None: the library's).
      out: optional ``(loss (), saved (2T,))`` float32 device arrays (and N (),
        counted: else one is allocated).
      stream: numba stream or int CUDA stream handle.

    Returns:
      ``(loss () float32, saved (2T,) float32)``: ``saved`` is each row's max
      ``m_t`` then its ``log2 s_t`` (``s_t = sum_e exp(x - m_t)``), what the
      backward reads; the loss bit-identical run to run.
    """
    op = OP + "_fwd"
    s = resolve_stream(stream)
    d, kind = _logits_input(logits, op, s)
    if token_mask is not None:
        c, _ = _static_args(op, int(d.shape[0]), coeff, _host_number(total_num_tokens))
        counted = total_num_tokens is None  # the kernels count the valid rows
        d_mask, d_n = mask_input(token_mask, op, s, int(d.shape[0]), 1 if counted else total_num_tokens)
        to_host = not any_on_device(logits, token_mask, total_num_tokens) and out is None
        plan = router_z_loss_fwd_plan(spec_of(d.shape, kind), c, 1, tiling, True, counted)
        if counted and out is not None and len(out) == 2:  # the counted N: a device array of its own
            out = (*out, cuda.device_array((), np.float32, stream=s))
        res = tuple(execute(plan, [d, d_mask] + ([] if counted else [d_n]), out, s, to_host))
        return res if return_count or not counted else res[:2]
    c, total = _static_args(op, int(d.shape[0]), coeff, total_num_tokens)
    to_host = not any_on_device(logits) and out is None
    plan = router_z_loss_fwd_plan(spec_of(d.shape, kind), c, total, tiling)
    return tuple(execute(plan, [d], out, s, to_host))


@functools.cache
def router_z_loss_fwd_plan(logits: Spec, coeff: np.float32, total_num_tokens: int,
                           tiling: ZLossTiling | None = None, has_mask: bool = False,
                           count_valid: bool = False) -> Plan:
    """The launches of the forward: input logits; outputs ``loss () f32``,
    ``saved (2T,) f32``; scratch: the per-block partial sums of ``lse^2``; ``tiling``: a ``ZLossTiling``.
    ``has_mask``: two more inputs, the mask (bool ``[T]``) and N (fp32 ``()``;
    ``total_num_tokens`` is then unused: pass 1); ``count_valid`` (with
    ``has_mask``): the mask alone, N = max(valid rows, 1) counted by the
    kernels and a third output, N (fp32 ``()``, for the backward)."""
    tiling = tiling or Z_LOSS_TILING
    num_tokens, num_experts = logits.shape
    if count_valid and not has_mask:
        raise ValueError(f"{OP}_fwd_plan: count_valid needs has_mask.")
    outs = (spec_of((), F32), spec_of((2 * num_tokens,), F32))
    ins = (logits,)
    flag = ()  # the unmasked kernels' cache keys as before
    if has_mask:
        ins += (mask_spec(num_tokens),) + (() if count_valid else (spec_of((), F32),))
        outs += (spec_of((), F32),) if count_valid else ()
        flag = (True, count_valid)
    n = Out(2, spec_of((1,), F32)) if count_valid else In(2, spec_of((1,), F32))
    counts = 0 if not count_valid else 1  # dynamic shared words: TB more with count_valid
    vec = z_loss_vec_tiling(num_tokens, num_experts, logits.dtype.itemsize, False, tiling)
    grid, threads, lanes, units, quads = z_loss_tiling(num_tokens, num_experts, tiling=tiling)
    steps = []
    if vec:  # one launch: the grid's last block sums the partials (a Counter tells it it is last)
        grid, threads, lanes, vecs, hold, iters = vec
        kern = z_loss_vec_rows_kernel(logits.kind, hold, lanes, *tiling.vec_fwd[3:], vecs == lanes * hold,
                                      threads % 32 == 0, _z_loss_finish.FINISH, *flag)  # exact rows, full warps
        head = (In(0, word_view(logits)), Out(1), Tmp(0), Out(0, spec_of((1,), F32)), Counter(2 if has_mask else 1))
        if has_mask:
            args = (*head, In(1), n, num_tokens, vecs, iters, np.float32(coeff))
        else:
            args = (*head, num_tokens, vecs, iters, np.float32(coeff), np.float32(total_num_tokens))
        steps.append(Step(kern, grid, threads, 4 * (threads + (1 + counts) * (threads // lanes) + 1), args))
        return Plan(OP + "_fwd", ins, outs, (spec_of((grid,), F32),), steps)
    count = Counter()  # the unit kernels' valid rows (count_valid): the rows kernel adds, the final one takes
    if grid:
        steps.append(Step(z_loss_rows_kernel(logits.kind, quads, tiling.hold, *flag), grid, threads,
                            4 * (2 * threads + (1 + counts) * (threads // lanes)),
                            (_logits_arg(logits, quads), Out(1), Tmp(0), *((In(1), count) if has_mask else ()),
                             num_tokens, num_experts, units, lanes)))
    tmps = (spec_of((max(grid, 1),), F32),)
    final = min(tiling.final_threads, pow2_at_least(max(grid, 1)))
    if count_valid:
        steps.append(Step(z_loss_final_counted_kernel, 1, final, 0,
                          (Tmp(0), Out(0, spec_of((1,), F32)), grid, np.float32(coeff), count, n)))
    elif has_mask:
        steps.append(Step(z_loss_final_masked_kernel, 1, final, 0,
                          (Tmp(0), Out(0, spec_of((1,), F32)), grid, np.float32(coeff), n)))
    else:
        steps.append(Step(z_loss_final_kernel, 1, final, 0,
                          (Tmp(0), Out(0, spec_of((1,), F32)), grid, np.float32(coeff),
                           np.float32(total_num_tokens))))
    return Plan(OP + "_fwd", ins, outs, tmps, steps)


def router_z_loss_bwd(logits, saved_lse, grad_loss, coeff, total_num_tokens=None, *, token_mask=None,
                      tiling=None, out=None, stream=0):
    """Router z-loss backward:
    ``grad_logits[t, e] = grad_loss * 2 coeff / N * lse_t * exp(logits[t, e] - lse_t)``.

    Args:
      logits: (T, E) float32 | bfloat16 | float16, as given to the forward.
      saved_lse: (2T,) float32, the forward's second output (each row's max, then log2 of its sum).
      grad_loss: () float32 (host scalar, Python float or device array).
      coeff, total_num_tokens, token_mask, tiling: as given to the forward
        (the masked rows get 0, whatever they hold).
      out: optional device array for grad_logits.
      stream: numba stream or int CUDA stream handle.

    Returns:
      grad_logits (T, E), dtype of logits (0 on an all -inf row).
    """
    op = OP + "_bwd"
    s = resolve_stream(stream)
    d, kind = _logits_input(logits, op, s)
    num_tokens = int(d.shape[0])
    d_lse, lse_kind = device_input(saved_lse, "saved_lse", op, s, ndim=1)
    if lse_kind != F32 or tuple(d_lse.shape) != (2 * num_tokens,):
        raise ValueError(f"{op}: saved_lse must be float32 of shape (2 * num_tokens,) = ({2 * num_tokens},), "
                         f"the forward's second output, got {tuple(d_lse.shape)} {d_lse.dtype}.")
    d_g, gkind = scalar_input(grad_loss, "grad_loss", op, s)
    if gkind != F32:
        raise TypeError(f"{op}: grad_loss must be float32, got {d_g.dtype}.")
    if token_mask is not None:
        c, _ = _static_args(op, num_tokens, coeff, _host_number(total_num_tokens))
        d_mask, d_n = mask_input(token_mask, op, s, num_tokens, total_num_tokens)
        to_host = not any_on_device(logits, saved_lse, grad_loss, token_mask, total_num_tokens) and out is None
        plan = router_z_loss_bwd_plan(spec_of(d.shape, kind), c, 1, tiling, True)
        return execute(plan, [d, d_lse, d_g, d_mask, d_n], out, s, to_host)[0]
    c, total = _static_args(op, num_tokens, coeff, total_num_tokens)
    to_host = not any_on_device(logits, saved_lse, grad_loss) and out is None
    plan = router_z_loss_bwd_plan(spec_of(d.shape, kind), c, total, tiling)
    return execute(plan, [d, d_lse, d_g], out, s, to_host)[0]


@functools.cache
def router_z_loss_bwd_plan(logits: Spec, coeff: np.float32, total_num_tokens: int,
                           tiling: ZLossTiling | None = None, has_mask: bool = False) -> Plan:
    """The launches of the backward: inputs logits, ``saved (2T,) f32``,
    ``grad_loss () f32``; output ``grad_logits`` (logits' shape and kind); ``tiling``: a ``ZLossTiling``.
    ``has_mask``: two more inputs, the mask (bool ``[T]``) and N (fp32 ``()``;
    ``total_num_tokens`` unused: pass 1); the masked rows get 0."""
    tiling = tiling or Z_LOSS_TILING
    num_tokens, num_experts = logits.shape
    ins = (logits, spec_of((2 * num_tokens,), F32), spec_of((), F32))
    if has_mask:
        ins += (mask_spec(num_tokens), spec_of((), F32))
    outs = (spec_of(logits.shape, logits.kind),)
    grid, threads, lanes, units, quads = z_loss_tiling(num_tokens, num_experts, backward=True, tiling=tiling)
    if not grid:
        return Plan(OP + "_bwd", ins, outs)
    flag = (True,) if has_mask else ()  # the unmasked kernels' cache keys as before
    masked = (In(3), In(4, spec_of((1,), F32))) if has_mask else ()
    # 2 coeff / N in fp32, in that order (the reference: coeff * (S / N), d/d lse_t: 2 lse_t); masked: the
    # kernel takes coeff and does the same on the device
    scale = np.float32(coeff) if has_mask else np.float32(
        np.float32(np.float32(coeff) / np.float32(total_num_tokens)) * np.float32(2))
    vec = z_loss_vec_tiling(num_tokens, num_experts, logits.dtype.itemsize, True, tiling)
    if vec:
        grid, threads, lanes, vecs, hold, iters = vec
        kern = z_loss_vec_bwd_kernel(logits.kind, hold, lanes, *tiling.vec_bwd[3:], *flag)
        step = Step(kern, grid, threads, 0, (In(0, word_view(logits)), In(1), In(2, spec_of((1,), F32)),
                                             Out(0, word_view(logits)), *masked, num_tokens, vecs, iters, scale))
        return Plan(OP + "_bwd", ins, outs, (), (step,))
    grad = Out(0, array_views(logits.kind, logits.shape)[0]) if quads else Out(0)
    step = Step(z_loss_bwd_kernel(logits.kind, quads, tiling.bwd_hold, *flag), grid, threads, 0,
                  (_logits_arg(logits, quads), In(1), In(2, spec_of((1,), F32)), grad, *masked,
                   num_tokens, num_experts, units, lanes, scale))
    return Plan(OP + "_bwd", ins, outs, (), (step,))
