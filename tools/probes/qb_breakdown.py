"""Where the Quantile-Balancing counts spend their time (GPU only): each launch
of ``qb_counts_plan`` timed on its own, the plan whole, and, for comparison,
the plain sigmoid top-k op and the QB op (issue #37's target: QB at most 1.2x
the plain op).

``python tools/probes/qb_breakdown.py [--tokens 65536] [--experts 384] [--bins 1000] [--json qb.json]``

Rows (median microseconds of ``--repeats`` after a warm-up):

- one row per step of the plan (``plan.steps``, launched as ``plan.execute``
  launches them, through numba's dispatcher): CUDA events around each launch,
  the launches queued behind a sleeping kernel (``gpurouter.bench.timing``) so
  that the host's launch time is not counted; with the bytes of its array
  arguments (each read or written once: the step's least traffic) per second;
- ``plan (all steps)``: the same, around the whole plan;
- ``qb_counts() call``: the launcher on device arrays, wall clock to a
  synchronize (host time included);
- ``route: warp fwd`` and ``route: warp fwd + QB cutoff``: the routing
  kernel's plan (``path="warp"``, bf16, a bias) without and with the QB
  cutoff option (``qb_cutoff=``: it also writes ``alpha [T]``), event-timed
  as the steps; ``, no saved``: the same without the saved scores (``save=False``,
  the op's forward without a gradient on the warp kernel); ``plan, cutoff
  given``: the QB plan on that alpha (``cutoff_given=True``: no cutoff pass),
  then on the route's saved scores (each step and the plan), their counts
  checked equal to the plan's own bit for bit;
- ``op sigmoid`` and ``op qb``: ``jit(fused_topk_with_score_function)`` on
  ``backend="numba"`` without and with ``qb_histogram`` (bf16 logits, an
  expert bias), wall clock per op over ``--batch`` inputs in one call, as
  ``variants_probe.py`` times them (``op qb`` takes the route's cutoff where
  the route runs on the warp kernel: ``_ops/topk.py: _qb_cutoff_mode``).

The tiling flags (``--slab-tokens`` ...) override ``QbTiling``'s defaults for
the step rows; the op rows use the library's tiling. ``--sweep
"hist_threads=384,target_blocks=396;target_blocks=132"`` times the plan (and
the QB plans on the route's cutoff) once more for each ``;``-separated set of
overrides (on top of the flags), in the
same process: a grid or block change compiles nothing new (``cutoff_lanes``
does: a new kernel). The counts of the plan are checked cheaply (every expert
row sums to ``T``); the bit-exact checks are the tests'.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import numpy as np
from numba import cuda

from gpurouter.bench.timing import median_us, spin_kernel
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan
from gpurouter.kernels.topk import plans as kplans
from gpurouter.kernels.topk import qb as kqb
from gpurouter.kernels.topk.qb_math import default_exp_mode


def _name(kernel) -> str:
    f = getattr(kernel, "py_func", None)
    return getattr(f, "__name__", None) or type(kernel).__name__


def _arrays(plan, *ins):
    """The plan's device arrays: the inputs given, outputs and scratch allocated."""
    return {"in": list(ins),
            "out": [cuda.device_array(sp.shape, sp.dtype) for sp in plan.outs],
            "tmp": [cuda.device_array(sp.shape, sp.dtype) for sp in plan.tmps]}


def _events_us(launch, repeats: int) -> float:
    """Median microseconds of ``launch()`` by CUDA events, queued behind a sleep
    (``gpurouter.bench.timing.median_us``; its first call compiles and warms)."""
    return median_us(lambda _ptrs, _stream: launch(), [None], repeats, spin_kernel())


def _bytes_moved(st, arrays) -> int:
    """The least DRAM traffic of a step: each array argument read or written once
    (the logits, the scratch, the counts), the kernel's floor at full bandwidth."""
    seen = {(a.role, a.index): _plan._resolve(a, arrays) for a in st.args if isinstance(a, _plan.Ref)}
    return sum(int(arr.size) * arr.dtype.itemsize for arr in seen.values())


def _step_launcher(st, arrays):
    args = tuple(_plan._resolve(a, arrays) for a in st.args)

    def launch():
        L.launch(st.kernel, st.grid, st.block, 0, st.shared, *args)

    return launch


