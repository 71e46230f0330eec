"""Expert parallelism on several GPUs (issue #19): the MoE block over the GPUs
with the real ``ragged_all_to_all`` against one GPU (GPU only).

For each shape (the MoE issue's Qwen3-like layer and DeepSeek-V3-like slice,
scaled with ``--scale`` to fit): the forward + backward step time of

- ``one GPU, half batch``: ``gpurouter.moe.moe`` on T/P tokens with all E experts;
- ``EP over P GPUs``: inside ``shard_map``, T/P tokens and E/P experts per GPU,
  ``ep_axis`` set (rows to their experts' GPUs and back);
- ``exchange only``: the EP step's dispatch and return (``_ep.dispatch`` /
  ``_ep.combine`` with identity experts), forward + backward: its share of the
  EP step is the all-to-all share;

and, in float32 at a small shape and at each timed shape (its tokens cut to
fit, ``--check-gib``; ``--no-check-shapes`` skips these), the EP block's
output, aux loss and gradients against the single-device block on the same
global batch; exit status 1 if any differs. The
experts' grouped GEMM is ``--grouped-matmul``: ``ragged_dot`` (the block's
default; XLA's dense rewrite needs E times the rows' memory, hence the
default scale) or ``batched`` (``gpurouter.moe.batched_ragged_dot``, which
fits at ``--scale 1``).

    python3 tools/probes/ep_bench.py --json out.json
    python3 tools/probes/ep_bench.py --grouped-matmul batched --scale 1 --json out.json
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gpurouter import _ep
from gpurouter import moe as gmoe
from gpurouter.bench.moe import GROUPED_MATMULS, grouped_matmul_of, median_ms

SHAPES = {  # T, H, E, K, M
    "qwen3-like": (8192, 2048, 128, 8, 768),
    "deepseek-v3-like": (4096, 7168, 256, 8, 2048),
}
NAMES = ("x", "gate_kernel", "wi_0", "wi_1", "wo")


def params(t, h, e, m, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    s = 1 / np.sqrt(h)
    return dict(x=jax.random.normal(ks[0], (t, h)).astype(dtype),
                gate_kernel=(jax.random.normal(ks[1], (h, e)) * s).astype(dtype),
                wi_0=(jax.random.normal(ks[2], (e, h, m)) * s).astype(dtype),
                wi_1=(jax.random.normal(ks[3], (e, h, m)) * s).astype(dtype),
                wo=(jax.random.normal(ks[4], (e, m, h)) / np.sqrt(m)).astype(dtype))


def block_fwd(kw, ep_axis=None):
    def fwd(x, g, w0, w1, wo):
        out, aux = gmoe.moe(x, g, w0, w1, wo, num_experts=kw["e"], num_experts_per_tok=kw["k"],
                            aux_loss_coeff=1e-2, ep_axis=ep_axis, grouped_matmul=kw["gmm"])
        return out, (jax.lax.psum(aux, ep_axis) if ep_axis else aux)
    return fwd


def step(fwd):
    """Forward + backward of ``sum(out^2) + aux`` (gradients of every input)."""
    def loss(*a):
        out, aux = fwd(*a)
        return jnp.sum(out.astype(jnp.float32) ** 2) + aux
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def ep_step(mesh, kw):
    specs = (P("ep"), P(), P("ep"), P("ep"), P("ep"))
    fwd = jax.shard_map(block_fwd(kw, "ep"), mesh=mesh, in_specs=specs, out_specs=(P("ep"), P()))
    return step(fwd), specs


def exchange_step(mesh, kw, n_dev):
    def local(xs):
        def f(xs):
            rows_e = jnp.repeat(jnp.arange(kw["e"], dtype=jnp.int32), xs.shape[0] // kw["e"])
            sizes = jnp.full((kw["e"],), xs.shape[0] // kw["e"], jnp.int32)
            recv, _, state = _ep.dispatch(xs, rows_e, sizes, axis_name="ep", num_shards=n_dev, num_experts=kw["e"])
            back = _ep.combine(recv, state, axis_name="ep", num_shards=n_dev)
            return jax.lax.psum(jnp.sum(back.astype(jnp.float32) ** 2), "ep")
        return jax.value_and_grad(f)(xs)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("ep"), out_specs=(P(), P("ep")), check_vma=False))



def check_equal(mesh, n_dev, gmm, shape=None):
    """EP == one device in float32 (value = sum(out^2) + aux loss, gradients of
    every input) at ``shape`` (T, H, E, K, M), default a small one."""
    t, h, e, k, m = shape or (64 * n_dev, 64, 8 * n_dev, 2, 32)
    p = params(t, h, e, m, jnp.float32, seed=7)
    kw = dict(e=e, k=k, gmm=gmm)
    with jax.default_matmul_precision("float32"):
        want_v, want_g = step(block_fwd(kw))(*(p[n] for n in NAMES))
        f, specs = ep_step(mesh, kw)
        args = [jax.device_put(p[n], NamedSharding(mesh, s)) for n, s in zip(NAMES, specs, strict=True)]
        got_v, got_g = f(*args)
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
              for a, b in zip(got_g, want_g, strict=True))
    return {"T": t, "value_rel_err": abs(float(got_v) - float(want_v)) / abs(float(want_v)), "grad_max_rel_err": err,
            "ok": abs(float(got_v) - float(want_v)) <= 1e-5 * abs(float(want_v)) and err <= 1e-4}


def check_tokens(t, h, e, k, gib):
    """Tokens for the float32 check at a shape: at most ``t``, a multiple of 64,
    and few enough that ragged_dot's dense backward (about 3 float32 buffers of
    E x T*K x H) stays under ``gib`` GiB (2 x H200: DeepSeek-V3-like at 512
    tokens asked for 84 GiB and hung the collective)."""
    per_token = 3 * e * k * h * 4
    return max(64, min(t, int(gib * 2**30 // per_token) // 64 * 64))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=0.125,
                    help="multiplies M and T (default 0.125: ragged_dot's GPU backward takes E x the rows memory)")
    ap.add_argument("--grouped-matmul", choices=GROUPED_MATMULS, default="ragged_dot",
                    help="the experts' grouped GEMM (default ragged_dot)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated (default: all)")
    ap.add_argument("--no-check-shapes", dest="check_shapes", action="store_false",
                    help="skip the EP == one device check at each timed shape (float32; the small check still runs)")
    ap.add_argument("--check-gib", type=float, default=24,
                    help="memory bound that sets the tokens of each shape's check (default 24: Qwen3-like at "
                         "1/8 scale keeps its 1024 tokens, DeepSeek-V3-like gets 128 of 512)")
    ap.add_argument("--json")
    args = ap.parse_args()
    gpus = jax.devices()
    n_dev = len(gpus)
    mesh = jax.sharding.Mesh(np.array(gpus), ("ep",))
    gmm = grouped_matmul_of(args.grouped_matmul)
    res = {"devices": [d.device_kind for d in gpus], "jax": jax.__version__, "grouped_matmul": args.grouped_matmul,
           "check": check_equal(mesh, n_dev, gmm)}
    print("EP == one device:", res["check"], flush=True)
    checks = [res["check"]]
    for name in args.shapes.split(","):
        t, h, e, k, m = SHAPES[name]
        t, m = max(e, int(t * args.scale)) // e * e, max(8, int(m * args.scale))
        kw = dict(e=e, k=k, gmm=gmm)
        check = None
        if args.check_shapes:
            check = check_equal(mesh, n_dev, gmm, (check_tokens(t, h, e, k, args.check_gib), h, e, k, m))
            checks.append(check)
            print(f"{name}: EP == one device (float32, {check['T']} tokens):", check, flush=True)
        p = params(t, h, e, m, jnp.bfloat16)
        half = {n: p[n][: t // n_dev] if n == "x" else p[n] for n in NAMES}
        one = median_ms(step(block_fwd(kw)), [jax.device_put(half[n], gpus[0]) for n in NAMES], args.repeats)
        f, specs = ep_step(mesh, kw)
        ep_args = [jax.device_put(p[n], NamedSharding(mesh, s)) for n, s in zip(NAMES, specs, strict=True)]
        ep = median_ms(f, ep_args, args.repeats)
        rows = jax.device_put(jnp.zeros((t * k, h), jnp.bfloat16), NamedSharding(mesh, P("ep")))
        ex = median_ms(exchange_step(mesh, kw, n_dev), [rows], args.repeats)
        row = {"shape": name, "T": t, "H": h, "E": e, "K": k, "M": m, "one_gpu_half_batch_ms": one,
               "ep_ms": ep, "exchange_ms": ex, "exchange_share": ex / ep, "check": check}
        res[name] = row
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    failed = [c for c in checks if not c["ok"]]
    if failed:
        raise SystemExit(f"EP differs from one device: {failed}")


if __name__ == "__main__":
    main()
