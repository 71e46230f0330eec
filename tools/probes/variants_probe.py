"""The router variants' costs against the plain ops (issue #37's targets; GPU).

Each row times one jitted call that applies an op to ``--batch`` different
inputs (so that the dispatch is paid once for all of them) and reports the
median microseconds per op over ``--repeats`` calls, forward only:

- ``sigmoid`` vs ``qb``: the top-k at a Kimi-K2-like shape (E = 384, K = 8,
  sigmoid, expert bias) without and with the Quantile-Balancing histogram
  (``--bins`` bins); target: qb at most 1.2x sigmoid;
- ``dense`` vs ``compact``: DeepSeek-V3 (E = 256, K = 8, groups 8/4, bias)
  with dense ``[T, E]`` outputs and with ``compact=True``; target: compact at
  most 0.7x dense;
- ``aux-loss``, ``z-loss``, ``qb`` with and without a ``token_mask``
  (every 10th token masked); target: the mask adds at most 5%.

    python3 tools/probes/variants_probe.py --tokens 65536 --json variants.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import gpurouter as gr


def per_op_us(fn, xs, repeats: int) -> float:
    """Median us per input of ``jit(fn)`` mapped over the list ``xs`` in one call."""
    f = jax.jit(lambda xs: [fn(x) for x in xs])
    jax.block_until_ready(f(xs))  # compile and warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(xs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(xs) * 1e6


def cases(tokens: int, bins: int):
    """``{name: (fn of x, E)}``: the rows, each a forward on bf16 logits ``[tokens, E]``."""
    kimi = dict(topk=8, score_function="sigmoid")
    ds = dict(topk=8, num_groups=8, group_topk=4, scaling_factor=2.5, score_function="sigmoid")
    b384 = jnp.linspace(-0.01, 0.01, 384, dtype=jnp.float32)
    b256 = jnp.linspace(-0.01, 0.01, 256, dtype=jnp.float32)
    hist = jnp.zeros((384, bins), jnp.int32)
    bounds = jnp.asarray([-1.0, 1.0], jnp.float32)
    mask = (jnp.arange(tokens) % 10) != 9
    tpe = jnp.full((384,), tokens * 8 // 384, jnp.int32)

    def topk(x, backend, **kw):
        return gr.fused_topk_with_score_function(x, backend=backend, **kw)

    return {
        "sigmoid": (lambda x, be: topk(x, be, **kimi, expert_bias=b384), 384),
        "qb": (lambda x, be: topk(x, be, **kimi, expert_bias=b384, qb_histogram=hist, qb_bin_bounds=bounds), 384),
        "qb masked": (lambda x, be: topk(x, be, **kimi, expert_bias=b384, qb_histogram=hist, qb_bin_bounds=bounds,
                                         token_mask=mask), 384),
        "dense": (lambda x, be: topk(x, be, **ds, expert_bias=b256), 256),
        "compact": (lambda x, be: topk(x, be, **ds, expert_bias=b256, compact=True), 256),
        "aux-loss": (lambda x, be: gr.fused_moe_aux_loss(x, tpe, 8, 1e-2, backend=be), 384),
        "aux-loss masked": (lambda x, be: gr.fused_moe_aux_loss(x, tpe, 8, 1e-2, token_mask=mask, backend=be), 384),
        "z-loss": (lambda x, be: gr.router_z_loss(x, 1e-3, backend=be), 384),
        "z-loss masked": (lambda x, be: gr.router_z_loss(x, 1e-3, token_mask=mask, backend=be), 384),
    }


RATIOS = (("qb", "sigmoid", 1.2), ("compact", "dense", 0.7), ("qb masked", "qb", 1.05),
          ("aux-loss masked", "aux-loss", 1.05), ("z-loss masked", "z-loss", 1.05))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--bins", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=10, help="inputs per timed call (default 10)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backends", default="jax,numba")
    ap.add_argument("--rows", default="all", help="comma-separated row names, or all")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = cases(args.tokens, args.bins)
    names = list(rows) if args.rows == "all" else args.rows.split(",")
    out = {"tokens": args.tokens, "bins": args.bins, "device": str(jax.devices()[0]), "us": {}}
    for be in args.backends.split(","):
        res = out["us"].setdefault(be, {})
        for name in names:
            fn, e = rows[name]
            key = jax.random.PRNGKey(len(res))
            xs = [jax.random.normal(jax.random.fold_in(key, i), (args.tokens, e), jnp.bfloat16)
                  for i in range(args.batch)]
            try:
                res[name] = per_op_us(lambda x, fn=fn, be=be: fn(x, be), xs, args.repeats)
                print(f"{be:6s} {name:16s} {res[name]:10.1f} us", flush=True)
            except Exception as exc:  # a row that cannot run says why, the others go on
                res[name] = None
                print(f"{be:6s} {name:16s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        for a, b, target in RATIOS:
            if res.get(a) and res.get(b):
                r = res[a] / res[b]
                print(f"{be:6s} {a} / {b} = {r:.2f} (target <= {target})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
