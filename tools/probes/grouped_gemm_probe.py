"""Where ``batched_ragged_dot``'s time goes (issue #38): its forward and both
backward GEMMs at the MoE issue's two full shapes, taken apart, against the
dense GEMM of the same FLOPs, and ``tiled_ragged_dot`` and XLA's
``jax.lax.ragged_dot`` beside them.

    python tools/probes/grouped_gemm_probe.py --json out.json [--hlo-dir DIR] [--shapes qwen3-like,deepseek-v3-like]
    python tools/probes/grouped_gemm_probe.py --tiny      # a toy shape, any machine (checks the script)
    python tools/probes/grouped_gemm_probe.py --only pallas --repeats 5   # the dense and pallas rows alone

One expert GEMM of each shape ``(T, H, E, K, M)``: ``lhs [N, H]`` (``N = T K``
rows sorted by expert), ``rhs [E, H, M]``, bf16, FLOPs ``2 N H M`` (useful
FLOPs, what every TFLOP/s here counts; the padded slots' are not counted).
Routing: each token to K distinct random experts (``balanced``), and the
same with the largest expert at 4x the mean load (``skewed``: the issue's
"no cliff" case). Each row below is one jitted function, timed alone
(median wall ms of ``--repeats`` calls after a warm-up):

- ``dense fwd`` / ``dense d_lhs`` / ``dense d_rhs``: ``[N, H] @ [H, M]``,
  ``[N, M] @ [M, H]``, ``[H, N] @ [N, M]``: the ceiling, the same FLOPs in
  one cuBLAS GEMM; every grouped row prints ``x dense`` against it;
- ``gather slots``: ``lhs`` into ``[E, C, H]`` (the capacity ``C`` the
  switch picks for these sizes; ``pad`` = ``E C / N``, the rows multiplied
  per useful row); ``read back``: ``[E C, M]`` slots to ``[N, M]`` rows;
- ``slots fwd`` / ``slots d_lhs`` / ``slots d_rhs``: the batched GEMMs alone
  on slots already gathered (``[E, C, H] @ [E, H, M]`` etc.);
- ``one capacity fwd``: gather + GEMM + read back at that ``C``, no switch;
  ``batched fwd``: ``batched_ragged_dot`` itself (the ``lax.switch`` over
  the capacities on top; the difference is the switch's cost);
  ``batched fwd+bwd``: its forward and both gradients (``jax.vjp``);
- ``tiled fwd`` / ``tiled fwd+bwd``: ``tiled_ragged_dot`` (slots up to 1.5x
  the mean, per-expert tiles past them); ``tiles only fwd``: the same with
  ``capacity=0`` (every row in 128-row tiles);
- ``pallas fwd`` / ``pallas d_lhs`` / ``pallas d_rhs`` / ``pallas fwd+bwd``:
  ``gpurouter.grouped_gemm.pallas_ragged_dot`` (the Pallas grouped GEMM on
  the sorted rows, no slots) at its default tiles: its forward, its two
  backward kernels alone (``d_lhs``: the same kernel on ``dy``, ``rhs``
  read transposed in place; ``d_rhs``: the transposed grouped GEMM),
  and forward + backward; ``--only pallas`` runs the dense rows and these;
- ``weights floor``: the bytes of ``rhs`` (``E H M`` bf16, read once by any
  grouped GEMM) at the measured copy rate, as ms and as the TFLOP/s it caps
  the forward at (every expert's weights must come from memory; the dense
  GEMM reads one expert's);
- ``ragged_dot fwd``: ``jax.lax.ragged_dot``, or the error it raised (the
  message kept in the JSON: docs/moe.md's repro);
- ``skewed / balanced``: each ``fwd+bwd`` row's skewed time over its balanced
  one (``ratio``; the issue's "no cliff" target is at most 1.5).

``--hlo-dir`` writes the optimized HLO of ``batched_ragged_dot``'s forward
and forward + backward per shape (the layouts XLA picked: the GEMM
custom-calls' operand layouts are listed in the JSON too).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from gpurouter.bench.moe import SHAPES, median_ms
from gpurouter.grouped_gemm import pallas as pallas_gemm
from gpurouter.reference import grouped_matmul as gm

TINY = (64, 32, 8, 2, 16)


def routing_sizes(t: int, e: int, k: int, skewed: bool, seed: int = 0) -> np.ndarray:
    """Expert loads ``[E]`` of T tokens each routed to K distinct random
    experts; ``skewed``: expert 0 then takes rows from the others until it
    holds 4x the mean (``T K / E``), the total unchanged."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((t, e)), axis=1)[:, :k]
    sizes = np.bincount(picks.reshape(-1), minlength=e).astype(np.int64)
    if skewed:
        need = 4 * (t * k // e) - sizes[0]
        for g in np.argsort(-sizes):  # take from the largest others first
            if need <= 0:
                break
            if g == 0:
                continue
            take = min(need, sizes[g] // 2)
            sizes[g] -= take
            sizes[0] += take
            need -= take
    return sizes.astype(np.int32)


def copy_tbps(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Read + write bytes per second of a jitted elementwise pass, TB/s."""
    a = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda v: v + jnp.bfloat16(1))
    return 2 * nbytes / (median_ms(f, (a,), repeats) * 1e-3) / 1e12


def gemm_layouts(hlo: str) -> list[str]:
    """The GEMM calls of an optimized HLO module (cuBLAS custom-calls on a GPU,
    dots elsewhere), each line cut to its shapes, layouts and target."""
    out = []
    for line in hlo.splitlines():
        if "__cublas" in line or "gemm" in line.lower() or re.search(r"\bdot\(", line):
            out.append(re.sub(r"\s+", " ", line.strip())[:400])
    return out


def probe_shape(name, shape, repeats: int, hlo_dir, save=lambda rows: None, only: str | None = None) -> list[dict]:
    t, h, e, k, m = shape
    n = t * k
    flops = 2.0 * n * h * m
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    lhs = jax.random.normal(keys[0], (n, h)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (e, h, m)) / np.sqrt(h)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (n, m)).astype(jnp.bfloat16)
    rows = []

    def row(routing, what, ms, ceiling=None, gemm=True, **extra):
        r = {"shape": name, "T": t, "H": h, "E": e, "K": k, "M": m, "routing": routing, "what": what, "ms": ms,
             "TFLOP/s": flops / (ms * 1e-3) / 1e12 if ms and gemm else None, **extra}
        if ceiling is not None:
            r["dense ms"] = ceiling
            r["x dense"] = ceiling / ms
        rows.append(r)
        save(rows)  # after every row: a run cut short by its time limit keeps what it measured
        shown = ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in r.items()
                          if a not in ("shape", "T", "H", "E", "K", "M") and b is not None)
        print(f"{name}: {shown}", flush=True)
        return r

    # the ceiling: the same FLOPs as one dense GEMM (each GEMM of the three)
    w = rhs[0]
    dense = {
        "fwd": median_ms(jax.jit(lambda a, b: a @ b), (lhs, w), repeats),
        "d_lhs": median_ms(jax.jit(lambda d, b: d @ b.T), (dy, w), repeats),
        "d_rhs": median_ms(jax.jit(lambda a, d: a.T @ d), (lhs, dy), repeats),
    }
    for what, ms in dense.items():
        row("-", f"dense {what}", ms)
    floor_ms = e * h * m * 2 / (copy_tbps() * 1e12) * 1e3
    row("-", "weights floor", floor_ms, gemm=False, weights_gb=e * h * m * 2 / 1e9,
        fwd_cap_tflops=flops / (floor_ms * 1e-3) / 1e12)

    fwd_bwd_dense = sum(dense.values())
    for routing in ("balanced", "skewed"):
        sizes_np = routing_sizes(t, e, k, routing == "skewed")
        sizes = jnp.asarray(sizes_np)
        pallas_rows(row, routing, lhs, rhs, sizes, dy, dense, flops, repeats)
        if only == "pallas":
            continue
        mean = -(-n // e)
        caps = gm._capacities(mean)
        fits = [c for c in caps if c >= sizes_np.max()]
        cap = fits[0] if fits else caps[-1]
        extra = dict(max_over_mean=float(sizes_np.max() / (n / e)), capacity=cap, pad=e * cap / n,
                     rounds=not fits)
        slot_rows = gm._round_rows(sizes, 0, cap, n)
        gather = jax.jit(lambda a, r: gm._take_rows(a, r))
        slots = gather(lhs, slot_rows)
        row(routing, "gather slots", median_ms(gather, (lhs, slot_rows), repeats), gemm=False, **extra)
        out_slots = jnp.zeros((e * cap, m), jnp.bfloat16)
        row(routing, "read back", median_ms(jax.jit(lambda s, z, cap=cap: gm._read_back(s, z, cap, n)),
                                            (out_slots, sizes), repeats), gemm=False)
        d_slots = gather(dy, slot_rows)
        row(routing, "slots fwd", median_ms(jax.jit(lambda s, b: jnp.einsum("gck,gkm->gcm", s, b)), (slots, rhs),
                                            repeats), dense["fwd"])
        row(routing, "slots d_lhs", median_ms(jax.jit(lambda d, b: jnp.einsum("gcm,gkm->gck", d, b)),
                                              (d_slots, rhs), repeats), dense["d_lhs"])
        row(routing, "slots d_rhs", median_ms(jax.jit(lambda s, d: jnp.einsum("gck,gcm->gkm", s, d)),
                                              (slots, d_slots), repeats), dense["d_rhs"])
        del slots, d_slots, out_slots

        def one_capacity(a, b, s, cap=cap):
            y = jnp.einsum("gck,gkm->gcm", gm._take_rows(a, gm._round_rows(s, 0, cap, n)), b)
            return gm._read_back(y.reshape(-1, m), s, cap, n)

        row(routing, "one capacity fwd", median_ms(jax.jit(one_capacity), (lhs, rhs, sizes), repeats), dense["fwd"])
        for label, fn in (("batched", gm.batched_ragged_dot), ("tiled", gm.tiled_ragged_dot)):
            f = jax.jit(fn)
            row(routing, f"{label} fwd", median_ms(f, (lhs, rhs, sizes), repeats), dense["fwd"])

            def fwd_bwd(a, b, s, d, fn=fn):
                out, vjp = jax.vjp(lambda x, y: fn(x, y, s), a, b)
                return out, vjp(d)

            ms = median_ms(jax.jit(fwd_bwd), (lhs, rhs, sizes, dy), repeats)
            row(routing, f"{label} fwd+bwd", ms, fwd_bwd_dense, **{"TFLOP/s fwd+bwd": 3 * flops / (ms * 1e-3) / 1e12})
            if hlo_dir is not None and label == "batched" and routing == "balanced":
                for part, g in (("fwd", f), ("fwd_bwd", jax.jit(fwd_bwd))):
                    args = (lhs, rhs, sizes) if part == "fwd" else (lhs, rhs, sizes, dy)
                    text = g.lower(*args).compile().as_text()
                    (hlo_dir / f"{name}-batched-{part}.hlo.txt").write_text(text)
                    rows[-1].setdefault("gemm layouts", {})[part] = gemm_layouts(text)
        tiles_only = jax.jit(lambda a, b, s: gm.tiled_ragged_dot(a, b, s, capacity=0))
        row(routing, "tiles only fwd", median_ms(tiles_only, (lhs, rhs, sizes), repeats), dense["fwd"])

    # the "no cliff" target (at most 1.5): each forward + backward, skewed over balanced
    both = {(r["routing"], r["what"]): r["ms"] for r in rows if r["what"].endswith("fwd+bwd")}
    for (routing, what), ms in both.items():
        if routing == "skewed" and both.get(("balanced", what)):
            row("skewed / balanced", what, None, gemm=False, ratio=ms / both["balanced", what])
    if only == "pallas":
        return rows
    # XLA's own grouped GEMM: the time, or the error it raises
    sizes = jnp.asarray(routing_sizes(t, e, k, False))
    try:
        ms = median_ms(jax.jit(jax.lax.ragged_dot), (lhs, rhs, sizes), repeats)
        row("balanced", "ragged_dot fwd", ms, dense["fwd"])
    except Exception as exc:  # recorded, not raised: this failure is a result
        msg = f"{type(exc).__name__}: {exc}"
        row("balanced", "ragged_dot fwd", None, error=msg[:4000], jax=jax.__version__,
            device=jax.devices()[0].device_kind)
        traceback.print_exc(limit=2)
    return rows


def pallas_rows(row, routing, lhs, rhs, sizes, dy, dense, flops, repeats) -> None:
    """The ``pallas`` rows of one routing (forward, each backward kernel,
    forward + backward), each beside the dense GEMM."""
    fn = pallas_gemm.pallas_ragged_dot
    row(routing, "pallas fwd", median_ms(jax.jit(fn), (lhs, rhs, sizes), repeats), dense["fwd"])
    d_lhs = jax.jit(pallas_gemm.pallas_ragged_dot_lhs_grad)
    row(routing, "pallas d_lhs", median_ms(d_lhs, (dy, rhs, sizes), repeats), dense["d_lhs"])
    d_rhs = jax.jit(pallas_gemm.pallas_ragged_dot_rhs_grad)
    row(routing, "pallas d_rhs", median_ms(d_rhs, (lhs, dy, sizes), repeats), dense["d_rhs"])

    def fwd_bwd(a, b, s, d):
        out, vjp = jax.vjp(lambda x, y: fn(x, y, s), a, b)
        return out, vjp(d)

    ms = median_ms(jax.jit(fwd_bwd), (lhs, rhs, sizes, dy), repeats)
    row(routing, "pallas fwd+bwd", ms, sum(dense.values()), **{"TFLOP/s fwd+bwd": 3 * flops / (ms * 1e-3) / 1e12})


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated (default {','.join(SHAPES)})")
    p.add_argument("--tiny", action="store_true", help="a toy shape (any machine)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="write every row here")
    p.add_argument("--only", choices=["pallas"], help="only the dense and pallas rows")
    p.add_argument("--hlo-dir", help="write batched_ragged_dot's optimized HLO here")
    args = p.parse_args(argv)
    hlo_dir = None
    if args.hlo_dir:
        hlo_dir = pathlib.Path(args.hlo_dir)
        hlo_dir.mkdir(parents=True, exist_ok=True)
    shapes = {"tiny": TINY} if args.tiny else {n: SHAPES[n][:5] for n in args.shapes.split(",")}
    head = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M UTC",
                time.gmtime()), commit=os.environ.get("GPUROUTER_COMMIT", ""))
    print(head, flush=True)
    done: list[dict] = []

    def save(rows):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(head, rows=done + rows), f, indent=1)

    for name, shape in shapes.items():
        done += probe_shape(name, shape, args.repeats, hlo_dir, save, args.only)
    save([])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
