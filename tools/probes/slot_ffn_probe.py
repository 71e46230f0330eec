"""The expert FFN in slots (``moe(..., grouped_matmul="slots")``, issue #38)
taken apart at the MoE issue's two full shapes, balanced and skewed routing,
beside the row-by-row FFN on ``batched_ragged_dot``.

    python tools/probes/slot_ffn_probe.py --json out.json [--shapes qwen3-like,deepseek-v3-like]
    python tools/probes/slot_ffn_probe.py --tiny      # a toy shape, any machine (checks the script)

One expert FFN of each shape ``(T, H, E, K, M)``: ``xs [N, H]`` (``N = T K``),
``wi_0, wi_1 [E, H, M]``, ``wo [E, M, H]``, bf16, no biases, SiLU, early
weighting; the routing as ``grouped_gemm_probe.py``'s (``skewed``: the
largest expert at 4x the mean, past the slots' 1.5x, so its rows past them
go to tiles). Rows (median wall ms of ``--repeats`` jitted
calls after a warm-up; TFLOP/s over the useful ``6 N H M`` FLOPs forward,
three times that forward + backward):

- ``slots fwd`` / ``slots fwd+bwd``: ``slots_expert_ffn``; ``batched
  fwd+bwd``: the row-by-row FFN on ``batched_ragged_dot`` (the block's
  ``grouped_matmul=batched_ragged_dot``);
- balanced only, the forward's pieces at the capacity ``C`` the switch
  picks: ``gather x`` (``xs`` into ``[E, C, H]``), ``GEMMs on slots`` (the
  three batched GEMMs and the activation on slots already gathered),
  ``read back z`` (``[E C, H]`` slots to ``[N, H]`` rows);
- ``skewed / balanced``: each ``fwd+bwd`` row's skewed time over its balanced
  one.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from grouped_gemm_probe import routing_sizes

from gpurouter.bench.moe import SHAPES, median_ms
from gpurouter.reference.grouped_matmul import _read_back, _round_rows, _take_rows, batched_ragged_dot
from gpurouter.reference.moe import _expert_ffn, rows_of_groups
from gpurouter.reference.slot_experts import slot_capacities, slots_expert_ffn

TINY = (64, 32, 8, 2, 16)
KW = dict(wi_0_bias=None, wi_1_bias=None, wo_bias=None, activation=jax.nn.silu, early=True, dtype=jnp.bfloat16)


def _operands(t, h, e, k, m):
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    n = t * k
    w = dict(wi_0=(jax.random.normal(ks[0], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16),
             wi_1=(jax.random.normal(ks[1], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16),
             wo=(jax.random.normal(ks[2], (e, m, h)) / np.sqrt(m)).astype(jnp.bfloat16))
    return (jax.random.normal(ks[3], (n, h)).astype(jnp.bfloat16), w, jnp.ones((n,), jnp.float32),
            jax.random.normal(ks[4], (n, h), jnp.float32))


def _ffn(slots: bool):
    return (functools.partial(slots_expert_ffn, **KW) if slots
            else functools.partial(_expert_ffn, **KW, align_size=0, grouped_matmul=batched_ragged_dot))


@functools.cache
def _fwd(slots: bool):
    return jax.jit(lambda x, w, wr, s: _ffn(slots)(x, rows_of_groups(s, x.shape[0]), s, wr, **w))


@functools.cache
def _fwd_bwd(slots: bool):
    def f(x, w, wr, s, dz):
        z, vjp = jax.vjp(lambda x_, w_: _ffn(slots)(x_, rows_of_groups(s, x.shape[0]), s, wr, **w_), x, w)
        return z, vjp(dz)
    return jax.jit(f)


def _pieces(row, x, w, sizes, width: int, repeats: int) -> None:
    n = x.shape[0]
    gather = jax.jit(lambda x, s: _take_rows(x, _round_rows(s, 0, width, n)))
    x_s = gather(x, sizes)
    row("gather x", median_ms(gather, (x, sizes), repeats), C=width, pad=round(x_s.shape[0] * width / n, 3))

    def gemms(x_s, w):
        a = jnp.einsum("gch,ghm->gcm", x_s, w["wi_0"], preferred_element_type=x_s.dtype)
        b = jnp.einsum("gch,ghm->gcm", x_s, w["wi_1"], preferred_element_type=x_s.dtype)
        return jnp.einsum("gcm,gmh->gch", jax.nn.silu(a) * b, w["wo"], preferred_element_type=x_s.dtype)
    gemms = jax.jit(gemms)
    y_s = gemms(x_s, w)
    row("GEMMs on slots", median_ms(gemms, (x_s, w), repeats), 3)
    back = jax.jit(lambda y, s: _read_back(y.reshape(-1, y.shape[-1]), s, width, n))
    row("read back z", median_ms(back, (y_s, sizes), repeats))


def probe_shape(name, shape, repeats: int, save) -> list[dict]:
    t, h, e, k, m = shape[:5]
    x, w, w_rows, dz = _operands(t, h, e, k, m)
    flops = 2.0 * t * k * h * m  # one GEMM's useful FLOPs
    rows: list[dict] = []
    for routing in ("balanced", "skewed"):
        sizes = jnp.asarray(routing_sizes(t, e, k, routing == "skewed"), jnp.int32)
        caps = slot_capacities(x.shape[0], e)
        width = next((c for c in caps if c >= int(sizes.max())), None)

        def row(what, ms, gemms=None, routing=routing, **extra):
            r = dict(shape=name, routing=routing, row=what, ms=round(ms, 4), **extra)
            if gemms:
                r["TFLOP/s"] = round(gemms * flops / (ms * 1e-3) / 1e12, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
            save(rows)

        row("slots fwd", median_ms(_fwd(True), (x, w, w_rows, sizes), repeats), 3,
            plan="slots" if width else "largest slots and tiles", largest=int(sizes.max()))
        row("slots fwd+bwd", median_ms(_fwd_bwd(True), (x, w, w_rows, sizes, dz), repeats), 9)
        row("batched fwd+bwd", median_ms(_fwd_bwd(False), (x, w, w_rows, sizes, dz), repeats), 9)
        if width:
            _pieces(row, x, w, sizes, width, repeats)
    for what in ("slots fwd+bwd", "batched fwd+bwd"):
        ms = {r["routing"]: r["ms"] for r in rows if r["row"] == what}
        if len(ms) == 2:
            r = dict(shape=name, routing="skewed / balanced", row=what, ratio=round(ms["skewed"] / ms["balanced"], 3))
            rows.append(r)
            print(json.dumps(r), flush=True)
    save(rows)
    return rows


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a toy shape (any machine)")
    parser.add_argument("--json", help="write every row here (rewritten after each row)")
    args = parser.parse_args(argv)
    shapes = {"tiny": TINY} if args.tiny else {n: SHAPES[n] for n in args.shapes.split(",")}
    done: list[dict] = []

    def save(rows):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(done + rows, f, indent=1)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for name, shape in shapes.items():
        done += probe_shape(name, shape, args.repeats, save)
    save([])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
