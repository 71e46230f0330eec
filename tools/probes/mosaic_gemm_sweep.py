"""``mosaic_ragged_dot`` (jax's Mosaic-GPU grouped GEMM kernels, issue #38)
at the MoE issue's two full shapes, balanced and skewed routing (the largest
expert at 4x the mean load): the forward, ``d lhs`` and ``d rhs`` kernels
with the tiles the wrapper picks, and forward + backward through its custom
VJP, in ms and TFLOP/s over the useful FLOPs ``2 N H M``, beside the dense
GEMM of the same FLOPs (one cuBLAS GEMM) and ``batched_ragged_dot``.

    python tools/probes/mosaic_gemm_sweep.py [--json out.json] [--repeats 7]

Each time is the median over ``--repeats`` of 10 calls queued without a host
sync between them, divided by 10 (so the ~0.1 ms host dispatch of a jitted
call is not counted in a GEMM of 0.3-6 ms). Hopper GPU only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from grouped_gemm_probe import routing_sizes  # tools/probes, the script's folder

from gpurouter.bench.moe import SHAPES
from gpurouter.grouped_gemm import mosaic
from gpurouter.reference.grouped_matmul import batched_ragged_dot


def queued_ms(f, args, repeats: int, inner: int = 10) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


def vjp(fn):
    """``jit`` of ``(a, b, sizes, dy) -> (out, d a, d b)``."""
    def step(a, b, s, d):
        out, back = jax.vjp(lambda x, y: fn(x, y, s), a, b)
        return (out, *back(d))
    return jax.jit(step)


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args(argv)
    print(dict(jax=jax.__version__, device=jax.devices()[0].device_kind), flush=True)
    rows = []
    for name, (t, h, e, k, m, _) in SHAPES.items():
        n = t * k
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        lhs = jax.random.normal(ks[0], (n, h)).astype(jnp.bfloat16)
        rhs = (jax.random.normal(ks[1], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16)
        dy = jax.random.normal(ks[2], (n, m)).astype(jnp.bfloat16)
        why = mosaic.mosaic_supported(lhs, rhs)
        if why:
            print(f"{name}: the kernels do not run here: {why}")
            return 1
        flops = 2.0 * n * h * m
        dense = {"fwd": queued_ms(jax.jit(lambda a, b: a @ b), (lhs, rhs[0]), args.repeats),
                 "d_lhs": queued_ms(jax.jit(lambda d, b: d @ b.T), (dy, rhs[0]), args.repeats),
                 "d_rhs": queued_ms(jax.jit(lambda a, d: a.T @ d), (lhs, dy), args.repeats)}
        dense["fwd+bwd"] = sum(dense.values())
        for routing in ("balanced", "skewed"):
            sizes = jnp.asarray(routing_sizes(t, e, k, routing == "skewed"))

            steps = {"fwd": (jax.jit(mosaic.mosaic_ragged_dot), (lhs, rhs, sizes)),
                     "d_lhs": (jax.jit(lambda d, b, s: mosaic._forward(d, b, s, True)), (dy, rhs, sizes)),
                     "d_rhs": (jax.jit(mosaic._weight_grad), (lhs, dy, sizes)),
                     "fwd+bwd": (vjp(mosaic.mosaic_ragged_dot), (lhs, rhs, sizes, dy)),
                     "batched fwd": (jax.jit(batched_ragged_dot), (lhs, rhs, sizes)),
                     "batched fwd+bwd": (vjp(batched_ragged_dot), (lhs, rhs, sizes, dy))}
            for what, (f, a) in steps.items():
                ms = queued_ms(f, a, args.repeats)
                base = dense[what.split(" ")[-1]]
                mult = 3 if "fwd+bwd" in what else 1
                row = dict(shape=name, routing=routing, what=what, ms=ms, tflops=mult * flops / ms / 1e9,
                           dense_ms=base, vs_dense=base / ms, device=jax.devices()[0].device_kind)
                rows.append(row)
                print(f"{name:17s} {routing:8s} {what:16s} {ms:8.3f} ms {row['tflops']:6.0f} TF/s "
                      f"dense {base:7.3f} ms  {row['vs_dense']:.2f}x dense", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
