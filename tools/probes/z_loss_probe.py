"""Router z-loss kernels on the GPU: the forward and backward plans timed against
their byte floors, checked against float64 NumPy at full size.

``python tools/probes/z_loss_probe.py [--tokens 65536] [--experts 256] [--dtype bf16]
[--repeats 100] [--peak 4.0] [--sweep] [--json out.json]``

Each plan runs the way the zero-copy transport runs it (``_base/pointer.PointerLaunch``
on raw pointers of numba device arrays), inputs rotated over three sets (more
bytes than L2 holds).  Time: CUDA events around each launch, the launches
queued behind a sleeping kernel (so the host's launch rate is not what is
timed), the median of ``--repeats`` (as ``gpurouter.bench.router._kernel_times``).
Byte floors at ``--peak`` TB/s: the forward reads T*E*s bytes and writes T*8
(each row's saved max and log2 sum; s = 2 for bf16 / fp16, 4 for fp32); the
backward reads T*E*s + T*8 and writes T*E*s.  ``--sweep`` also times other tilings (``SWEEP``: the vector
kernels' ``ZLossTiling.vec_fwd`` or ``vec_bwd``, passed to the plans) and the other dtypes.
"""

from __future__ import annotations

import argparse
import json

import ml_dtypes
import numpy as np
from numba import cuda

from gpurouter import kernels as K
from gpurouter.bench.timing import median_us as _time
from gpurouter.bench.timing import ptr as _ptr
from gpurouter.bench.timing import spin_kernel as _spin_kernel
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan
from gpurouter.kernels._base import pointer as _pointer
from gpurouter.kernels.losses import last_block as F
from gpurouter.kernels.losses import tiling as Z

DTYPES = {"bf16": (ml_dtypes.bfloat16, L.BF16), "fp32": (np.float32, L.F32), "fp16": (np.float16, L.F16)}


def _lse64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return (np.log(np.exp(x - m).sum(-1, keepdims=True)) + m)[..., 0]


#: (label, knobs): ``ZLossTiling`` fields (``vec_fwd`` / ``vec_bwd``: threads, held vectors, blocks at
#: most, prefetch, hints), the forward's or the backward's alone (the forward of the vector kernels is one
#: launch, its finish in the last block), or ``FINISH`` (``last_block.FINISH``, a kernel mode)
_NO_CAP = 1 << 20
SWEEP = [(f"fwd {v}", dict(vec_fwd=v)) for v in (
    (256, 4, _NO_CAP, False, True), (256, 4, 1056, False, True), (256, 4, 1056, True, True),
    (256, 4, 396, True, True), (128, 4, 1056, True, True), (128, 4, 528, True, True),
    (256, 8, _NO_CAP, False, True), (256, 4, _NO_CAP, False, False))
] + [(f"finish {m}", dict(FINISH=m)) for m in ("fence", "none")] + [
    (f"fwd {v}, finish none", dict(vec_fwd=v, FINISH="none")) for v in ((256, 4, _NO_CAP, False, True),
                                                                          (128, 4, 1056, True, True))
] + [(f"bwd {v}", dict(vec_bwd=v)) for v in ((256, 2, _NO_CAP, False, True), (256, 4, _NO_CAP, False, True))]


def _inputs(tokens, experts, dtype):
    host_dtype, kind = DTYPES[dtype]
    rng = np.random.default_rng(0)
    xs = [(rng.standard_normal((tokens, experts)) * 2).astype(np.float32).astype(host_dtype) for _ in range(3)]
    words = [x.view(np.uint16) if kind == L.BF16 else x for x in xs]
    return xs, words, [cuda.to_device(w) for w in words]


