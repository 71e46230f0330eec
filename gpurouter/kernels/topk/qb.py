"""Quantile Balancing (QB): this call's histogram counts as Numba-CUDA kernels.

``qb_counts(logits, expert_bias, bin_bounds, num_bins, topk, ...)`` gives the
int32 ``[E, B]`` counts of docs/contract.md section 12, step 3, bit for bit
the counts of ``gpurouter.reference._route.qb_call_counts`` (sigmoid only;
sqrtsoftplus stays in jnp, ``gpurouter/_ops/qb.py``):

- ``s = 1 / (1 + exp(-x))`` in fp32 (the logits upcast), ``r = s + b``;
- ``alpha_t``: the ``(K+1)``-th largest ``r`` of token ``t`` (NaN as ``-inf``),
  among the experts of the kept groups with grouping on (each group scored by
  ``group_score``, the top ``Kg`` kept, equal scores to the lower group);
- for every expert ``e`` of every valid token: ``rb = alpha_t - s[t, e]``,
  ``bin = floor((rb - lower) * (B / (upper - lower)))`` in fp32, clamped into
  ``[0, B - 1]`` (NaN to bin 0), one count to ``counts[e, bin]``.

The launches (``qb_counts_plan``):

1. ``qb_cutoff_lanes`` (``QbTiling.cutoff_lanes`` threads a token) or, with
   grouping, ``qb_cutoff`` (a thread a token): ``alpha [T]`` fp32 (plan
   scratch); the kernels are in ``qb_cutoff.py``.
2. ``qb_hist`` (a block per (expert chunk, token slab); ``QbTiling.hist_unroll``
   token rows a step, their loads issued together): the chunk's ``EC x B`` counts in
   shared memory (int32 shared atomics; ``EC`` as many experts as
   ``QbTiling.smem_bytes`` holds), then every bin of them, zeros too, stored
   with plain coalesced stores into the plan scratch ``partial [slabs, E, B]``
   int32 at ``[slab, chunk's experts, :]`` (with one slab: into the counts
   directly). No global atomics, and nothing needs zeroing: each bin of each
   slab is written by exactly one block.
3. ``qb_reduce`` (more than one slab): ``counts[e, b] = sum over slabs of
   partial[s, e, b]``, every bin written. The scratch costs
   ``slabs * E * B * 4`` bytes written and read again (8 slabs at E = 384,
   B = 1000: 12 MB).

The route's cutoff (``qb_counts_plan(..., cutoff_given=True)``): ``alpha
[T]`` is an input and step 1 is skipped; with ``scores_given=True`` the rows
are the route's saved scores ``s`` (f32, the same sigmoid bits) instead of the
logits, and step 2 computes no sigmoid (an H200 at T = 65536, E = 384: the
histogram pass issue-bound, 48 warp instructions a count, the sigmoid's the
largest part). The public op gives it where the
route runs on the warp forward (``kernels/topk/warp/fwd.py``, "The QB
cutoff": with the kernel's ``cutoff`` option it scores by this module's
sigmoid, and its sort's (K+1)-th value is the cutoff, the same bits as step
1); everywhere else (other kernels, token sharding) step 1 runs (``gpurouter/_ops/topk.py: _qb_cutoff_mode`` decides).

A row of ``B`` bins larger than the shared budget: ``qb_zero`` zeroes the
counts (the output is XLA's uninitialised buffer), then ``qb_hist`` adds each
count with a global atomic; ``T = 0``: ``qb_zero`` alone. Counts are
integers: any order of the additions gives the same result.

Overflow: one call adds at most one count per valid token to each bin, so a
bin of this call's counts is at most ``T <= 2**31 - 1`` (the op checks ``T``;
the caller's histogram is added to them saturating, in jnp).

The sigmoid is ``jax.nn.sigmoid``'s bits on the platform (``exp_mode``,
``qb_math.py``).
"""

from __future__ import annotations

from .._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import functools

import numpy as np
from numba import cuda
from numba import float32 as nb_f32
from numba import int32 as nb_i32

from .._base.access import loader_2d
from .._base.device import u32, u64
from .._base.launch import BF16, F32, any_on_device, device_input, is_device_array, map_input, resolve_stream
from .._base.parallel import recipe
from .._base.plan import In, Out, Plan, Spec, Step, Tmp, execute, spec_of
from .qb_cutoff import qb_cutoff_kernel, qb_cutoff_lanes_kernel
from .qb_math import default_exp_mode, qb_bin, qb_sigmoid_fn
from .qb_tiling import OP, QB_TILING, QbTiling, check_qb_config, hist_tiling

INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@cuda.jit
def qb_zero_kernel(counts, n):
    """``counts[:n] = 0`` (grid-strided)."""
    i = np.int64(cuda.grid(1))
    step = np.int64(cuda.gridsize(1))
    while i < n:
        counts[u64(i)] = np.int32(0)
        i += step


@recipe  # rebuilt by a compile worker (_base/parallel.py)
@functools.cache
def qb_hist_kernel(kind: str, masked: bool, shared: bool, exp_mode: str, unroll: int = 4, scores: bool = False):
    """The counts of the experts ``[c EC, (c + 1) EC)`` over the tokens of slab ``s``
    (block ``b = s * chunks + c``): a thread a (token row, expert) pair, ``rows``
    token rows a block, ``unroll`` token rows a step (their loads issued together,
    the values held in registers: the loops over them unroll).

    ``shared``: counted in shared memory, then every one of the block's ``EC x B``
    bins stored (plain coalesced stores, zeros too) into ``dest``, the scratch
    ``partial [slabs, E, B]``, at ``[s, c EC : c EC + EC, :]``; ``qb_reduce`` sums
    the slabs. Else ``dest`` is ``counts [E, B]`` (zeroed before) and each count a
    global ``atomicAdd``.  ``scores``: the rows are the unbiased QB sigmoid itself
    (f32, the routing kernel's saved scores), not logits: no sigmoid here."""
    load = loader_2d(kind)
    sigmoid = qb_sigmoid_fn(exp_mode)

    @cuda.jit(device=True)
    def add(hist, dest, el, e, nb, x, c, lower, scale, top_f):
        k = qb_bin(np.float32(c - (x if scores else sigmoid(x))), lower, scale, top_f)
        # unsigned indices: no negative-index wraparound code (numba's, for signed ones)
        if shared:
            cuda.atomic.add(hist, u32(el * nb + k), np.int32(1))
        else:
            cuda.atomic.add(dest, u64(np.int64(e) * np.int64(nb) + np.int64(k)), np.int32(1))

    @cuda.jit
    def qb_hist(logits, cutoff, valid, bounds, dest, num_tokens, num_experts, num_bins, chunk, chunks,
                slab):
        hist = cuda.shared.array(0, nb_i32)
        tid = np.int32(cuda.threadIdx.x)
        nth = np.int32(cuda.blockDim.x)
        b = np.int32(cuda.blockIdx.x)
        s_idx = b // np.int32(chunks)
        c_idx = b - s_idx * np.int32(chunks)
        e0 = c_idx * np.int32(chunk)
        ec = min(np.int32(chunk), np.int32(num_experts) - e0)
        t0 = np.int64(s_idx) * np.int64(slab)
        t1 = min(np.int64(num_tokens), t0 + np.int64(slab))
        nb = np.int32(num_bins)
        words = ec * nb
        if shared:
            i = tid
            while i < words:
                hist[i] = np.int32(0)
                i += nth
            # Barrier: the counts are zero before any thread adds.
            cuda.syncthreads()
        lower = bounds[0]
        scale = np.float32(np.float32(nb) / np.float32(bounds[1] - lower))
        top_f = np.float32(nb - np.int32(1))
        rows = nth // ec
        row = tid // ec
        el = tid - row * ec
        xs = cuda.local.array(unroll, nb_f32)  # registers: the loops over it unroll
        cs = cuda.local.array(unroll, nb_f32)
        vs = cuda.local.array(unroll, nb_i32)  # (masked) the rows' valid flags, loaded with the rows
        if row < rows:
            e = e0 + el
            step = np.int64(rows)
            t = t0 + np.int64(row)
            # unroll token rows a step: their loads go out before the first sigmoid
            while t + (unroll - 1) * step < t1:
                for u in range(unroll):
                    tu = t + u * step
                    xs[u] = load(logits, u64(tu), u64(e))
                    cs[u] = cutoff[u64(tu)]
                    if masked:  # in flight with the rows' loads (read at each add, the loads waited one by one)
                        vs[u] = np.int32(valid[u64(tu)] != 0)
                for u in range(unroll):
                    if not masked or vs[u] != 0:
                        add(hist, dest, el, e, nb, xs[u], cs[u], lower, scale, top_f)
                t += unroll * step
            while t < t1:
                if not masked or valid[u64(t)]:
                    add(hist, dest, el, e, nb, load(logits, u64(t), u64(e)), cutoff[u64(t)], lower, scale, top_f)
                t += step
        if shared:
            # Barrier: every add of the block is in before the stores read.
            cuda.syncthreads()
            base = (np.int64(s_idx) * np.int64(num_experts) + np.int64(e0)) * np.int64(nb)
            i = tid
            while i < words:
                dest[u64(base + np.int64(i))] = hist[i]
                i += nth

    return qb_hist


