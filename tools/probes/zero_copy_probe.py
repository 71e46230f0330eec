"""Where the time of one zero-copy call goes (GPU only): ``python tools/probes/zero_copy_probe.py``.

Times, on the DeepSeek-V3 shape by default, the wall time per jitted call of:

1. ``x + 1`` on the logits (JAX's own dispatch and a trivial kernel);
2. a buffer_callback with the op's operands and results that does nothing;
3. the same callback that only reads the buffers' raw pointers;
4. the public op with ``backend="numba"`` (zero-copy);
5. the public op with ``backend="jax"``;

so that the per-call overhead of each layer can be read off by difference;
then the Python of the op's callback body, whole and step by step.
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
from gpurouter._transport import buffer as cb
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
    args = ap.parse_args()
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
        [b.__cuda_array_interface__["data"][0] for b in bufs]
        [o.__cuda_array_interface__["data"][0] for o in outs]

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
    # The body step by step (calls seen before: the buffer transport.s direct path).
    parts = {k: [] for k in ("array interfaces", "cached-launch lookup", "launch",
                             "  of which cuLaunchKernel", "  of which cuCtxGetCurrent")}
    pushed = []

    def split(planner, n_token, n_out, bufs, outs, stream):
        t0 = time.perf_counter()
        cais = [b.__cuda_array_interface__ for b in bufs] + [o.__cuda_array_interface__ for o in outs]
        ptrs = [c["data"][0] for c in cais]
        t1 = time.perf_counter()
        key = (planner, n_token, n_out, cb._ordinal(ptrs[0]), *((c["shape"], c["typestr"]) for c in cais))
        run = cb._DIRECT.get(key)
        t2 = time.perf_counter()
        if run is None:  # first call of this shape (or not a direct one): the real body
            inner(planner, n_token, n_out, bufs, outs, stream)
            return
        run(ptrs, stream)
        t3 = time.perf_counter()
        cur = ctypes.c_void_p()
        run._lib.cuCtxGetCurrent(ctypes.byref(cur))
        pushed.append(cur.value != run.context)
        handle, grid, block, shared, argv, _, _ = run.steps[0]  # the same launch again, timed alone
        t4 = time.perf_counter()
        run._lib.cuLaunchKernel(handle, grid, 1, 1, block, 1, 1, shared, stream or None, argv, None)
        t5 = time.perf_counter()
        run._lib.cuCtxGetCurrent(ctypes.byref(cur))
        t6 = time.perf_counter()
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t6 - t5), strict=True):
            parts[k].append(dt)

    cb._device_call = split
    wall(rows[3][1], xs, args.repeats)
    cb._device_call = inner
    for k, v in parts.items():
        print(f"{'  ' + k + ' (median)':<34}{statistics.median(v) * 1e6:>10.1f} us / call")
    print(f"  another context was current in {sum(pushed)} of {len(pushed)} callbacks")
    np.asarray(rows[3][1](xs[0])[0])  # results are checked by the test suite, not here


if __name__ == "__main__":
    main()