@functools.cache
def _inputs(tokens: int, experts: int, seed: int = 0):
    """Device ``(logits as bf16 words, expert_bias, bin_bounds)``, made once a shape."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, experts), np.float32)
    x_words = cuda.to_device((x.view(np.uint32) >> 16).astype(np.uint16))  # bf16 words (truncated: any bits do)
    bias = cuda.to_device(np.linspace(-0.01, 0.01, experts, dtype=np.float32))
    bounds = cuda.to_device(np.array([-1.0, 1.0], np.float32))
    return x_words, bias, bounds


def _step_rows(plan, arrays, repeats: int, prefix: str = ""):
    """``[(name, us, detail)]``: each step of ``plan`` on ``arrays`` event-timed alone, then the whole plan."""
    rows = []
    steps = [_step_launcher(st, arrays) for st in plan.steps]
    for i, (st, launch) in enumerate(zip(plan.steps, steps, strict=True)):
        us = _events_us(launch, repeats)
        moved = _bytes_moved(st, arrays)
        detail = (f"{st.grid} x {st.block}, {st.shared} B shared, {moved / 1e6:.1f} MB at least "
                  f"({moved / us / 1e6:.2f} TB/s)")
        rows.append((f"{prefix}step {i}: {_name(st.kernel)}", us, detail))

    def whole():
        for launch in steps:
            launch()

    rows.append((f"{prefix}plan (all steps)", _events_us(whole, repeats), f"{len(steps)} launches"))
    return rows


def plan_rows(tokens: int, experts: int, topk: int, bins: int, tiling, repeats: int):
    """``(rows, info)``: ``[(name, us, detail)]`` for each step and the whole plan."""
    x_words, bias, bounds = _inputs(tokens, experts)
    plan = kqb.qb_counts_plan(_plan.spec_of((tokens, experts), L.BF16), False, topk, bins, tiling=tiling)
    arrays = _arrays(plan, x_words, bias, bounds)
    rows = _step_rows(plan, arrays, repeats)
    counts = arrays["out"][0].copy_to_host()
    ok = bool((counts.reshape(experts, bins).sum(axis=1) == tokens).all())
    kqb.qb_counts(x_words, bias, bounds, bins, topk, tiling=tiling)  # warm the launcher's path
    cuda.synchronize()
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kqb.qb_counts(x_words, bias, bounds, bins, topk, tiling=tiling)
        cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    rows.append(("qb_counts() call", statistics.median(walls) * 1e6, "wall clock, host time included"))
    info = {"scratch_bytes": int(sum(sp.nbytes for sp in plan.tmps)), "rows_sum_to_T": ok}
    return rows, info


def _plan_us(plan, ins, repeats: int):
    """``(us, arrays)``: the whole plan event-timed on ``ins`` (outputs and scratch allocated)."""
    arrays = _arrays(plan, *ins)
    steps = [_step_launcher(st, arrays) for st in plan.steps]

    def whole():
        for launch in steps:
            launch()

    return _events_us(whole, repeats), arrays


def route_rows(tokens: int, experts: int, topk: int, bins: int, tiling, repeats: int):
    """``(rows, same)``: the warp routing plan without and with the QB cutoff, the QB
    plan on the route's alpha; ``same``: its counts equal the plan's own, bit for bit."""
    x_words, bias, bounds = _inputs(tokens, experts)
    spec = _plan.spec_of((tokens, experts), L.BF16)
    rows, alpha, scores = [], None, None
    for name, cut, save in (("route: warp fwd", "", True), ("route: warp fwd, no saved", "", False),
                            ("route: warp fwd + QB cutoff", default_exp_mode(), True)):
        plan = kplans.topk_with_score_function_fwd_plan(spec, True, topk, False, -1, -1, np.float32(1.0),
                                                        L.SIGMOID, 0, False, False, "warp", None, "sum_topk",
                                                        False, cut, save)
        us, arrays = _plan_us(plan, [x_words, bias], repeats)
        rows.append((name, us, f"{plan.steps[0].grid} x {plan.steps[0].block}"))
        if cut:  # its cutoff, and its saved scores (the QB sigmoid)
            alpha, scores = arrays["out"][-1], arrays["out"][2]
    own = kqb.qb_counts_plan(spec, False, topk, bins, tiling=tiling)
    _, own_arrays = _plan_us(own, [x_words, bias, bounds], 1)
    want = own_arrays["out"][0].copy_to_host()
    given = kqb.qb_counts_plan(spec, False, topk, bins, tiling=tiling, cutoff_given=True)
    us, arrays = _plan_us(given, [x_words, bias, bounds, alpha], repeats)
    rows.append(("plan, cutoff given (all steps)", us, f"{len(given.steps)} launches"))
    same = bool(np.array_equal(arrays["out"][0].copy_to_host(), want))
    scored = kqb.qb_counts_plan(_plan.spec_of((tokens, experts), L.F32), False, topk, bins, tiling=tiling,
                                cutoff_given=True, scores_given=True)
    arrays = _arrays(scored, scores, bias, bounds, alpha)
    rows += _step_rows(scored, arrays, repeats, "cutoff and scores given (the op's path): ")
    same = same and bool(np.array_equal(arrays["out"][0].copy_to_host(), want))
    return rows, same


def op_rows(tokens: int, experts: int, topk: int, bins: int, repeats: int, batch: int):
    """``[(name, us, detail)]``: the jitted sigmoid top-k op without and with QB."""
    import jax
    import jax.numpy as jnp
    from variants_probe import per_op_us  # tools/probes, the script's folder (it imports jax)

    import gpurouter as gr

    bias = jnp.linspace(-0.01, 0.01, experts, dtype=jnp.float32)
    hist = jnp.zeros((experts, bins), jnp.int32)
    bounds = jnp.asarray([-1.0, 1.0], jnp.float32)
    key = jax.random.PRNGKey(1)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (tokens, experts), jnp.bfloat16) for i in range(batch)]

    def plain(x):
        return gr.fused_topk_with_score_function(x, topk, score_function="sigmoid", expert_bias=bias,
                                                 backend="numba")

    def qb(x):
        return gr.fused_topk_with_score_function(x, topk, score_function="sigmoid", expert_bias=bias,
                                                 qb_histogram=hist, qb_bin_bounds=bounds, backend="numba")

    return [(name, per_op_us(fn, xs, repeats), f"jit, {batch} inputs a call, wall clock")
            for name, fn in (("op sigmoid", plain), ("op qb", qb))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--bins", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=5, help="inputs per timed op call (default 5)")
    ap.add_argument("--no-ops", action="store_true", help="skip the jitted op rows (no jax)")
    for f in dataclasses.fields(kqb.QbTiling):
        ap.add_argument("--" + f.name.replace("_", "-"), type=int, default=None, help=f"QbTiling.{f.name}")
    ap.add_argument("--sweep", default="", help="';'-separated sets of QbTiling overrides, 'name=int,...'")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if L.simulator_enabled():
        raise SystemExit("qb_breakdown: a GPU probe (unset NUMBA_ENABLE_CUDASIM)")
    over = {f.name: getattr(args, f.name) for f in dataclasses.fields(kqb.QbTiling)
            if getattr(args, f.name) is not None}
    tiling = dataclasses.replace(kqb.QB_TILING, **over)
    rows, info = plan_rows(args.tokens, args.experts, args.topk, args.bins, tiling, args.repeats)
    sweeps = []
    for item in filter(None, (part.strip() for part in args.sweep.split(";"))):
        kw = {k.strip(): int(v) for k, v in (pair.split("=") for pair in item.split(","))}
        t = dataclasses.replace(tiling, **kw)
        srows, sinfo = plan_rows(args.tokens, args.experts, args.topk, args.bins, t, args.repeats)
        srows += route_rows(args.tokens, args.experts, args.topk, args.bins, t, args.repeats)[0][3:]
        sweeps.append({"overrides": kw, **sinfo, "rows": [{"name": n, "us": u, "detail": d} for n, u, d in srows]})
        info["rows_sum_to_T"] = info["rows_sum_to_T"] and sinfo["rows_sum_to_T"]
    rrows, info["cutoff_given_same_counts"] = route_rows(args.tokens, args.experts, args.topk, args.bins, tiling,
                                                          args.repeats)
    rows += rrows
    if not args.no_ops:
        rows += op_rows(args.tokens, args.experts, args.topk, args.bins, args.repeats, args.batch)
    print(f"QB counts: T={args.tokens} E={args.experts} K={args.topk} B={args.bins} bf16; {tiling}")
    print(f"scratch {info['scratch_bytes'] / 1e6:.1f} MB; every expert row sums to T: {info['rows_sum_to_T']}; "
          f"counts on the route's cutoff = the plan's own: {info['cutoff_given_same_counts']}")
    for name, us, detail in rows:
        print(f"  {name:34s} {us:9.1f} us   {detail}")
    for sw in sweeps:
        print(f"sweep {sw['overrides']} (scratch {sw['scratch_bytes'] / 1e6:.1f} MB):")
        for r in sw["rows"]:
            print(f"  {r['name']:34s} {r['us']:9.1f} us   {r['detail']}")
    res = {name: us for name, us, _ in rows}
    ratio = None
    if "op qb" in res and res.get("op sigmoid"):
        ratio = res["op qb"] / res["op sigmoid"]
        print(f"  op qb / op sigmoid = {ratio:.2f} (target <= 1.2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "experts": args.experts, "topk": args.topk, "bins": args.bins,
                       "tiling": dataclasses.asdict(tiling), **info, "ratio": ratio,
                       "rows": [{"name": n, "us": u, "detail": d} for n, u, d in rows], "sweeps": sweeps},
                      f, indent=1)
    if not info["rows_sum_to_T"]:
        raise SystemExit("qb_breakdown: FAIL: an expert row of the counts does not sum to T")
    if not info["cutoff_given_same_counts"]:
        raise SystemExit("qb_breakdown: FAIL: the counts on the route's cutoff differ from the plan's own")


if __name__ == "__main__":
    main()