@cuda.jit
def qb_reduce_kernel(partial, counts, n, slabs):
    """``counts[i] = sum_s partial[s * n + i]`` for ``i < n`` (grid-strided; every
    word written). Integer sums: exact in any order, at most ``T`` each."""
    i = np.int64(cuda.grid(1))
    step = np.int64(cuda.gridsize(1))
    while i < n:
        acc = partial[u64(i)]
        j = i + n
        for _ in range(1, slabs):
            acc += partial[u64(j)]
            j += n
        counts[u64(i)] = np.int32(acc)
        i += step


# ----------------------------------------------------------------------------
# Launchers and plans
# ----------------------------------------------------------------------------


@functools.cache
def qb_counts_plan(logits: Spec, masked: bool, topk: int, num_bins: int, num_groups: int = 0,
                   group_topk: int = 0, group_score: str = "sum_topk", exp_mode: str | None = None,
                   tiling: QbTiling | None = None, cutoff_given: bool = False, scores_given: bool = False) -> Plan:
    """The launches of :func:`qb_counts`: inputs ``logits [T, E]`` (f32/bf16/f16),
    ``expert_bias [E] f32``, ``bin_bounds [2] f32`` and, with ``masked``, ``valid [T]``
    bool; output ``counts [E, B] int32``; scratch ``alpha [T] f32`` and, with shared
    counts and more than one token slab, ``partial [slabs * E * B] int32``.

    ``cutoff_given``: ``alpha [T] f32`` is a last input (the routing kernel's, the
    warp forward's ``cutoff`` option: the same bits as step 1's), step 1 is
    skipped and there is no alpha scratch (the bias is then not read: step 1
    is its only reader).  ``scores_given`` (with ``cutoff_given``): the first input
    is not the logits but ``s [T, E] f32``, their QB sigmoid (the routing kernel's
    saved scores, written with that alpha): the histogram reads it and computes
    no sigmoid."""
    if scores_given and (not cutoff_given or logits.kind != F32):
        raise ValueError(f"{OP}: scores_given needs cutoff_given and f32 scores, got cutoff_given={cutoff_given}, "
                         f"{logits.kind} rows.")
    tiling = tiling or QB_TILING
    exp_mode = exp_mode or default_exp_mode()
    num_tokens, num_experts = logits.shape
    groups, kg = check_qb_config(topk, num_experts, num_bins, num_groups, group_topk, group_score, exp_mode)
    ins = [logits, spec_of((num_experts,), F32), spec_of((2,), F32)]
    if masked:
        ins.append(Spec((num_tokens,), np.bool_))
    if cutoff_given:
        ins.append(spec_of((num_tokens,), F32))
    alpha = In(len(ins) - 1) if cutoff_given else Tmp(0)
    outs = (Spec((num_experts, num_bins), np.int32),)
    n = num_experts * num_bins
    counts = Out(0, Spec((n,), np.int32))
    grid, threads, shared, chunk, chunks, slab = hist_tiling(num_tokens, num_experts, num_bins, tiling)
    slabs = grid // chunks
    # with shared counts every bin is stored by one block of each slab (no zeroing):
    # into the scratch partial [slabs, E, B] that qb_reduce sums, or, one slab, into
    # the counts; without (a row of B bins over the budget) and with no tokens, the
    # counts are zeroed and the histogram adds with global atomics
    stored = bool(num_tokens) and shared > 0
    partials = stored and slabs > 1
    # scratch: alpha (not with the route's), then the partials
    tmps = [] if cutoff_given else [spec_of((max(num_tokens, 1),), F32)]
    if partials:
        tmps.append(Spec((slabs * n,), np.int32))
    part = Tmp(len(tmps) - 1) if partials else None
    valid = In(3) if masked else alpha  # unmasked kernels never read it (an f32 [T] either way: one specialisation)
    steps = []
    if not stored:
        steps.append(Step(qb_zero_kernel, max(1, min(tiling.zero_blocks, -(-n // tiling.zero_threads))),
                          tiling.zero_threads, 0, (counts, n)))
    if num_tokens:
        ct, lanes = tiling.cutoff_threads, tiling.cutoff_lanes
        if groups or lanes == 1:  # a thread a token
            kern, cgrid, cshared = (qb_cutoff_kernel(logits.kind, topk, groups, kg, group_score, masked, exp_mode),
                                    -(-num_tokens // ct), 0)
        else:
            quads = logits.kind == BF16 and num_experts % 4 == 0 and bool(tiling.cutoff_quads)
            kern, cgrid, cshared = (qb_cutoff_lanes_kernel(logits.kind, topk, lanes, masked, exp_mode, quads),
                                    -(-num_tokens // (ct // lanes)), 4 * ct * (topk + 1))
        if not cutoff_given:
            steps.append(Step(kern, cgrid, ct, cshared, (In(0), In(1), valid, Tmp(0), num_tokens, num_experts)))
        steps.append(Step(qb_hist_kernel(logits.kind, masked, shared > 0, exp_mode, tiling.hist_unroll,
                                         scores_given), grid,
                          threads, shared,
                          (In(0), alpha, valid, In(2), part if partials else counts, num_tokens, num_experts,
                           num_bins, chunk, chunks, slab)))
    if partials:
        steps.append(Step(qb_reduce_kernel, max(1, min(tiling.reduce_blocks, -(-n // tiling.reduce_threads))),
                          tiling.reduce_threads, 0, (part, counts, n, slabs)))
    return Plan(OP, ins, outs, tmps, steps)


def _mask_input(token_mask, num_tokens: int, stream):
    """The valid-token mask, bool ``(T,)`` host or device, as a device array."""
    if is_device_array(token_mask):
        m = token_mask if hasattr(token_mask, "copy_to_host") else cuda.as_cuda_array(token_mask)
    else:
        m = np.ascontiguousarray(np.asarray(token_mask))
    if np.dtype(m.dtype) != np.bool_:
        raise TypeError(f"{OP}: token_mask must be bool, got {m.dtype}.")
    if tuple(m.shape) != (num_tokens,):
        raise ValueError(f"{OP}: token_mask must be bool of shape ({num_tokens},), got {tuple(m.shape)}.")
    # a [T, 1] bool "map" (launch.map_input moves it), viewed flat again
    return map_input(m.reshape(num_tokens, 1), "token_mask", OP, stream, (num_tokens, 1))[0].reshape(num_tokens)


def qb_counts(logits, expert_bias, bin_bounds, num_bins: int, topk: int, *, token_mask=None, num_groups: int = -1,
              group_topk: int = -1, group_score: str = "sum_topk", exp_mode: str | None = None,
              tiling: QbTiling | None = None, out=None, stream=0):
    """This call's QB counts (the module docstring).

    Args:
      logits: (T, E) float32 | bfloat16 | float16; sigmoid scores.
      expert_bias: (E,) float32.
      bin_bounds: (2,) float32 ``[lower, upper]`` (read on the device, not checked here).
      num_bins: B >= 1.
      topk: K, ``1 <= K < E``.
      token_mask: optional (T,) bool, the valid tokens (masked ones add nothing).
      num_groups, group_topk, group_score: group-limited QB (-1: no groups).
      exp_mode: ``"libdevice"`` or ``"cephes"`` (None: ``default_exp_mode()``).
      tiling: a ``QbTiling`` (None: the library's).
      out: optional ``counts`` (E, B) int32 device array.
      stream: numba stream or int CUDA stream handle.

    Returns:
      ``counts (E, B) int32``; each row sums to the number of valid tokens.
    """
    s = resolve_stream(stream)
    d, kind = device_input(logits, "logits", OP, s, ndim=2)
    num_tokens, num_experts = (int(v) for v in d.shape)
    if num_tokens > INT32_MAX:
        raise ValueError(f"{OP}: more than 2**31 - 1 tokens ({num_tokens}) could overflow a bin.")
    d_b, bkind = device_input(expert_bias, "expert_bias", OP, s, ndim=1)
    if bkind != F32 or tuple(d_b.shape) != (num_experts,):
        raise ValueError(f"{OP}: expert_bias must be float32 of shape ({num_experts},), got "
                         f"{tuple(d_b.shape)} {d_b.dtype}.")
    d_lu, lkind = device_input(bin_bounds, "bin_bounds", OP, s, ndim=1)
    if lkind != F32 or tuple(d_lu.shape) != (2,):
        raise ValueError(f"{OP}: bin_bounds must be float32 of shape (2,), got {tuple(d_lu.shape)} {d_lu.dtype}.")
    ins = [d, d_b, d_lu]
    masked = token_mask is not None
    if masked:
        ins.append(_mask_input(token_mask, num_tokens, s))
    to_host = not any_on_device(logits, expert_bias, bin_bounds, token_mask) and out is None
    plan = qb_counts_plan(Spec(d.shape, d.dtype, kind), masked, int(topk), int(num_bins),
                          max(int(num_groups), 0), max(int(group_topk), 0), group_score, exp_mode, tiling)
    return execute(plan, ins, None if out is None else (out,), s, to_host)[0]


__all__ = ["QB_TILING", "QbTiling", "qb_counts", "qb_counts_plan"]
