"""Where a thread-per-token forward spends its time (GPU only): the kernel timed
whole and with phases taken out, by building variants of it.

``python tools/probes/phase_probe.py [--preset deepseek-v3] [--tokens 65536] [--repeats 50]``

Variants (each a different kernel, built from the same factories with one
device function swapped; the outputs of the cut ones are wrong, only their
time counts):

- ``full``: the kernel.
- ``no-select``: the per-token selection returns at once (no flags).
- ``no-groups``: grouping off (a plain top-K over all E: one scan of E
  keys and one marking scan of E instead of G group scans, then Kg groups).
- ``keys-only``: the selection is one list scan of all E (no groups, no
  sum or tie scans; the threshold way).
- ``full, maxshared``: the kernel with the shared-memory carveout set to its
  maximum (``cuKernelSetAttribute``), in case the driver's default choice
  holds fewer blocks per SM than fit.

A difference between two variants is what the cut phase costs there (no
overlap accounting: a lower bound when phases overlap across blocks).
"""

from __future__ import annotations

import argparse

import numpy as np
from numba import cuda

from gpurouter.kernels._base import device as D
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan
from gpurouter.kernels._base import pointer as _pointer
from gpurouter.kernels.topk import plans as T
from gpurouter.kernels.topk.token import fwd as R
from gpurouter.kernels.topk.token import rows as _token_rows
from gpurouter.presets import PRESETS


def _arrays(plan, rng):
    arrays = {"in": [], "out": [], "tmp": []}
    for role, sps in (("in", plan.ins), ("out", plan.outs), ("tmp", plan.tmps)):
        for sp in sps:
            if sp.dtype == np.bool_:
                h = np.zeros(sp.shape, np.bool_)
            elif sp.kind == L.BF16:
                h = (rng.standard_normal(sp.shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)
            else:
                h = rng.standard_normal(sp.shape).astype(sp.dtype) * np.float32(0.01)
            arrays[role].append(cuda.to_device(h))
    return arrays


def _time(plan, arrays, repeats):
    """Median kernel microseconds: CUDA events around each launch, the launches
    queued behind a sleeping kernel (as ``gpurouter.bench`` does), so the
    host's launch time is not counted."""
    from gpurouter.bench.timing import median_us
    from gpurouter.bench.timing import spin_kernel as _spin_kernel

    def launch():
        for st in plan.steps:
            L.launch(st.kernel, st.grid, st.block, 0, st.shared,
                     *(_plan._resolve(a, arrays) for a in st.args))

    return median_us(lambda _ptrs, _stream: launch(), [None], repeats, _spin_kernel())


def _preset_plan(preset, tokens, groups=True):
    p = PRESETS[preset]
    kw = p.router_kwargs()
    sf = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}[kw["score_function"]]
    g, kg = (kw["num_groups"] or -1, kw["group_topk"] or -1) if groups else (-1, -1)
    T.topk_with_score_function_fwd_plan.cache_clear()
    return T.topk_with_score_function_fwd_plan(
        _plan.spec_of((tokens, p.num_experts), L.BF16), p.expert_bias, p.topk, kw["use_pre_softmax"],
        g, kg, np.float32(kw["scaling_factor"]), sf)


def _with_selector(make):
    """Runs with ``token_topk_fwd.token_selector`` replaced by ``make`` (caches cleared around)."""
    orig = R.token_selector

    def clear():
        R.token_topk_fwd_kernel.cache_clear()
        T.topk_with_score_function_fwd_plan.cache_clear()

    class _Swap:
        def __enter__(self):
            R.token_selector = make
            clear()

        def __exit__(self, *exc):
            R.token_selector = orig
            clear()

    return _Swap()


def _no_select(topk, gcap, has_bias, post, scaled=False):
    @cuda.jit(device=True)
    def select(smem, row, num_experts, num_groups, group_topk, o_gs, o_bias, bits, fword):
        # threshold +inf: nothing selected
        return np.float32(1), np.float32(0), np.float32(np.inf), np.int32(0)

    return select


def _keys_only(topk, gcap, has_bias, post, scaled=False):
    push = _token_rows.register_pusher(topk + 1)

    @cuda.jit(device=True)
    def select(smem, row, num_experts, num_groups, group_topk, o_gs, o_bias, bits, fword):
        keys = cuda.local.array(topk + 1, R.nb_f32)
        for q in range(topk + 1):
            keys[q] = np.float32(-np.inf)
        j = np.int32(0)
        while j < num_experts:
            push(keys, D.nan_as_neg_inf(smem[D.u32(row + j)]))
            j = np.int32(j + 1)
        return np.float32(1), np.float32(0), keys[topk - 1], np.int32(num_experts)

    return select


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    plan = _preset_plan(args.preset, args.tokens)
    arrays = _arrays(plan, rng)
    print(f"{args.preset} T={args.tokens}: {plan.steps[0].grid} blocks x {plan.steps[0].block} threads, "
          f"{plan.steps[0].shared} B shared")
    print(f"  full              {_time(plan, arrays, args.repeats):8.1f} us")
    specs = {"in": plan.ins, "out": plan.outs, "tmp": plan.tmps}
    st = plan.steps[0]
    kern = st.kernel.compile(tuple(_pointer._numba_type(a, specs) for a in st.args))
    cufunc = kern._codelibrary.get_cufunc()
    blocks = cuda.current_context().get_active_blocks_per_multiprocessor(cufunc, st.block, st.shared)
    print(f"  ({blocks} blocks/SM fit; {kern.regs_per_thread} registers)")
    cufunc.set_shared_memory_carveout(100)
    print(f"  full, maxshared   {_time(plan, arrays, args.repeats):8.1f} us")
    cufunc.set_shared_memory_carveout(-1)
    print(f"  no-groups         {_time(_preset_plan(args.preset, args.tokens, False), arrays, args.repeats):8.1f} us")
    with _with_selector(_no_select):
        print(f"  no-select         {_time(_preset_plan(args.preset, args.tokens), arrays, args.repeats):8.1f} us")
    with _with_selector(_keys_only):
        print(f"  keys-only (all E) {_time(_preset_plan(args.preset, args.tokens), arrays, args.repeats):8.1f} us")


if __name__ == "__main__":
    main()
