"""``python -m gpurouter steps``: what a jitted training step pays for routing.

Two tables (GPU; JSON with ``--json``):

1. **Steps**: the marginal time of one forward + backward step through the
   public API inside a jitted ``lax.fori_loop`` (bf16 logits; the loop runs
   N and 2N steps and the difference is divided by N, so compile, dispatch
   and the loop's fixed cost drop out; N grows until an N-step loop takes
   ``--min-loop-ms``, and a config's paths are timed in turns), per config
   and path: ``jax`` (the
   jnp reference), ``numba:ffi``, ``numba:zero-copy`` and ``auto``; the
   ratio is jax / numba:ffi. Configs: DeepSeek-V3 and Qwen3 at several token
   counts, Mixtral, Nemotron-3 Super (K = 22), and the aux path (aux scores + switch aux loss).
2. **Transport cost**: one op ``out = 2 x + y`` on float32[n] per loop step,
   as an XLA fusion and as a numba kernel through each transport; the cost
   of a transport is its step time minus the fusion's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from .._cli import comma_list, positive_int
from .._progress import progress

#: (config, preset, tokens, aux path)
CONFIGS = {
    f"{preset}@{t}": (preset, t, False)
    for preset, ts in (("deepseek-v3", (256, 4096, 16384, 65536)), ("qwen3", (256, 4096, 8192, 16384, 65536)),
                       ("mixtral", (65536,)), ("nemotron-3-super", (4096, 65536)))
    for t in ts
}
CONFIGS.update({f"aux@{t}": ("deepseek-v3", t, True) for t in (8192, 65536)})
PATHS = ("jax", "numba:ffi", "numba:zero-copy", "auto")


def _path_kw(path: str) -> dict:
    backend, _, transport = path.partition(":")
    return dict(backend=backend, transport=transport or "auto")


#: the shortest N-step loop timed, in seconds: N grows (from ``--steps``) until
#: an N-step loop takes this long, so that the host's timer and dispatch jitter
#: (tens of µs a call) stay a small part of the 2N - N difference
MIN_LOOP_S = 0.02
MAX_STEPS = 20000


def _time_s(f, x) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    return time.perf_counter() - t0


def _loops(make_loop, x, steps: int, min_loop_s: float):
    """``(n, {n: loop, 2n: loop})``, jitted and warm, with ``n >= steps`` and an
    n-step loop of at least ``min_loop_s`` (from one timed run; n <= MAX_STEPS)."""
    import jax

    n = steps
    while True:
        loops = {m: jax.jit(make_loop(m)) for m in (n, 2 * n)}
        for f in loops.values():
            jax.block_until_ready(f(x))
        t = _time_s(loops[n], x)
        if t >= min_loop_s or n >= MAX_STEPS:
            return n, loops
        n = min(MAX_STEPS, max(2 * n, math.ceil(1.2 * n * min_loop_s / max(t, 1e-9))))


def _diff_us(n: int, loops, x) -> float:
    """One (time(2n steps) - time(n steps)) / n, in us."""
    return (_time_s(loops[2 * n], x) - _time_s(loops[n], x)) / n * 1e6


def _marginal_us(make_loop, x, steps: int, repeats: int, min_loop_s: float = MIN_LOOP_S) -> float:
    """Median over ``repeats`` of the marginal us per step (``_loops``' n)."""
    n, loops = _loops(make_loop, x, steps, min_loop_s)
    return statistics.median(_diff_us(n, loops, x) for _ in range(repeats))


def _step_loop(preset, tokens: int, aux: bool, path: str):
    import jax
    import jax.numpy as jnp
    from jax import lax

    import gpurouter as gr
    from gpurouter.presets import PRESETS

    p = PRESETS[preset]
    kw = p.router_kwargs()
    e = p.num_experts
    bias = jnp.linspace(-0.01, 0.01, e, dtype=jnp.float32) if p.expert_bias and not aux else None
    w = jax.random.normal(jax.random.PRNGKey(1), (tokens, e), jnp.float32)
    pk = _path_kw(path)

    def loss(x):
        if aux:
            scores, routing_map = gr.fused_topk_with_score_function(x, p.topk, score_function=kw["score_function"],
                                                                    compute_aux_scores=True, **pk)
            tpe = jnp.sum(routing_map, axis=0, dtype=jnp.int32)
            return gr.fused_moe_aux_loss(scores, tpe, p.topk, 1e-2, **pk).astype(jnp.float32)
        probs, _ = gr.fused_topk_with_score_function(x, **kw, expert_bias=bias, **pk)
        return jnp.sum(probs.astype(jnp.float32) * w)

    def step(_, x):
        g = jax.grad(loss)(x)
        return (x.astype(jnp.float32) - 1e-3 * g.astype(jnp.float32)).astype(x.dtype)

    x = jax.random.normal(jax.random.PRNGKey(0), (tokens, e), jnp.float32).astype(jnp.bfloat16)
    return (lambda n: lambda x: lax.fori_loop(0, n, step, x)), x


def step_rows(configs, paths, steps: int, repeats: int, show: bool, min_loop_s: float = MIN_LOOP_S) -> list[dict]:
    """One row per config: each path's marginal us per step, the paths of a
    config timed in turns (repeat r of every path, then repeat r + 1), so a
    drift of the GPU's clocks or the host's load reaches them alike; the
    loop length each path ran in ``"loop steps"``."""
    rows = {name: {"config": name, "preset": CONFIGS[name][0], "tokens": CONFIGS[name][1],
                   "aux": CONFIGS[name][2], "loop steps": {}} for name in configs}
    work = [(name, path) for name in configs for path in paths]
    prepared: dict = {}
    for name, path in progress(work, len(work), "steps", show, describe=lambda w: f"{w[0]} {w[1]}"):
        make, x = _step_loop(*CONFIGS[name], path)
        n, loops = _loops(make, x, steps, min_loop_s)
        prepared[path] = (n, loops, x)
        rows[name]["loop steps"][path] = n
        if path == paths[-1]:  # the config's paths are ready: time them in turns
            diffs = {p: [] for p in prepared}
            for _ in range(repeats):
                for p, (n_p, loops_p, x_p) in prepared.items():
                    diffs[p].append(_diff_us(n_p, loops_p, x_p))
            rows[name].update({p: statistics.median(d) for p, d in diffs.items()})
            prepared = {}
    for row in rows.values():
        if "jax" in row and "numba:ffi" in row:
            row["ratio"] = row["jax"] / row["numba:ffi"]
            if "auto" in row:
                row["auto_vs_faster"] = row["auto"] / min(row["jax"], row["numba:ffi"])
    return list(rows.values())


def _axpy_op():
    """``2 x + y`` as a numba kernel plan, called through ``kernel_call``."""
    from numba import cuda

    from .._transport import kernel_call
    from ..kernels._base.plan import In, Out, Plan, Step

    @cuda.jit
    def bench_axpy(x, y, out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = 2.0 * x[i] + y[i]

    plans = {}

    def planner(x, y):
        if x not in plans:
            n = x.shape[0]
            plans[x] = Plan("bench_axpy", (x, y), (x,), (), [Step(bench_axpy, -(-n // 256), 256, 0,
                                                                  (In(0), In(1), Out(0)))])
        return plans[x]

    def op(x, y, transport):
        import jax

        return kernel_call(planner, [jax.ShapeDtypeStruct(x.shape, x.dtype)], [], [x, y], transport)[0]

    op.planner = planner  # (tools/probes/ffi_cost_probe.py launches its plans on other handlers)
    return op


TRANSPORTS = ("ffi", "zero-copy", "callback")


def _arg_loop(body):
    """``make(k)``: ``(c, y) -> c after k steps of c = body(c, y)``, one tuple argument."""
    from jax import lax

    return lambda k: lambda cy: lax.fori_loop(0, k, lambda i, c: body(c, cy[1]), cy[0])


def transport_rows(sizes, steps: int, repeats: int, transports=TRANSPORTS) -> list[dict]:
    """Per n: the marginal us per step of ``c = 2 c + y`` as an XLA fusion and
    through each transport, and each transport's cost over the fusion. ``x``
    and ``y`` are arguments of the jitted loop, as a step's activations and
    parameters are: a closed-over ``y`` is a constant, which XLA fuses into
    the fusion but must write to memory every step for a custom call (one
    more kernel per step: tools/probes/ffi_cost_probe.py, lab/journal/ffi-cost-notes.md). The
    bodies of one n are timed in turns, as ``step_rows`` does. A transport's
    cost includes XLA's copy of the call's result into the loop carry (the
    fusion writes in place, a custom call cannot)."""
    import jax.numpy as jnp

    op = _axpy_op()
    bodies = {"xla fusion": lambda c, y: 2.0 * c + y}
    bodies.update({t: (lambda c, y, t=t: op(c, y, t)) for t in transports})
    rows = []
    for n in sizes:
        xy = (jnp.ones((n,), jnp.float32), jnp.full((n,), 1e-6, jnp.float32))
        prepared = {name: _loops(_arg_loop(body), xy, steps, MIN_LOOP_S) for name, body in bodies.items()}
        diffs = {name: [] for name in bodies}
        for _ in range(repeats):
            for name, (k, loops) in prepared.items():
                diffs[name].append(_diff_us(k, loops, xy))
        row = {"n": n, **{name: statistics.median(d) for name, d in diffs.items()}}
        for t in transports:
            row[f"{t} cost"] = row[t] - row["xla fusion"]
        rows.append(row)
    return rows


def _fmt(v) -> str:
    return f"{v:9.1f}" if isinstance(v, float) else f"{v!s:>9}"


def table(rows: list[dict], keys: list[str]) -> str:
    lines = [" ".join(f"{k:>16}" for k in keys)]
    for r in rows:
        lines.append(" ".join(f"{_fmt(r.get(k, '')):>16}" for k in keys))
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    return [positive_int(s) for s in text.split(",")]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpurouter steps",
        description=__doc__.split("\n\n")[0] + " Needs JAX on a CUDA GPU and numba-cuda (pip install "
        "'gpurouter[cuda13]'); it refuses to run on a CPU.")
    parser.add_argument("--configs", type=comma_list(tuple(CONFIGS), "config"), default=list(CONFIGS),
                        help=f"comma-separated configs (default: all: {', '.join(CONFIGS)})")
    parser.add_argument("--paths", type=comma_list(PATHS, "path"), default=list(PATHS),
                        help=f"comma-separated paths (default: {', '.join(PATHS)})")
    parser.add_argument("--steps", type=positive_int, default=20,
                        help="N: loops of N and 2N steps, N grown until a loop takes --min-loop-ms (default 20)")
    parser.add_argument("--min-loop-ms", type=positive_int, default=int(MIN_LOOP_S * 1000),
                        help=f"the shortest N-step loop timed, ms (default {int(MIN_LOOP_S * 1000)})")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed repeats, median (default 5)")
    parser.add_argument("--transport-sizes", type=_sizes, default=[1024, 1048576],
                        help="comma-separated n of the transport-cost op (default 1024,1048576)")
    parser.add_argument("--transports", type=comma_list(TRANSPORTS, "transport"), default=list(TRANSPORTS),
                        help=f"comma-separated transports of the transport-cost op (default {','.join(TRANSPORTS)})")
    parser.add_argument("--json", help="write results as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    import jax

    if jax.default_backend() != "gpu":
        parser.error("the steps bench needs JAX on a CUDA GPU (jax.default_backend() is "
                     f"{jax.default_backend()!r})")
    from .router import _gpu_info

    info = _gpu_info()
    steps = step_rows(args.configs, args.paths, args.steps, args.repeats, not args.no_progress,
                      args.min_loop_ms / 1000)
    print(table(steps, ["config", *args.paths, "ratio", "auto_vs_faster"]))
    transports = transport_rows(args.transport_sizes, 200, args.repeats, args.transports)
    print()
    print(table(transports, ["n", "xla fusion", *args.transports, *(f"{t} cost" for t in args.transports)]))
    print(f"\nus per step (marginal); GPU {info.get('gpu')}, commit {info.get('commit')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "steps": steps, "transports": transports}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
