"""Token-level MoE kernels on the GPU (issue #18): each op's kernels against
its byte floor, and the jitted op on ``backend="numba"`` against the jitted
jnp reference, at the issue's shapes.

``python tools/probes/moe_bench.py [--shapes qwen3,deepseek-v3,qwen3@1024] [--repeats 50]
[--peak 4.0] [--json out.json] [--kernels-only] [--commit C]``

``--kernels-only`` times the plans' kernels alone: no jitted jnp reference or
public op (whose XLA compiles take minutes at the DeepSeek-V3-like shape).

Shapes: Qwen3-30B-A3B-like ``T=8192 H=2048 E=128 K=8`` and DeepSeek-V3-like
``T=4096 H=7168 E=256 K=8``; every token routed to K distinct random experts,
``N = T K`` dispatched rows, bf16 activations, fp32 probs.  Per op:

- ``kernel_us``: the plan's kernels alone, the way the zero-copy transport runs
  them (``_pointer.PointerLaunch`` on raw pointers), CUDA events around each
  launch behind a sleep kernel (``gpurouter/bench/timing.py``), median of ``--repeats``,
  inputs rotated over two sets;
- ``floor_us``: the op's compulsory bytes (every input read once, every output
  written once; scratch not counted) at ``--peak`` TB/s, and at the measured
  device-to-device copy rate (``floor_copy_us``);
- ``numba_us`` / ``jax_us``: the public op jitted, ``backend="numba"``
  (transport "auto") and ``"jax"``, wall time per call over batches of calls
  (median), what a user's step sees; ``speedup = jax_us / numba_us``;
- ``max_rel_err`` against the reference, and ``bit_identical`` over two runs
  (grouped dbias/dscales).

``token_combine`` and ``token_dispatch`` are timed forward (``fwd``) and
forward + backward (``fwd_bwd``: ``jax.vjp`` and its application); their
backward kernels alone are ``bwd`` (``kernel_us`` only); the dispatch's
``kernel_us`` is its row copy (its index maps are jnp, in ``numba_us``).
``dispatch+combine.fwd_bwd`` sums the two (the issue's <= 1.5x floor target).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # numba allocates beside JAX

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from gpurouter import kernels as K  # noqa: E402
from gpurouter import moe as mo  # noqa: E402
from gpurouter.bench.timing import median_us, ptr, spin_kernel  # noqa: E402
from gpurouter.kernels._base import pointer as _pointer  # noqa: E402
from gpurouter.kernels._base.plan import spec_for  # noqa: E402
from gpurouter.reference import moe_ops as ref  # noqa: E402

SHAPES = {"qwen3": dict(T=8192, H=2048, E=128, K=8), "deepseek-v3": dict(T=4096, H=7168, E=256, K=8),
          "tiny": dict(T=256, H=512, E=16, K=2)}  # tiny: a quick smoke run
BF16 = ml_dtypes.bfloat16


def copy_tbps(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy rate (read + write bytes per second), TB/s."""
    src = cuda.device_array(nbytes // 4, np.float32)
    dst = cuda.device_array(nbytes // 4, np.float32)
    dst.copy_to_device(src)
    cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = cuda.event(), cuda.event()
        a.record()
        dst.copy_to_device(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * nbytes / statistics.median(times) / 1e12


def jax_us(f, args, repeats: int) -> float:
    """Median wall microseconds per call of jitted ``f`` (batches of 10 calls)."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(max(3, repeats // 10)):
        t0 = time.perf_counter()
        for _ in range(10):
            r = f(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t0) / 10 * 1e6)
    return statistics.median(times)


def kernel_us(plan, in_sets, repeats: int, spin) -> float:
    """The plan's kernels alone on raw pointers; ``in_sets``: lists of numba device inputs."""
    outs = [cuda.device_array(s.shape, s.dtype) for s in plan.outs]
    tmps = [cuda.device_array(s.shape, s.dtype) for s in plan.tmps]
    launch = _pointer.PointerLaunch(plan, 0)
    sets = [[ptr(a) for a in (*ins, *outs, *tmps)] for ins in in_sets]
    return median_us(launch, sets, repeats, spin)


def _dev(x):
    x = np.ascontiguousarray(x)
    return cuda.to_device(x.view(np.uint16) if x.dtype == BF16 else x)


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _entry(nbytes, peak, copy, k_us=None, **kw):
    floor = nbytes / (peak * 1e12) * 1e6
    e = dict(bytes=int(nbytes), floor_us=floor, floor_copy_us=nbytes / (copy * 1e12) * 1e6, **kw)
    if k_us is not None:
        e.update(kernel_us=k_us, kernel_x_floor=k_us / floor)
    if "jax_us" in kw and "numba_us" in kw:
        e["speedup"] = kw["jax_us"] / kw["numba_us"]
    return e


def _public_ops(m, x, probs, rid, jz, jdy, n, repeats) -> dict:
    """The jitted public ``token_combine`` / ``token_dispatch`` on both backends:
    wall microseconds and the numba results' error against the jnp ones."""

    def fwd(backend):
        return jax.jit(lambda z, r, w: mo.token_combine(z, r, w, backend=backend))

    def fwd_bwd(backend):
        def f(z, r, w, g):
            out, vjp = jax.vjp(lambda a, b: mo.token_combine(a, r, b, backend=backend), z, w)
            return out, vjp(g)

        return jax.jit(f)

    fj, fn, bj, bn = fwd("jax"), fwd("numba"), fwd_bwd("jax"), fwd_bwd("numba")
    args = (jz, rid, probs)
    err_b = max(_rel_err(a, b) for a, b in zip(bn(*args, jdy)[1], bj(*args, jdy)[1], strict=True))
    out = dict(cf=dict(numba_us=jax_us(fn, args, repeats), jax_us=jax_us(fj, args, repeats),
                       max_rel_err=_rel_err(fn(*args), fj(*args))),
               cb=dict(max_rel_err=err_b),
               cfb=dict(numba_us=jax_us(bn, (*args, jdy), repeats), jax_us=jax_us(bj, (*args, jdy), repeats)))
    mj = jnp.asarray(m)

    def dfwd(backend):
        return jax.jit(lambda a, p: mo.token_dispatch(a, mj, n, p, backend=backend)[:2])

    def dfb(backend):
        def f(a, p, g):
            res, vjp = jax.vjp(lambda u, v: mo.token_dispatch(u, mj, n, v, backend=backend)[:2], a, p)
            return res, vjp((g, jnp.zeros((n,), jnp.float32)))

        return jax.jit(f)

    dj, dn, dbj, dbn = dfwd("jax"), dfwd("numba"), dfb("jax"), dfb("numba")
    out["df"] = dict(numba_us=jax_us(dn, (x, probs), repeats), jax_us=jax_us(dj, (x, probs), repeats),
                     max_rel_err=max(_rel_err(a, b) for a, b in zip(dn(x, probs), dj(x, probs), strict=True)))
    out["db"] = dict(max_rel_err=max(_rel_err(a, b) for a, b in zip(dbn(x, probs, jz)[1], dbj(x, probs, jz)[1],
                                                                     strict=True)))
    out["dfb"] = dict(numba_us=jax_us(dbn, (x, probs, jz), repeats), jax_us=jax_us(dbj, (x, probs, jz), repeats))
    return out


def run_shape(name, T, H, E, K_, repeats, peak, copy, spin, kernels_only=False):  # noqa: N803  (the issue's letters)
    rng = np.random.default_rng(0)
    n = T * K_
    m = np.zeros((T, E), bool)
    for t in range(T):
        m[t, rng.permutation(E)[:K_]] = True
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    probs = jnp.asarray(np.where(m, rng.random((T, E)), 0.0), jnp.float32)
    _, _, rid, _, tpe = ref.token_dispatch(x, jnp.asarray(m), n, probs)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(tpe))]).astype(np.int32)
    res = {}

    # --- grouped dbias / dscales: dy [N, H] bf16, scales [N] f32, bias [E, H] bf16
    dys = [rng.standard_normal((n, H)).astype(BF16) for _ in range(2)]
    sc = rng.random(n).astype(np.float32)
    bias = rng.standard_normal((E, H)).astype(BF16)
    plan = K.grouped_dbias_dscales_plan(*(spec_for(a.shape, np.uint16 if a.dtype == BF16 else a.dtype)
                                          for a in (dys[0], sc, bias, offsets)))
    ins = [[_dev(d), _dev(sc), _dev(bias), _dev(offsets)] for d in dys]
    nbytes = n * H * 2 + n * 4 + E * H * 2 + (E + 1) * 4 + E * H * 4 + n * 4
    k_us = kernel_us(plan, ins, repeats, spin)
    steps = [(s.grid, s.block) for s in plan.steps]
    plan = K.grouped_dbias_dscales_plan(spec_for((n, H), np.uint16), None, None, spec_for((E + 1,), np.int32))
    k_db = kernel_us(plan, [[i[0], i[3]] for i in ins], repeats, spin)
    db_bytes = n * H * 2 + (E + 1) * 4 + E * H * 4
    if kernels_only:
        res["compute_grouped_dbias_dscales"] = _entry(nbytes, peak, copy, k_us, steps=steps)
        res["compute_grouped_dbias"] = _entry(db_bytes, peak, copy, k_db)
    else:
        j = [jnp.asarray(a) for a in (dys[0], sc, bias, offsets)]
        f_jax = jax.jit(ref.compute_grouped_dbias_dscales)
        f_nb = jax.jit(functools.partial(mo.compute_grouped_dbias_dscales, backend="numba"))
        want = f_jax(*j)
        got, again = f_nb(*j), f_nb(*j)
        res["compute_grouped_dbias_dscales"] = _entry(
            nbytes, peak, copy, k_us, numba_us=jax_us(f_nb, j, repeats), jax_us=jax_us(f_jax, j, repeats),
            max_rel_err=max(_rel_err(a, b) for a, b in zip(got, want, strict=True)),
            bit_identical=all(bool(jnp.array_equal(a, b)) for a, b in zip(got, again, strict=True)), steps=steps)
        f_jax = jax.jit(functools.partial(ref.compute_grouped_dbias, num_groups=E))
        f_nb = jax.jit(functools.partial(mo.compute_grouped_dbias, num_groups=E, backend="numba"))
        jd = [j[0], j[3]]
        res["compute_grouped_dbias"] = _entry(
            db_bytes, peak, copy, k_db, numba_us=jax_us(f_nb, jd, repeats), jax_us=jax_us(f_jax, jd, repeats),
            max_rel_err=_rel_err(f_nb(*jd), f_jax(*jd)))
    del ins

    # --- token_combine: z [N, H] bf16 (expert outputs), row_id_map [T, E], probs [T, E] f32
    zs = [rng.standard_normal((n, H)).astype(BF16) for _ in range(2)]
    dy = rng.standard_normal((T, H)).astype(BF16)
    zspec, rspec, wspec = spec_for((n, H), np.uint16), spec_for((T, E), np.int32), spec_for((T, E), np.float32)
    fplan = K.token_combine_fwd_plan(zspec, rspec, wspec)
    bplan = K.token_combine_bwd_plan(spec_for((T, H), np.uint16), zspec, rspec, wspec)
    d_rid, d_w, d_dy = _dev(np.asarray(rid, np.int32)), _dev(np.asarray(probs)), _dev(dy)
    d_zs = [_dev(z) for z in zs]
    fbytes = n * H * 2 + 2 * T * E * 4 + T * H * 2
    bbytes = T * H * 2 + n * H * 2 + 2 * T * E * 4 + n * H * 2 + T * E * 4
    k_f = kernel_us(fplan, [[z, d_rid, d_w] for z in d_zs], repeats, spin)
    k_b = kernel_us(bplan, [[d_dy, z, d_rid, d_w] for z in d_zs], repeats, spin)
    # --- token_dispatch: the row copy; its backward's kernel is the unweighted combine
    xs = [rng.standard_normal((T, H)).astype(BF16) for _ in range(2)]
    dplan = K.token_dispatch_fwd_plan(spec_for((T, H), np.uint16), rspec, n)
    k_d = kernel_us(dplan, [[_dev(a), d_rid] for a in xs], repeats, spin)
    cplan = K.token_combine_fwd_plan(zspec, rspec)
    k_db = kernel_us(cplan, [[z, d_rid] for z in d_zs], repeats, spin)
    copy_bytes = T * H * 2 + T * E * 4 + n * H * 2  # inp, the map, the output rows
    dbytes = T * E + copy_bytes + T * E * 4 + n * 4 + T * E * 4  # + routing map, probs, permuted probs, row_id_map
    bwd_bytes = n * H * 2 + T * E * 4 + T * H * 2
    jx = {} if kernels_only else _public_ops(m, x, probs, rid, jnp.asarray(zs[0]), jnp.asarray(dy), n, repeats)
    res["token_combine.fwd"] = _entry(fbytes, peak, copy, k_f, **jx.get("cf", {}))
    res["token_combine.bwd"] = _entry(bbytes, peak, copy, k_b, **jx.get("cb", {}),
                                      steps=[(s.grid, s.block) for s in bplan.steps])
    res["token_combine.fwd_bwd"] = _entry(fbytes + bbytes, peak, copy, k_f + k_b, **jx.get("cfb", {}))
    res["token_dispatch.fwd"] = _entry(dbytes, peak, copy, k_d, **jx.get("df", {}),
                                       kernel="the row copy alone (index maps: jnp)")
    res["token_dispatch.bwd"] = _entry(bwd_bytes, peak, copy, k_db, **jx.get("db", {}))
    res["token_dispatch.fwd_bwd"] = _entry(dbytes + bwd_bytes, peak, copy, k_d + k_db, **jx.get("dfb", {}))
    both = ("token_dispatch.fwd_bwd", "token_combine.fwd_bwd")
    res["dispatch+combine.fwd_bwd"] = _entry(
        sum(res[k]["bytes"] for k in both), peak, copy, sum(res[k]["kernel_us"] for k in both),
        **({} if kernels_only else {f: sum(res[k][f] for k in both) for f in ("numba_us", "jax_us")}))
    for op, e in res.items():
        parts = [f"{k}={v:.1f}" if isinstance(v, float) and k.endswith("us") else f"{k}={v:.3g}"
                 for k, v in e.items() if isinstance(v, float)]
        print(f"{name:>12} {op:<32} " + " ".join(parts), flush=True)
    return dict(name=name, T=T, H=H, E=E, K=K_, rows=n, ops=res)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,deepseek-v3")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--peak", type=float, default=4.0, help="TB/s of the byte floor")
    ap.add_argument("--json")
    ap.add_argument("--kernels-only", action="store_true",
                    help="time the plans' kernels alone (no jitted jnp / public-op timings: no slow XLA compiles)")
    ap.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD here; a staged copy "
                                     "outside its repository should name it)")
    a = ap.parse_args()
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    copy = copy_tbps()
    print(f"{name}; device-to-device copy {copy:.2f} TB/s; floor at {a.peak} TB/s", flush=True)
    commit = a.commit or ""
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          check=False).stdout.strip()
    except OSError:
        pass
    spin = spin_kernel()
    shapes = []
    for s in a.shapes.split(","):
        base, _, tokens = s.partition("@")  # "qwen3@1024": that shape at T = 1024 (the auto rule's sweep)
        sh = dict(SHAPES[base], **({"T": int(tokens)} if tokens else {}))
        shapes.append(run_shape(s, sh["T"], sh["H"], sh["E"], sh["K"], a.repeats, a.peak, copy, spin,
                                a.kernels_only))
    out = dict(device=name, date=datetime.date.today().isoformat(), commit=commit, peak_tbps=a.peak,
               copy_tbps=copy, shapes=shapes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