def run(tokens, experts, dtype, repeats, peak, label="", data=None, tiling=Z.Z_LOSS_TILING):
    host_dtype, kind = DTYPES[dtype]
    size = np.dtype(host_dtype).itemsize
    xs, words, dxs = data or _inputs(tokens, experts, dtype)
    coeff, total = np.float32(1e-3), tokens
    spec = _plan.spec_of((tokens, experts), kind)
    fplan = K.router_z_loss_fwd_plan(spec, coeff, total, tiling)
    bplan = K.router_z_loss_bwd_plan(spec, coeff, total, tiling)
    rows_only = _plan.Plan("rows", fplan.ins, fplan.outs, fplan.tmps, fplan.steps[:1])
    fwd, rows, bwd = (_pointer.PointerLaunch(p, 0) for p in (fplan, rows_only, bplan))
    loss = cuda.device_array((), np.float32)
    lses = [cuda.device_array((2 * tokens,), np.float32) for _ in xs]  # the saved (m, log2 s) pairs
    part = cuda.device_array(fplan.tmps[0].shape, np.float32)
    g = cuda.to_device(np.asarray(1.0, np.float32))
    grad = cuda.device_array((tokens, experts), words[0].dtype)
    for i, dx in enumerate(dxs):  # the saved lse of every input set, for the backward
        fwd([_ptr(dx), _ptr(loss), _ptr(lses[i]), _ptr(part)], 0)
    cuda.synchronize()

    # checks at full size: loss, lse, a few gradient rows (float64 NumPy)
    fwd([_ptr(dxs[0]), _ptr(loss), _ptr(lses[0]), _ptr(part)], 0)
    cuda.synchronize()
    want_lse = _lse64(xs[0])
    pairs = lses[0].copy_to_host()
    got_lse = pairs[:tokens] + pairs[tokens:] * np.float32(np.log(2.0))  # no dead rows in these inputs
    want_loss = float(coeff) * float(np.sum(want_lse ** 2)) / total
    lse_err = float(np.max(np.abs(got_lse - want_lse) / np.maximum(1, np.abs(want_lse))))
    loss_rel = abs(float(loss.copy_to_host()) - want_loss) / want_loss
    bwd([_ptr(dxs[0]), _ptr(lses[0]), _ptr(g), _ptr(grad)], 0)
    cuda.synchronize()
    gh = grad.copy_to_host()[:64]
    gh = (gh.view(ml_dtypes.bfloat16) if kind == L.BF16 else gh).astype(np.float32)
    x64 = np.asarray(xs[0][:64], np.float64)
    want_g = 2 * float(coeff) / total * want_lse[:64, None] * np.exp(x64 - want_lse[:64, None])
    g_err = float(np.max(np.abs(gh - want_g)) / np.max(np.abs(want_g)))  # relative to the largest gradient

    spin = _spin_kernel()
    t_fwd = _time(fwd, [[_ptr(dx), _ptr(loss), _ptr(lses[i]), _ptr(part)] for i, dx in enumerate(dxs)],
                  repeats, spin)
    t_rows = _time(rows, [[_ptr(dx), _ptr(loss), _ptr(lses[i]), _ptr(part)] for i, dx in enumerate(dxs)],
                   repeats, spin)
    t_bwd = _time(bwd, [[_ptr(dx), _ptr(lses[i]), _ptr(g), _ptr(grad)] for i, dx in enumerate(dxs)],
                  repeats, spin)
    st = fplan.steps[0]
    specs = {"in": fplan.ins, "out": fplan.outs, "tmp": fplan.tmps}
    regs = st.kernel.compile(tuple(_pointer._numba_type(a, specs) for a in st.args)).regs_per_thread
    counters_zero = all(not _plan.counter_array(c, 0, _plan.counter_key(0)).copy_to_host().any()
                        for c in _plan.plan_counters(fplan))  # left zero by every launch
    fbytes = tokens * experts * size + tokens * 8  # the saved (m, log2 s) pairs
    bbytes = 2 * tokens * experts * size + tokens * 8
    ffloor, bfloor = fbytes / (peak * 1e12) * 1e6, bbytes / (peak * 1e12) * 1e6
    vec = Z.z_loss_vec_tiling(tokens, experts, size, False, tiling)
    knobs = dict(vec_fwd=tiling.vec_fwd, vec_bwd=tiling.vec_bwd, vec=bool(vec), final_threads=tiling.final_threads) \
        if vec else dict(hold=tiling.hold, threads=tiling.threads, bwd_hold=tiling.bwd_hold,
                         bwd_threads=tiling.bwd_threads)
    tiling = vec or Z.z_loss_tiling(tokens, experts, tiling=tiling)
    res = dict(label=label, tokens=tokens, experts=experts, dtype=dtype, **knobs,
               grid=tiling[0], block=tiling[1], lanes=tiling[2],
               fwd_us=t_fwd, fwd_rows_kernel_us=t_rows, bwd_us=t_bwd, fwd_floor_us=ffloor, bwd_floor_us=bfloor,
               fwd_x_floor=t_fwd / ffloor, bwd_x_floor=t_bwd / bfloor,
               both_x_floor=(t_fwd + t_bwd) / (ffloor + bfloor),
               loss_rel_err=loss_rel, lse_max_err=lse_err, grad_max_err_rel=g_err,
               launches=len(fplan.steps), counters_zero=counters_zero, fwd_regs=regs, finish=F.FINISH)
    print(f"{label:>34} T={tokens} E={experts} {dtype} {knobs} (grid {tiling[0]} x {tiling[1]}, "
          f"W={tiling[2]}): fwd {t_fwd:.2f} us ({t_fwd / ffloor:.2f}x floor "
          f"{ffloor:.2f}; rows kernel alone {t_rows:.2f}), bwd {t_bwd:.2f} us ({t_bwd / bfloor:.2f}x floor "
          f"{bfloor:.2f}), fwd+bwd {(t_fwd + t_bwd) / (ffloor + bfloor):.2f}x; "
          f"loss rel err {loss_rel:.1e}, lse err {lse_err:.1e}, grad err {g_err:.1e}; "
          f"{len(fplan.steps)} fwd launch(es), finish {F.FINISH}, {regs} regs, counters zero after: {counters_zero}",
          flush=True)
    return res


def _clear():  # (FINISH is a kernel mode read when a plan is made: the plans made under another are forgotten)
    K.router_z_loss_fwd_plan.cache_clear()
    K.router_z_loss_bwd_plan.cache_clear()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--peak", type=float, default=4.0, help="TB/s of the byte floor")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP tilings and the other dtypes")
    ap.add_argument("--json")
    a = ap.parse_args()
    name = getattr(cuda.get_current_device(), "name", "no GPU")
    print(name.decode() if isinstance(name, bytes) else name, flush=True)
    data = _inputs(a.tokens, a.experts, a.dtype)
    results = [run(a.tokens, a.experts, a.dtype, a.repeats, a.peak, "default", data)]
    if a.sweep:
        for label, knobs in SWEEP:
            knobs = dict(knobs)
            finish = knobs.pop("FINISH", None)
            saved = F.FINISH
            if finish is not None:
                F.FINISH = finish
                _clear()
            try:
                results.append(run(a.tokens, a.experts, a.dtype, a.repeats, a.peak, label, data,
                                   Z.ZLossTiling(**knobs)))
            except Exception as e:  # a variant that fails to compile or run: say so, go on
                print(f"{label}: {type(e).__name__}: {e}", flush=True)
            if finish is not None:
                F.FINISH = saved
                _clear()
        for dtype in sorted(set(DTYPES) - {a.dtype}):
            results.append(run(a.tokens, a.experts, dtype, a.repeats, a.peak, "other dtype"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
