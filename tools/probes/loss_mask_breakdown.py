"""What a ``token_mask`` costs in the loss kernels, launch by launch (GPU only).

``python tools/probes/loss_mask_breakdown.py [--tokens 65536] [--experts 256,384]
[--repeats 20] [--json out.json]``

For each E (``[T, E]`` of ``--dtype``, bf16 by default, every 10th token masked, as
``tools/probes/variants_probe.py``):

- the aux loss plans (``moe_aux_loss_fwd_plan``, ``moe_aux_loss_bwd_plan``)
  and the z-loss plans (``router_z_loss_fwd_plan``, ``router_z_loss_bwd_plan``):
  unmasked, masked with ``T`` counted by the kernels (``count_valid``: the
  ops' default on one device) and masked with ``T`` given (a device scalar:
  sharded or a caller's count); every launch of a plan (``Plan.steps``, run
  through ``_base.launch.launch`` as the executors do) timed alone with CUDA
  events, the launches queued behind a sleeping kernel
  (``gpurouter.bench.timing.spin_kernel``) so that the host's launch rate is
  not what is timed, the median of ``--repeats`` after a warm-up, the big
  input rotated over three sets (more bytes than L2 holds);
- the jitted ops (``backend="numba"``), forward and ``value_and_grad``,
  without and with the mask: the median wall microseconds per op of one jitted
  call over ``--batch`` inputs (the dispatch paid once for all of them), and
  the GPU microseconds per op, its kernels summed on a ``jax.profiler`` trace
  (``op_rows``: the wall figure's ratio is noise-bound, the GPU time's is not).

The plans' kernels are compiled first, all at once in worker processes
(``_base.parallel.precompile``; a cold cache pays the slowest compile, not the
sum). Prints one table (``ratio``: masked / unmasked, issue #37's target <=
1.05; a launch list per row; ``--op-kernels``: each op row's kernels and their GPU
time, named as on the trace) and writes it with ``--json``; ``--no-ops``
leaves out the jitted ops (no XLA compiles). ``--tiling
column_blocks=528,fill_blocks=1056`` (``AuxLossTiling``'s knobs) times the aux
loss plans alone at that tiling, for a sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
from numba import cuda

from gpurouter import kernels as K
from gpurouter._host import aux_loss_coeff
from gpurouter.bench.timing import ptr as _ptr
from gpurouter.bench.timing import spin_kernel
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import parallel
from gpurouter.kernels._base import plan as _plan
from gpurouter.kernels._base import pointer as _pointer
from gpurouter.kernels.losses.aux_loss import aux_loss_partial_coeff
from gpurouter.kernels.losses.tiling import AUX_LOSS_TILING, AuxLossTiling

TARGET = 1.05
#: ``--dtype``: the kernels' kind and the jitted ops' dtype
DTYPES = {"bf16": (L.BF16, "bfloat16"), "f32": (L.F32, "float32"), "f16": (L.F16, "float16")}
COEFF = np.float32(1e-2)
TOPK = 8


def _mask(tokens):
    return (np.arange(tokens) % 10) != 9  # every 10th token masked


def _host(spec, rng, tokens, hint):
    """A host array for one plan input: bf16 words, fp32 normals, counts, the
    mask; a scalar as a ``[1]`` array (T for ``hint == "n"``, else 1)."""
    if spec.shape == ():
        return np.asarray([float(tokens) if hint == "n" else 1.0], np.float32).astype(spec.dtype) \
            if spec.kind != L.BF16 else np.asarray([0x3F80], np.uint16)
    if spec.dtype == np.bool_:
        return _mask(spec.shape[0])
    if spec.kind == L.BF16:
        x = rng.standard_normal(spec.shape, np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    if spec.dtype in (np.int32, np.int64):
        return np.full(spec.shape, tokens * TOPK // max(1, spec.shape[0]), spec.dtype)
    return np.abs(rng.standard_normal(spec.shape)).astype(spec.dtype)


def _arrays(plan, rng, tokens, hints=(), firsts=None):
    """Three sets of device arrays (ins, outs, tmps: the plan's order) for ``plan``:
    the first input differs between sets (``firsts``: a dict of them by Spec,
    made once and shared by the plans), the rest are shared."""
    hints = dict(hints)
    ins = [cuda.to_device(_host(sp, rng, tokens, hints.get(i))) for i, sp in enumerate(plan.ins[1:], 1)]
    firsts = {} if firsts is None else firsts
    if plan.ins[0] not in firsts:
        firsts[plan.ins[0]] = [cuda.to_device(_host(plan.ins[0], rng, tokens, None)) for _ in range(3)]
    firsts = firsts[plan.ins[0]]
    rest = [cuda.device_array(max(1, sp.nbytes // sp.dtype.itemsize), sp.dtype) for sp in plan.outs + plan.tmps]
    return [[f] + ins + rest for f in firsts]


def _launchers(plan):
    """One ``PointerLaunch`` per step of ``plan`` (each a one-step plan over the
    plan's arrays; the plan's ``Counter`` objects, hence its counters, shared)."""
    return [_pointer.PointerLaunch(_plan.Plan(plan.op, plan.ins, plan.outs, plan.tmps, (st,)), 0)
            for st in plan.steps]


def _run(launchers, arrays, events=None):
    ptrs = [_ptr(a) for a in arrays]
    for i, launch in enumerate(launchers):
        launch(ptrs, 0)
        if events is not None:
            events[i].record()


def _fill_saved(fplan, sets, tokens, masked):
    """The z-loss backward's saved pairs (input 1) from a forward run on each set's logits."""
    fl = _launchers(fplan)
    for arrays in sets:
        fa = [arrays[0]] + [cuda.to_device(_host(sp, None, tokens, "n")) for sp in fplan.ins[1:]]
        if masked:
            fa[1] = arrays[3]  # the backward's mask
        rest = [cuda.device_array(max(1, sp.nbytes // sp.dtype.itemsize), sp.dtype) for sp in fplan.outs + fplan.tmps]
        _run(fl, fa + rest)
        arrays[1] = rest[1]  # the saved (m, log2 s) pairs
    cuda.synchronize()


def precompile(plans):
    """Every kernel of ``plans`` compiled at once in worker processes, into the
    disk cache (``_base.parallel.precompile``, as ``pointer.compile_steps`` does
    for one plan): a cold run pays the slowest compile, not their sum."""
    requests = []
    for plan in plans:
        specs = {"in": plan.ins, "out": plan.outs, "tmp": plan.tmps}
        requests += [(st.kernel, tuple(_pointer._numba_type(a, specs) for a in st.args)) for st in plan.steps]
    return parallel.precompile(requests, 0)


def step_times(plan, sets, repeats):
    """Median microseconds of each launch of ``plan`` (CUDA events between launches)."""
    launchers = _launchers(plan)
    for arrays in sets:  # load the kernels, warm
        _run(launchers, arrays)
    cuda.synchronize()
    spin = spin_kernel()
    n = len(launchers)
    ends = [[cuda.event() for _ in range(n)] for _ in range(repeats)]
    starts = [cuda.event() for _ in range(repeats)]
    L.launch(spin, 1, 1, 0, 0, 100 * repeats * n)  # ~0.1 ms a launch: longer than the host needs
    for r in range(repeats):
        starts[r].record()
        _run(launchers, sets[r % len(sets)], ends[r])
    ends[-1][-1].synchronize()
    out = []
    for i in range(n):
        out.append(statistics.median(
            (starts[r] if i == 0 else ends[r][i - 1]).elapsed_time(ends[r][i]) * 1e3 for r in range(repeats)))
    return out


def parse_tiling(text: str) -> AuxLossTiling | None:
    """``--tiling``'s ``"knob=value,..."`` (``AuxLossTiling``'s fields) as a tiling; "" is None (the library's)."""
    if not text:
        return None
    fields = {f.name for f in dataclasses.fields(AuxLossTiling)}
    knobs = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in fields or not value.isdigit():
            raise SystemExit(f"loss_mask_breakdown: --tiling {text!r}: want knob=int items of {sorted(fields)}")
        knobs[key] = int(value)
    return dataclasses.replace(AUX_LOSS_TILING, **knobs)


def kernel_rows(tokens, experts, repeats, rng, tiling=None, aux_only=False, kind=L.BF16):
    """``[(plan name, variant, [us per launch], [kernel names])]`` of the four loss plans
    (``tiling``: the aux loss plans' ``AuxLossTiling``; ``aux_only``: those two plans alone; ``kind``:
    the probs' and the gradients' dtype kind)."""
    probs = _plan.spec_of((tokens, experts), kind)
    tpe = _plan.Spec((experts,), np.int32)
    c = aux_loss_coeff(experts, COEFF, TOPK, tokens)
    cp = aux_loss_partial_coeff(experts, COEFF, TOPK)
    plans = [
        ("aux fwd", "unmasked", K.moe_aux_loss_fwd_plan(probs, tpe, c, tiling), ()),
        ("aux fwd", "masked, T counted", K.moe_aux_loss_fwd_plan(probs, tpe, cp, tiling, True, True), ()),
        ("aux fwd", "masked, T given", K.moe_aux_loss_fwd_plan(probs, tpe, cp, tiling, True), ((3, "n"),)),
        ("aux bwd", "unmasked", K.moe_aux_loss_bwd_plan(tpe, _plan.spec_of((), kind), tokens, tiling), ()),
        ("aux bwd", "masked", K.moe_aux_loss_bwd_plan(tpe, _plan.spec_of((), kind), tokens, tiling, True), ()),
        ("z fwd", "unmasked", K.router_z_loss_fwd_plan(probs, COEFF, tokens), ()),
        ("z fwd", "masked, T counted", K.router_z_loss_fwd_plan(probs, COEFF, 1, None, True, True), ()),
        ("z fwd", "masked, T given", K.router_z_loss_fwd_plan(probs, COEFF, 1, None, True), ((2, "n"),)),
        ("z bwd", "unmasked", K.router_z_loss_bwd_plan(probs, COEFF, tokens), ()),
        ("z bwd", "masked", K.router_z_loss_bwd_plan(probs, COEFF, 1, None, True), ((4, "n"),)),
    ]
    if aux_only:
        plans = plans[:5]
    precompile([p for _, _, p, _ in plans])
    zf = {} if aux_only else {False: plans[5][2], True: plans[7][2]}
    out = []
    firsts = {}  # the [T, E] inputs: three sets (more bytes than L2 holds), made once
    for name, variant, plan, hints in plans:
        sets = _arrays(plan, rng, tokens, hints, firsts)
        if name == "z bwd":
            _fill_saved(zf[variant != "unmasked"], sets, tokens, variant != "unmasked")
        us = step_times(plan, sets, repeats)
        kernels = [getattr(getattr(st.kernel, "py_func", None), "__name__", "kernel") for st in plan.steps]
        out.append((name, variant, us, kernels))
    return out


def gpu_us(f, xs, repeats):
    """The GPU time of ``repeats`` calls ``f(xs)``: every kernel's duration on the trace's
    GPU plane (``jax.profiler``; ``block_profile.gpu_events``) summed, per call; and
    ``{kernel name: us per call}``."""
    import tempfile

    import jax
    from block_profile import gpu_events  # tools/probes/, this script's folder

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(repeats):
                out = f(xs)
            jax.block_until_ready(out)
        totals, _ = gpu_events(d)
    return sum(totals.values()) / 1e3 / repeats, {k: v / 1e3 / repeats for k, v in totals.items()}


def op_rows(tokens, experts, repeats, batch, dtype="bfloat16"):
    """``[(op, variant, wall us per op, GPU us per op, {kernel: GPU us per op})]``: the jitted ops, forward and
    value_and_grad, masked or not.  Wall: the median of ``repeats`` jitted calls over
    ``batch`` inputs, host dispatch included (noisy: 0.83-1.40 masked / unmasked between
    runs of one commit on an H200, 2026-11-29); GPU: their kernels' time on the profiler's
    trace (``gpu_us``), what the op costs the device."""
    import jax
    import jax.numpy as jnp

    import gpurouter as gr

    mask = jnp.asarray(_mask(tokens))
    tpe = jnp.full((experts,), tokens * TOPK // experts, jnp.int32)
    fns = {
        "aux loss": lambda x, m: gr.fused_moe_aux_loss(x, tpe, TOPK, float(COEFF), token_mask=m, backend="numba"),
        "z-loss": lambda x, m: gr.router_z_loss(x, 1e-3, token_mask=m, backend="numba"),
    }
    key = jax.random.PRNGKey(experts)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (tokens, experts), jnp.dtype(dtype)) for i in range(batch)]
    out = []
    for op, fn in fns.items():
        for grad in (False, True):
            for masked in (False, True):
                m = mask if masked else None

                def one(x, fn=fn, m=m, grad=grad):
                    if not grad:
                        return fn(x, m)
                    return jax.value_and_grad(lambda y: fn(y, m).astype(jnp.float32))(x)

                f = jax.jit(lambda xs, one=one: [one(x) for x in xs])
                jax.block_until_ready(f(xs))
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(xs))
                    times.append(time.perf_counter() - t0)
                label = f"{op} {'value_and_grad' if grad else 'fwd'}"
                gus, per_kernel = gpu_us(f, xs, repeats)
                out.append((label, "masked" if masked else "unmasked", statistics.median(times) / batch * 1e6,
                            gus / batch, {k: v / batch for k, v in per_kernel.items()}))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--experts", default="256,384", help="comma-separated E (default 256,384)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=10, help="inputs per timed jitted call (default 10)")
    ap.add_argument("--no-ops", action="store_true", help="the kernels alone (no jax)")
    ap.add_argument("--tiling", default="",
                    help="knob=value,... of AuxLossTiling: the aux loss plans alone at that tiling (no ops)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                    help="the probs' (and the gradients') dtype (default bf16)")
    ap.add_argument("--op-kernels", action="store_true",
                    help="under each op row, its kernels' GPU time per op (names from the profiler trace)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    kind, jnp_dtype = DTYPES[args.dtype]
    tiling = parse_tiling(args.tiling)
    if L.simulator_enabled() or not cuda.is_available():
        raise SystemExit("loss_mask_breakdown: needs a GPU (not the CUDA simulator).")
    rng = np.random.default_rng(0)
    name = cuda.get_current_device().name
    report = {"tokens": args.tokens, "dtype": args.dtype,
              "device": name.decode() if isinstance(name, bytes) else str(name), "kernels": [], "ops": [], "ratios": []}
    t0 = time.perf_counter()
    for e in (int(v) for v in args.experts.split(",")):
        krows = kernel_rows(args.tokens, e, args.repeats, rng, tiling, aux_only=tiling is not None, kind=kind)
        base = {}
        print(f"# T={args.tokens} E={e} {args.dtype}, every 10th token masked: us per launch (median of {args.repeats})"
              + (f", aux loss tiling {tiling}" if tiling else ""))
        for name, variant, us, kernels in krows:
            total = sum(us)
            if variant == "unmasked":
                base[name] = total
            ratio = total / base[name] if name in base and base[name] > 0 else float("nan")
            steps = " + ".join(f"{k} {u:.2f}" for k, u in zip(kernels, us, strict=True))
            print(f"{name:8s} {variant:18s} {total:9.2f} us  ratio {ratio:5.2f}  [{steps}]", flush=True)
            report["kernels"].append(dict(experts=e, plan=name, variant=variant, us=us, kernels=kernels,
                                          total_us=total, ratio=ratio))
            if variant != "unmasked":
                report["ratios"].append(dict(experts=e, what=f"kernels {name} {variant}", ratio=ratio,
                                             ok=bool(ratio <= TARGET)))
        if not args.no_ops and tiling is None:
            base = {}
            for label, variant, us, gus, per_kernel in op_rows(args.tokens, e, args.repeats, args.batch, jnp_dtype):
                if variant == "unmasked":
                    base[label] = (us, gus)
                ratio, gratio = us / base[label][0], gus / base[label][1]
                print(f"op {label:22s} {variant:9s} wall {us:9.2f} us/op  ratio {ratio:5.2f}   "
                      f"GPU {gus:8.2f} us/op  ratio {gratio:5.2f}", flush=True)
                if args.op_kernels:
                    for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
                        print(f"     {v:8.2f} us/op  {k[:110]}")
                report["ops"].append(dict(experts=e, op=label, variant=variant, us=us, ratio=ratio, gpu_us=gus,
                                          gpu_ratio=gratio, gpu_kernels=per_kernel))
                if variant != "unmasked":  # the target is judged on the GPU time (the wall's noise: op_rows)
                    report["ratios"].append(dict(experts=e, what=f"op {label} (GPU time)", ratio=gratio,
                                                 ok=bool(gratio <= TARGET)))
    bad = [r for r in report["ratios"] if not r["ok"]]
    print(f"# {len(report['ratios']) - len(bad)} of {len(report['ratios'])} masked/unmasked ratios <= {TARGET} "
          f"({time.perf_counter() - t0:.1f} s)")
    for r in bad:
        print(f"#   over: E={r['experts']} {r['what']}: {r['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
