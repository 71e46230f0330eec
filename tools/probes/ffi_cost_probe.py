"""What the ``"ffi"`` transport's per-op cost is made of (GPU; issue #16).

``python -m gpurouter steps`` times ``out = 2 x + y`` on float32[n] in a jitted
``fori_loop``, through ``kernel_call(..., "ffi")`` and as an XLA fusion; the
ffi cost is the difference. This probe times variants that each change one
thing, side by side in one process: every loop is compiled and grown first,
then the variants are timed in turns (round r of every variant, then round
r + 1), and the rounds' first and second halves are reported apart (``A``,
``B``: the method's own noise).

XLA side (what surrounds the call):

- ``fusion``, ``ffi``: the bench's two loops as they are (``y`` closed over);
- ``fusion_arg``, ``ffi_arg``: the same with ``y`` an argument of the loop;
- ``fusion_u2``, ``ffi_u2``: ``*_arg`` with the loop unrolled by 2 (``unroll=2``:
  the first call's result goes to a temporary, the second's to the loop
  carry, so XLA needs no copy of the result into the carry). Not the same
  work: XLA fuses the two unrolled ``2 c + y`` into one kernel, the two
  calls stay two launches, so this cost counts about half a launch more
  than ``alias``'s;
- ``direct``: ``jax.ffi.ffi_call`` of gpurouter's handler and record, no
  ``kernel_call``/``custom_vmap`` wrapper;
- ``alias``: ``direct`` with the result aliased to ``x`` (no copy of the
  result into the loop carry; right for this op only: each thread reads x[i]
  and writes out[i]);
- ``noop``: a handler that launches nothing (XLA's own cost of the call).

Handler side (``direct``'s HLO, other handlers registered under other names),
each run under a wrapper that reads CLOCK_MONOTONIC around the handler, which
gives the host ns per call of the handler itself inside XLA's loop (``t_``):

- ``t_noop``: the clock's own cost; ``t_direct``: gpurouter's handler;
- ``t_min``: stream query, the buffers' addresses written into a static
  parameter block, ``cuLaunchKernel`` (what the earlier probe's handler did);
- ``t_min_ordinal``, ``t_min_ctx``, ``t_min_attr``, ``t_min_copy``: ``t_min``
  plus one of gpurouter's steps (the device-ordinal query, the
  ``cuCtxGetCurrent`` check, the ``plan`` attribute lookup, the parameter
  template copied to the stack); ``t_min_all``: all four;
- ``t_min_func``: ``t_min`` launching the kernel as a CUfunction
  (``cuKernelGetFunction``) instead of numba's CUkernel.

    python3 tools/probes/ffi_cost_probe.py --json out.json [--variants fusion,ffi,...]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gpurouter._transport import ffi
from gpurouter._transport import ffi_abi as abi
from gpurouter._transport.ffi_record import _RECORDS, DEVICES, MAX_PARAMS, _driver, _gpu_ordinals
from gpurouter.bench.steps import _axpy_op, _diff_us, _loops

#: the tool's handlers read the current size's device block here: [device block,
#: static parameter block, static argv] (addresses), and the kernel as a CUfunction
CUR = np.zeros(4, np.int64)
STATIC = np.zeros(MAX_PARAMS, np.int64)
ARGV = np.zeros(MAX_PARAMS, np.int64)
STATS: dict[str, np.ndarray] = {}  # timed variant -> [ns, calls]
_KEEP: list = []  # the cfuncs: XLA keeps their raw addresses
FAIL_MSG = np.frombuffer(b"ffi_cost_probe: cuLaunchKernel failed\0", np.uint8).copy()


def make_handler(launch=True, ordinal=False, ctx=False, attr=False, copy=False, func=False):
    """A handler for the bench's axpy plan, with the named steps of gpurouter's."""
    from numba import cfunc, types

    ld8, ld32, ld64, st8, st32, st64, scratch, caller = abi.intrinsics()
    call_api, call1 = caller(("i64", "i64")), caller(("i32", "i64"))
    do_launch = caller(("i32", "i64", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i64", "i64", "i64"))
    launch_fn, get_ctx, push, pop = _driver()
    cur, fail_msg = int(CUR.ctypes.data), int(FAIL_MSG.ctypes.data)
    plan_name = int.from_bytes(b"plan", "little")

    def handler(frame):
        ext = ld64(frame + abi.CF_EXTENSION)
        if ext != 0 and ld32(ext + abi.EXT_TYPE) == abi.EXTENSION_METADATA:
            md = ld64(ext + abi.EXT_METADATA)
            st64(md + abi.MD_VERSION_STRUCT_SIZE, abi.VERSION_SIZE)
            st64(md + abi.MD_VERSION_STRUCT_SIZE + 8, 0)
            st32(md + abi.MD_VERSION_MAJOR, abi.DECLARED_VERSION[0])
            st32(md + abi.MD_VERSION_MINOR, abi.DECLARED_VERSION[1])
            st32(md + abi.MD_TRAITS, 0)
            return 0
        if not launch:
            return 0
        api, xctx = ld64(frame + abi.CF_API), ld64(frame + abi.CF_CTX)
        query, current = scratch(4), scratch(1)
        st64(query, abi.STREAM_SIZE)
        st64(query + 8, 0)
        st64(query + abi.QUERY_CTX, xctx)
        st64(query + abi.QUERY_OUT, 0)
        err = call_api(ld64(api + abi.API_STREAM_GET), (query,))
        if err != 0:
            return err
        stream = ld64(query + abi.QUERY_OUT)
        if ordinal:
            st64(query, abi.ORDINAL_SIZE)
            st64(query + abi.QUERY_OUT, 0)
            err = call_api(ld64(api + abi.API_DEVICE_ORDINAL_GET), (query,))
            if err != 0 or ld32(query + abi.QUERY_OUT) < 0:
                return err
        if attr:
            rec = 0
            for i in range(ld64(frame + abi.CF_ATTRS_SIZE)):
                name = ld64(ld64(frame + abi.CF_ATTRS_NAMES) + 8 * i)
                a = ld64(ld64(frame + abi.CF_ATTRS_ATTRS) + 8 * i)
                if (ld64(name + abi.SPAN_LEN) == 4 and ld32(ld64(name + abi.SPAN_PTR)) == plan_name
                        and ld32(ld64(frame + abi.CF_ATTRS_TYPES) + 4 * i) == abi.ATTR_SCALAR
                        and ld32(a + abi.SCALAR_DTYPE) == abi.DTYPE_S64):
                    rec = ld64(ld64(a + abi.SCALAR_VALUE))
            if rec == 0:
                return 0
        dev = ld64(cur)
        pushed = False
        if ctx:
            st64(current, 0)
            call1(get_ctx, (current,))
            pushed = ld64(current) != ld64(dev)
            if pushed:
                call1(push, (ld64(dev),))
        w = dev + 16  # the plan's one step
        n_params = ld64(w + 32)
        params, argv = ld64(cur + 8), ld64(cur + 16)
        stack_params, stack_argv = scratch(MAX_PARAMS), scratch(MAX_PARAMS)
        if copy:
            params, argv = stack_params, stack_argv
            for j in range(n_params):
                st64(params + 8 * j, ld64(w + 48 + 8 * j))
                st64(argv + 8 * j, params + 8 * j)
        holes = w + 48 + 8 * n_params
        for h in range(3):  # in 0, in 1, out 0
            array = ld64(holes + 16 * h + 8)
            buf = ld64(ld64(frame + abi.CF_ARGS_ARGS) + 8 * array) if array < 2 else ld64(
                ld64(frame + abi.CF_RETS_RETS))
            st64(params + 8 * ld64(holes + 16 * h), ld64(buf + abi.BUF_DATA))
        kernel = ld64(cur + 24) if func else ld64(w)
        status = do_launch(launch_fn, (kernel, ld64(w + 8), 1, 1, ld64(w + 16), 1, 1, ld64(w + 24), stream, argv, 0))
        if pushed:
            call1(pop, (current,))
        if status != 0:
            args = scratch(4)
            st64(args, abi.ERR_SIZE)
            st64(args + 8, 0)
            st64(args + abi.ERR_MESSAGE, fail_msg)
            st32(args + abi.ERR_ERRC, abi.ERROR_INTERNAL)
            return call_api(ld64(api + abi.API_ERROR_CREATE), (args,))
        return 0

    return cfunc(types.int64(types.int64), nopython=True)(handler)


def make_timed(inner, stats: np.ndarray):
    """``inner`` (a cfunc) under a wrapper that adds the host ns it takes per
    call to ``stats[0]`` and counts calls in ``stats[1]``."""
    from numba import cfunc, types

    ld8, ld32, ld64, st8, st32, st64, scratch, caller = abi.intrinsics()
    call, clock = caller(("i64", "i64")), caller(("i32", "i32", "i64"))
    inner_addr, out = int(inner.address), int(stats.ctypes.data)
    clock_gettime = ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value

    def timed(frame):
        ext = ld64(frame + abi.CF_EXTENSION)
        if ext != 0 and ld32(ext + abi.EXT_TYPE) == abi.EXTENSION_METADATA:
            return call(inner_addr, (frame,))
        ts = scratch(2)
        clock(clock_gettime, (1, ts))  # CLOCK_MONOTONIC
        t0 = ld64(ts) * 1_000_000_000 + ld64(ts + 8)
        r = call(inner_addr, (frame,))
        clock(clock_gettime, (1, ts))
        st64(out, ld64(out) + ld64(ts) * 1_000_000_000 + ld64(ts + 8) - t0)
        st64(out + 8, ld64(out + 8) + 1)
        return r

    return cfunc(types.int64(types.int64), nopython=True)(timed)


HANDLERS = {"noop": dict(launch=False), "t_noop": dict(launch=False), "t_min": {},
            "t_min_ordinal": dict(ordinal=True), "t_min_ctx": dict(ctx=True), "t_min_attr": dict(attr=True),
            "t_min_copy": dict(copy=True), "t_min_all": dict(ordinal=True, ctx=True, attr=True, copy=True),
            "t_min_func": dict(func=True)}
VARIANTS = ("fusion", "ffi", "fusion_arg", "ffi_arg", "fusion_u2", "ffi_u2", "direct", "alias", "noop", "t_noop",
            "t_direct", "t_min", "t_min_ordinal", "t_min_ctx", "t_min_attr", "t_min_copy", "t_min_all", "t_min_func")


def register(variants) -> None:
    ffi._register()
    for v in variants:
        if v in HANDLERS or v == "t_direct":
            h = ffi._handler() if v == "t_direct" else make_handler(**HANDLERS[v])
            if v.startswith("t_"):
                STATS[v] = np.zeros(2, np.int64)
                _KEEP.append(h)
                h = make_timed(h, STATS[v])
            _KEEP.append(h)
            jax.ffi.register_ffi_target(f"probe_{v}", jax.ffi.pycapsule(h.address), platform="CUDA")


def select_size(op, n: int) -> int:
    """Points the tool's handlers at the bench plan for float32[n]; returns its record's address."""
    from gpurouter.kernels._base.plan import spec_for

    spec = spec_for((n,), np.dtype(np.float32))
    plan = op.planner(spec, spec)
    address = ffi._record(plan)
    record = _RECORDS[id(plan)][0]
    start = int(record[DEVICES + _gpu_ordinals()[0]])  # jax.devices()[0]'s GPU
    step = record[start + 2:]
    STATIC[: step[4]] = step[6: 6 + step[4]]
    ARGV[:] = STATIC.ctypes.data + 8 * np.arange(MAX_PARAMS)
    CUR[:] = (address + 8 * start, STATIC.ctypes.data, ARGV.ctypes.data, function_of(int(step[0])))
    return address


def function_of(kernel: int) -> int:
    """numba's kernel handle (a CUkernel) as a CUfunction of the first GPU's
    primary context (``kernels._context.function_of``), printed."""
    from gpurouter.kernels._base.context import function_of as resolve
    from gpurouter.kernels._base.context import on_gpu

    ordinal = _gpu_ordinals()[0]
    with on_gpu(ordinal):
        fn = resolve(kernel, ordinal)
    print(f"kernel {kernel:#x} -> function {fn:#x}", flush=True)
    return fn


def body(v: str, op, n: int, address: int):
    """``(c, y) -> 2 c + y`` for variant ``v``."""
    if v.startswith("fusion"):
        return lambda c, y: 2.0 * c + y
    if v.startswith("ffi"):
        return lambda c, y: op(c, y, "ffi")
    target = ffi.TARGET if v in ("direct", "alias") else f"probe_{v}"
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((n,), jnp.float32),
                            input_output_aliases={0: 0} if v == "alias" else None)
    return lambda c, y: call(c, y, plan=np.int64(address))


def loop_maker(v: str, f, y):
    """``make(k)``: the jitted-loop function of ``k`` steps (named ``loop_<v>``
    for XLA's dumps); ``y`` closed over for ``fusion`` and ``ffi``, else an
    argument; unrolled by 2 for ``*_u2``."""
    unroll = 2 if v.endswith("_u2") else 1

    def make(k):
        if v in ("fusion", "ffi"):
            def loop(c):
                return lax.fori_loop(0, k, lambda i, c: f(c, y), c)
        else:
            def loop(xy):
                return lax.fori_loop(0, k, lambda i, c: f(c, xy[1]), xy[0], unroll=unroll)
        loop.__name__ = loop.__qualname__ = f"loop_{v}"
        return loop
    return make


def run_size(op, n: int, variants, rounds: int, min_loop_s: float) -> dict:
    address = select_size(op, n)
    x, y = jnp.ones((n,), jnp.float32), jnp.full((n,), 1e-6, jnp.float32)
    xr = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32)
    yr = jax.random.normal(jax.random.PRNGKey(1), (n,), jnp.float32)
    want = np.asarray(2.0 * xr + yr)
    prepared, out = {}, {}
    for v in variants:
        try:
            f = body(v, op, n, address)
            err = None if v in ("noop", "t_noop") else float(np.max(np.abs(np.asarray(jax.jit(f)(xr, yr)) - want)))
            arg = x if v in ("fusion", "ffi") else (x, y)
            steps, loops = _loops(loop_maker(v, f, y), arg, 1000, min_loop_s)
        except Exception as e:  # noqa: BLE001 (report it, time the others)
            print(f"n={n} {v}: {type(e).__name__}: {e}", flush=True)
            continue
        prepared[v] = (steps, loops, arg)
        out[v] = {"max_err": err, "loop_steps": steps, "us": []}
    for s in STATS.values():
        s[:] = 0
    for _ in range(rounds):
        for v, (steps, loops, arg) in prepared.items():
            out[v]["us"].append(_diff_us(steps, loops, arg))
    for v, r in out.items():
        us = r["us"]
        r.update(A=statistics.median(us[: rounds // 2]), B=statistics.median(us[rounds // 2:]),
                 median=statistics.median(us))
        if v in STATS and STATS[v][1]:
            r["handler_ns"] = float(STATS[v][0] / STATS[v][1])
    for v, r in out.items():  # the cost over the fusion with y passed the same way
        base = out.get("fusion" if v in ("fusion", "ffi") else "fusion_u2" if v.endswith("_u2") else "fusion_arg")
        if base is not None and base is not r:
            r.update(cost=r["median"] - base["median"], cost_A=r["A"] - base["A"], cost_B=r["B"] - base["B"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,1048576")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (even: halves A and B)")
    ap.add_argument("--min-loop-ms", type=float, default=20.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    variants = args.variants.split(",")
    assert set(variants) <= set(VARIANTS), set(variants) - set(VARIANTS)
    from gpurouter.bench.router import _gpu_info

    res = {"info": _gpu_info(), "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
           "commit": os.environ.get("GPUROUTER_COMMIT"), "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
           "sizes": {}}
    op = _axpy_op()
    t = time.perf_counter()
    register(variants)
    res["handlers_compile_s"] = time.perf_counter() - t
    for n in (int(s) for s in args.sizes.split(",")):
        r = res["sizes"][n] = run_size(op, n, variants, args.rounds, args.min_loop_ms / 1000)
        print(f"n={n}  us per step (A / B / median), cost over the fusion (same y), handler ns in XLA's loop")
        for v, row in r.items():
            cost = f"{row['cost']:7.2f} ({row['cost_A']:6.2f} /{row['cost_B']:6.2f})" if "cost" in row else ""
            ns = f"{row['handler_ns']:8.0f} ns" if "handler_ns" in row else ""
            print(f"  {v:14s} {row['A']:7.2f} / {row['B']:7.2f} / {row['median']:7.2f}  {cost:28s} {ns}"
                  f"  err {row['max_err']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
