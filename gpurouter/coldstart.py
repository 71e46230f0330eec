"""``python -m gpurouter coldstart``: the first call's time in a fresh process.

For each preset, a fresh Python process runs ``jax.jit(jax.value_and_grad(loss))``
over the router once (the top-k forward with the preset's bias, the aux
scores and the aux loss; bf16 logits, ``--tokens`` tokens), then again:

- ``jax``: ``backend="jax"``, the baseline;
- ``numba cold``: ``backend="numba"`` with an empty kernel cache (a new
  temporary ``GPUROUTER_CACHE_DIR``): every kernel linked from the package's
  seed (``seeded``: ``kernels/_base/seeds.py``) or compiled;
- ``numba warm``: the same again in a new process over the cache the cold
  run filled: every kernel loaded from disk;
- ``numba bare``: an empty cache without the seeds (``GPUROUTER_SEEDS=0``):
  every kernel compiled, as on a GPU or toolchain no seed was made for.

Each numba row also gives the first call for a new token count in the same
process (``--tokens // 2 + 8``: a new shape of a family already used), and
what the process compiled and loaded (``kernel_cache.STATS``: with compile
workers, the parent loads what the workers compiled), the compile worker
processes it started (``workers``: 0 for none, ``GPUROUTER_COMPILE_WORKERS``)
and the kernels they stored (``by wk``: ``kernels/_base/parallel.py``), of
which ``bg`` were a backward's, started in the background while its forward
was traced (``parallel.prefetch``). The FFI handler (``transport="ffi"``, one
``numba.cfunc`` a process, cached too: ``_transport/ffi_cache.py``) is part of
the first call, as in a user's process; ``handler`` says where it came from:
``disk`` (the cache), ``worker`` (compiled by a worker process while this one
compiled the first kernels), ``seed`` (made from the package's seed of it) or
``here`` (compiled in the process).

Needs a CUDA GPU for the numba rows (``--backends jax`` runs anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from ._cli import comma_list, positive_int

USAGE = "python -m gpurouter coldstart [--presets P,...|all] [--tokens N] [--backends jax,numba] [--json F]"


def router_step(preset: str, backend: str, dtype="bfloat16"):
    """``(step, logits)``: the measured step of ``preset`` (a ``jax.jit`` of
    ``value_and_grad`` over the top-k forward with the preset's bias, the aux
    scores and the aux loss) and ``logits(t)``, its input for ``t`` tokens
    in ``dtype``. ``cache make-seeds`` runs the same step."""
    import jax
    import jax.numpy as jnp

    import gpurouter as gr
    from gpurouter.presets import PRESETS

    p = PRESETS[preset]
    kw = p.router_kwargs()
    bias = jnp.linspace(-0.05, 0.05, p.num_experts, dtype=jnp.float32) if p.expert_bias else None

    def loss(x):
        probs, _ = gr.fused_topk_with_score_function(x, expert_bias=bias, backend=backend, **kw)
        scores, aux_map = gr.fused_topk_with_score_function(
            x, p.topk, score_function=p.score_function, compute_aux_scores=True, backend=backend)
        counts = jnp.sum(aux_map, axis=0, dtype=jnp.int32)
        aux = gr.fused_moe_aux_loss(scores, counts, p.topk, p.aux_loss_coeff, backend=backend)
        return jnp.sum(probs.astype(jnp.float32)) + aux

    def logits(t):
        return jax.random.normal(jax.random.PRNGKey(0), (t, p.num_experts), jnp.float32).astype(dtype)

    return jax.jit(jax.value_and_grad(loss)), logits


def _child(preset: str, backend: str, tokens: int) -> dict:
    """The measurement inside the fresh process."""
    import jax

    step, logits = router_step(preset, backend)
    x = jax.block_until_ready(logits(tokens))
    out = {"preset": preset, "backend": backend, "tokens": tokens}
    stats = None
    if backend == "numba":
        from gpurouter.kernels._base import kernel_cache

        stats = kernel_cache.STATS
    t0 = time.perf_counter()
    jax.block_until_ready(step(x))
    out["first_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(step(x))
    out["second_ms"] = (time.perf_counter() - t0) * 1e3
    if stats is not None:
        out["compiled"], out["loaded"], out["uncacheable"] = stats["compiled"], stats["loaded"], stats["uncacheable"]
        out["seeded"] = stats["seeded"]
        from gpurouter._transport import ffi_cache
        from gpurouter.kernels._base import parallel

        out["workers"], out["by_workers"] = parallel.STATS["workers"], parallel.STATS["stored"]
        out["prefetched"] = parallel.STATS["prefetched"]
        h = ffi_cache.STATS
        out["handler"] = "disk" if h["loaded"] and not h["worker"] else "worker" if h["loaded"] else (
            "seed" if h["seeded"] else "here" if h["compiled"] else "-")
        before = stats["compiled"]
        x2 = jax.block_until_ready(logits(tokens // 2 + 8))
        t0 = time.perf_counter()
        jax.block_until_ready(step(x2))
        out["new_shape_s"] = time.perf_counter() - t0
        out["new_shape_compiled"] = stats["compiled"] - before
    return out


def _run_child(preset: str, backend: str, tokens: int, cache_dir: str | None, timeout: float,
               seeds: bool = True) -> dict:
    env = dict(os.environ)
    if not seeds:
        env["GPUROUTER_SEEDS"] = "0"
    if cache_dir is not None:
        env["GPUROUTER_CACHE_DIR"] = cache_dir
        env.pop("GPUROUTER_CACHE", None)
    cmd = [sys.executable, "-m", "gpurouter.coldstart", "--child", preset, backend, str(tokens)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"coldstart: the {backend} child for {preset} failed "
                           f"(exit {proc.returncode}): " + " | ".join(tail))
    row = json.loads(lines[-1])
    row["process_s"] = wall
    return row


def _gpu_problem() -> str:
    """Why the numba rows cannot run here ("" when they can)."""
    from . import _backend

    if _backend.simulator_enabled():
        return "NUMBA_ENABLE_CUDASIM is set: the simulator compiles nothing (unset it on a GPU machine)"
    try:
        _backend.kernels()
    except ImportError:
        return "numba-cuda is not installed (pip install 'gpurouter[cuda13]')"
    if not _backend.numba_gpu_available():
        return "numba-cuda sees no CUDA GPU"
    return ""


def main(argv: list[str]) -> int:
    from .presets import PRESETS

    if argv[:1] == ["--child"]:
        preset, backend, tokens = argv[1], argv[2], int(argv[3])
        print(json.dumps(_child(preset, backend, tokens)), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m gpurouter coldstart", usage=USAGE, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", type=comma_list([*PRESETS, "all"], "preset"),
                        default=["deepseek-v3", "qwen3"],
                        help="comma-separated presets, or all (default deepseek-v3,qwen3)")
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens of the first call (default 4096)")
    parser.add_argument("--backends", type=comma_list(["jax", "numba"], "backend"), default=["jax", "numba"],
                        help="jax (the baseline) and/or numba (needs a CUDA GPU); default both")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--timeout", type=positive_int, default=300, help="seconds per child process (default 300)")
    args = parser.parse_args(argv)
    presets = list(PRESETS) if "all" in args.presets else args.presets
    if "numba" in args.backends:
        problem = _gpu_problem()
        if problem:
            parser.error(f"the numba rows need a CUDA GPU: {problem} (--backends jax runs without one)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpurouter-coldstart-") as tmp:
        for preset in presets:
            if "jax" in args.backends:
                rows.append({**_run_child(preset, "jax", args.tokens, None, args.timeout), "cache": "-"})
            if "numba" in args.backends:
                for cache in ("cold", "warm", "bare"):
                    folder = os.path.join(tmp, preset + ("-bare" if cache == "bare" else ""))
                    row = _run_child(preset, "numba", args.tokens, folder, args.timeout, seeds=cache != "bare")
                    rows.append({**row, "cache": cache})
                    print(_line(rows[-1]), file=sys.stderr, flush=True)
    header = (f"{'preset':<18}{'backend':<8}{'cache':<6}{'first s':>9}{'handler':>8}{'second ms':>11}"
              f"{'compiled':>9}{'seeded':>7}{'loaded':>7}{'workers':>8}{'by wk':>6}{'bg':>4}"
              f"{'new T s':>9}{'new T compiled':>15}{'process s':>10}")
    print(f"coldstart: {args.tokens} tokens, bf16 logits, jit(value_and_grad) of topk + aux scores + aux loss")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(_line(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "rows": rows}, f, indent=1)
    return 0


def _line(r: dict) -> str:
    def opt(key, fmt):
        return format(r[key], fmt) if key in r else "-"

    return (f"{r['preset']:<18}{r['backend']:<8}{r.get('cache', '-'):<6}{r['first_s']:>9.2f}"
            f"{r.get('handler', '-'):>8}{r['second_ms']:>11.3f}{opt('compiled', 'd'):>9}"
            f"{opt('seeded', 'd'):>7}{opt('loaded', 'd'):>7}{opt('workers', 'd'):>8}{opt('by_workers', 'd'):>6}"
            f"{opt('prefetched', 'd'):>4}"
            f"{opt('new_shape_s', '.3f'):>9}{opt('new_shape_compiled', 'd'):>15}"
            f"{r['process_s']:>10.1f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
