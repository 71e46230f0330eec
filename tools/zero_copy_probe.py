"""Where the time of one zero-copy call goes (GPU only): ``python tools/zero_copy_probe.py``.

Times, on the DeepSeek-V3 shape by default, the wall time per jitted call of:

1. ``x + 1`` on the logits (JAX's own dispatch and a trivial kernel);
2. a buffer_callback with the op's operands and results that does nothing;
3. the same callback that only reads the buffers' raw pointers;
4. the public op with ``backend="numba"`` (zero-copy);
5. the public op with ``backend="jax"``;

and the kernel time alone (CUDA events, as ``python -m gpurouter bench`` does),
so that the per-call overhead of each layer can be read off by difference.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import gpurouter as gr
from gpurouter import _callback as cb
from gpurouter.presets import PRESETS


def wall(fn, xs, repeats):
    jax.block_until_ready(fn(xs[0]))
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(xs[i % len(xs)]))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--sweep-aux-loss-bwd", action="store_true",
                    help="instead: kernel time of the aux-loss backward per grid / block size")
    args = ap.parse_args()
    if args.sweep_aux_loss_bwd:
        return sweep_aux_loss_bwd(args.tokens, PRESETS[args.preset].num_experts)
    p = PRESETS[args.preset]
    t, e = args.tokens, p.num_experts
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    xs = [jax.random.normal(k, (t, e), jnp.float32).astype(jnp.bfloat16) for k in keys]
    bias = jnp.linspace(-0.05, 0.05, e, dtype=jnp.float32) if p.expert_bias else None
    kw = p.router_kwargs()
    specs = (jax.ShapeDtypeStruct((t, e), jnp.uint16), jax.ShapeDtypeStruct((t, e), jnp.bool_),
             jax.ShapeDtypeStruct((t, e), jnp.float32))

    def noop(ctx, outs, *bufs):
        pass

    def pointers(ctx, outs, *bufs):
        [cb._ptr(b) for b in bufs]
        [cb._ptr(o) for o in outs]

    def via(fn):
        call = buffer_callback(fn, specs)
        return jax.jit(lambda x: call(jax.lax.bitcast_convert_type(x, jnp.uint16)))

    rows = [
        ("x + 1", jax.jit(lambda x: x + 1)),
        ("buffer_callback, empty body", via(noop)),
        ("buffer_callback, raw pointers", via(pointers)),
        ("op, numba zero-copy", jax.jit(lambda x: gr.fused_topk_with_score_function(
            x, expert_bias=bias, **kw, backend="numba", transport="zero-copy"))),
        ("op, jax", jax.jit(lambda x: gr.fused_topk_with_score_function(x, expert_bias=bias, **kw,
                                                                          backend="jax"))),
    ]
    print(f"{args.preset} T={t} E={e}  {jax.devices()[0].device_kind}")
    for name, fn in rows:
        print(f"{name:<34}{wall(fn, xs, args.repeats):>10.1f} us / call")
    body = []
    inner = cb._device_call

    def timed(*a):
        s = time.perf_counter()
        inner(*a)
        body.append(time.perf_counter() - s)

    cb._device_call = timed
    wall(rows[3][1], xs, args.repeats)
    print(f"{'callback body (median)':<34}{statistics.median(body) * 1e6:>10.1f} us / call")
    # The body step by step (unbatched calls only): where its time goes.
    parts = {k: [] for k in ("pointers", "plan", "launch", "  of which cuLaunchKernel")}
    pushed = []

    def split(planner, n_token, n_out, bufs, outs, stream):
        t0 = time.perf_counter()
        ins = [cb._ptr(b) for b in bufs]
        os = [cb._ptr(o) for o in outs]
        t1 = time.perf_counter()
        plan = cb._plan_of(planner, ins)
        run = cb._pointer_launch(plan, cb._ordinal(ins[0].ptr))
        t2 = time.perf_counter()
        run([a.ptr for a in ins] + [o.ptr for o in os], stream)
        t3 = time.perf_counter()
        cur = ctypes.c_void_p()
        run._lib.cuCtxGetCurrent(ctypes.byref(cur))
        pushed.append(cur.value != run.context)
        handle, grid, block, shared, argv, _, _ = run.steps[0]  # the same launch again, timed alone
        t4 = time.perf_counter()
        run._lib.cuLaunchKernel(handle, grid, 1, 1, block, 1, 1, shared, stream or None, argv, None)
        t5 = time.perf_counter()
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
            parts[k].append(dt)

    cb._device_call = split
    wall(rows[3][1], xs, args.repeats)
    cb._device_call = inner
    for k, v in parts.items():
        print(f"{'  ' + k + ' (median)':<34}{statistics.median(v) * 1e6:>10.1f} us / call")
    print(f"  another context was current in {sum(pushed)} of {len(pushed)} callbacks")
    np.asarray(rows[3][1](xs[0])[0])  # results are checked by the test suite, not here


def sweep_aux_loss_bwd(t, e):
    from numba import cuda

    from gpurouter import bench
    from gpurouter.kernels import _launch as L
    from gpurouter.kernels import aux_loss as A

    tpe = cuda.to_device(np.arange(e, dtype=np.int32))
    coeff, gl = cuda.to_device(np.ones(1, np.float32)), cuda.to_device(np.ones(1, np.float32))
    out = cuda.device_array((t, e), np.float32)
    for blocks in (256, 512, 1024, 2048):
        for threads in (256, 512, 1024):
            A._PARTIAL_BLOCKS, A._BLOCK = blocks // 2, threads
            A.moe_aux_loss_bwd_plan.cache_clear()
            plan = A.moe_aux_loss_bwd_plan(L.spec_for((e,), np.int32), L.spec_of((), L.F32), t)
            k, _ = bench._kernel_times(lambda *a, plan=plan: plan, 0, [[coeff, tpe, gl]], [out], 100)
            print(f"aux loss bwd T={t} E={e}: {plan.steps[0].grid:>5} blocks x {plan.steps[0].block:>4} threads"
                  f"{k * 1e6:>9.1f} us")


if __name__ == "__main__":
    main()
