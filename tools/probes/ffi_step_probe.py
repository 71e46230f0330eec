"""Where a jitted DeepSeek-V3 step's time goes with the ffi transport (GPU).

Marginal us per step of a jitted fori_loop (gpurouter.bench.steps), for
variants of the router step: forward only or forward + backward, with and
without the expert bias and the groups, jax vs numba:ffi, and the loop's
own cost (the x update alone). Run it under different XLA_FLAGS to see
what they change.

    python3 tools/probes/ffi_step_probe.py --tokens 256,4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

import gpurouter as gr
from gpurouter.bench.steps import _marginal_us

KW = dict(topk=8, num_groups=8, group_topk=4, scaling_factor=2.5, score_function="sigmoid")


def variant(tokens, backend, grad=True, bias=True, groups=True):
    kw = dict(KW) if groups else dict(topk=8, scaling_factor=2.5, score_function="sigmoid")
    b = jnp.linspace(-0.01, 0.01, 256, dtype=jnp.float32) if bias else None
    w = jax.random.normal(jax.random.PRNGKey(1), (tokens, 256), jnp.float32)

    def loss(x):
        probs, _ = gr.fused_topk_with_score_function(x, **kw, expert_bias=b, backend=backend,
                                                     transport="ffi" if backend == "numba" else "auto")
        return jnp.sum(probs.astype(jnp.float32) * w)

    def step(_, x):
        g = jax.grad(loss)(x) if grad else jnp.broadcast_to(loss(x), x.shape)
        return (x.astype(jnp.float32) - 1e-3 * g.astype(jnp.float32)).astype(x.dtype)

    x = jax.random.normal(jax.random.PRNGKey(0), (tokens, 256), jnp.float32).astype(jnp.bfloat16)
    return (lambda n: lambda x: lax.fori_loop(0, n, step, x)), x


def update_only(tokens):
    x = jnp.zeros((tokens, 256), jnp.bfloat16)
    return (lambda n: lambda x: lax.fori_loop(0, n, lambda i, x: (x.astype(jnp.float32) * 0.999).astype(x.dtype),
                                              x)), x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,4096")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    for t in (int(v) for v in args.tokens.split(",")):
        rows = {"update only": update_only(t)}
        for backend in ("jax", "numba"):
            rows[f"{backend} fwd+bwd"] = variant(t, backend)
            rows[f"{backend} fwd"] = variant(t, backend, grad=False)
            rows[f"{backend} fwd+bwd no bias"] = variant(t, backend, bias=False)
            rows[f"{backend} fwd+bwd no groups"] = variant(t, backend, groups=False)
        for name, (make, x) in rows.items():
            us = _marginal_us(make, x, 20, 5)
            res[f"T={t} {name}"] = us
            print(f"T={t:6d} {name:28s} {us:8.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
