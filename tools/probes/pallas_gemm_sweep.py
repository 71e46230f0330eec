"""Tile configurations of ``pallas_ragged_dot`` (issue #38) at the MoE
issue's two full shapes, balanced routing: its forward, ``d_lhs`` (the same
kernel on ``dy``, ``rhs`` read transposed in place) and ``d_rhs``
(the transposed grouped GEMM) kernels, ms and TFLOP/s over the useful FLOPs
``2 N H M``, beside the dense GEMM of the same FLOPs (one cuBLAS GEMM).

    python tools/probes/pallas_gemm_sweep.py [--json out.json] [--budget-s 140]
    python tools/probes/pallas_gemm_sweep.py --tiny   # a toy shape in the interpreter (checks the script)

A config is ``block_m x block_n x block_k / num_warps / num_stages``; the
first is the default. The sweep stops starting new configs past ``--budget-s``
seconds (compiles included) and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpurouter.bench.moe import SHAPES, median_ms
from gpurouter.grouped_gemm import pallas as pg

CONFIGS = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 128, 32, 4, 4),
    (256, 128, 64, 8, 3),
]
TINY = (64, 32, 8, 2, 16)


def balanced_sizes(t: int, e: int, k: int, seed: int = 0) -> np.ndarray:
    """Loads of T tokens routed to K distinct random experts."""
    rng = np.random.default_rng(seed)
    return np.bincount(np.argsort(rng.random((t, e)), axis=1)[:, :k].reshape(-1), minlength=e).astype(np.int32)


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a toy shape and 16-wide tiles, in the interpreter")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=140.0, help="start no config past this many seconds")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    shapes = {"tiny": TINY} if args.tiny else {n: SHAPES[n][:5] for n in SHAPES}
    configs = [(16, 16, 16, 4, 2)] if args.tiny else CONFIGS
    rows = []
    print(dict(jax=jax.__version__, device=jax.devices()[0].device_kind), flush=True)
    for name, (t, h, e, k, m) in shapes.items():
        n = t * k
        flops = 2.0 * n * h * m
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        lhs = jax.random.normal(ks[0], (n, h)).astype(jnp.bfloat16)
        rhs = (jax.random.normal(ks[1], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16)
        dy = jax.random.normal(ks[2], (n, m)).astype(jnp.bfloat16)
        sizes = jnp.asarray(balanced_sizes(t, e, k))
        w = rhs[0]
        dense = {
            "fwd": median_ms(jax.jit(lambda a, b: a @ b), (lhs, w), args.repeats),
            "d_lhs": median_ms(jax.jit(lambda d, b: d @ b.T), (dy, w), args.repeats),
            "d_rhs": median_ms(jax.jit(lambda a, d: a.T @ d), (lhs, dy), args.repeats),
        }
        print(f"{name}: dense " + ", ".join(f"{k_} {v:.3f} ms = {flops / v / 1e9:.0f} TF" for k_, v in dense.items()),
              flush=True)
        for cfg in configs:
            if time.perf_counter() - start > args.budget_s:
                print(f"{name}: budget of {args.budget_s} s spent; config {cfg} and later not run", flush=True)
                break
            kw = dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), cfg, strict=True))
            fns = {
                "fwd": (jax.jit(lambda a, b, s, kw=kw: pg.pallas_ragged_dot(a, b, s, **kw)), (lhs, rhs, sizes)),
                "d_lhs": (jax.jit(lambda d, b, s, kw=kw: pg.pallas_ragged_dot_lhs_grad(d, b, s, **kw)),
                          (dy, rhs, sizes)),
                "d_rhs": (jax.jit(lambda a, d, s, kw=kw: pg.pallas_ragged_dot_rhs_grad(a, d, s, **kw)),
                          (lhs, dy, sizes)),
            }
            label = "{}x{}x{}/w{}/s{}".format(*cfg)
            for what, (f, fargs) in fns.items():
                try:
                    ms = median_ms(f, fargs, args.repeats)
                except Exception as exc:  # a config Triton refuses (shared memory): recorded, the sweep goes on
                    row = dict(shape=name, config=label, what=what, error=f"{type(exc).__name__}: {exc}"[:2000])
                    print(f"{name} {label} {what}: FAILED {row['error'][:300]}", flush=True)
                else:
                    row = dict(shape=name, config=label, what=what, ms=ms, tflops=flops / ms / 1e9,
                               dense_ms=dense[what], x_dense=dense[what] / ms)
                    print(f"{name} {label} {what}: {ms:.3f} ms = {row['tflops']:.0f} TF "
                          f"({row['x_dense']:.2f}x dense)", flush=True)
                rows.append(row)
                if args.json:
                    with open(args.json, "w") as fh:
                        json.dump(rows, fh, indent=1)
    print(f"sweep done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
