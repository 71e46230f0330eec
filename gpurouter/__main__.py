"""``python -m gpurouter``: route a batch for each model preset on every backend.

Usage:
  python -m gpurouter [demo] [--tokens N] [--backend all|jax|numba] [--dtype bfloat16]
  python -m gpurouter bench [--presets ...] [--paths ...] [--json F] [--plot F]   (see bench --help)
  python -m gpurouter cache info|clear        (the compiled kernels kept on disk)
  python -m gpurouter coldstart [--json F]    (first calls in fresh processes; see coldstart --help)
  python -m gpurouter check MODULE:FUNCTION --op topk|aux-scores|aux-loss|z-loss   (see check --help)

Prints one row per (preset, backend): shapes, time per jitted forward+backward,
the largest difference to the reference (the jax backend is the reference), the
expert load, and the aux loss.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib

import numpy as np

from ._cli import USAGE, positive_int


def _available_backends(requested: str) -> tuple[list[str], str]:
    from . import _backend

    if requested != "all":
        return [requested], ""
    if _backend.numba_gpu_available():
        return ["jax", "numba"], ""
    if _backend.simulator_enabled():
        return ["jax"], "numba skipped: the CUDA simulator is for tests (use --backend numba --tokens 4)"
    try:
        _backend.kernels()
    except ImportError:
        return ["jax"], "numba skipped: numba-cuda is not installed (pip install 'gpurouter[cuda13]')"
    return ["jax"], "numba skipped: numba-cuda sees no CUDA GPU"


def _numba_problem() -> str:
    """Why the numba kernels cannot run here ("" when they can: a GPU or the simulator)."""
    from . import _backend

    if _backend.simulator_enabled():
        return ""
    try:
        _backend.kernels()
    except ImportError:
        return "numba-cuda is not installed (pip install 'gpurouter[cuda13]')"
    if not _backend.numba_gpu_available():
        return "numba-cuda sees no CUDA GPU (NUMBA_ENABLE_CUDASIM=1 runs the simulator, for tests)"
    return ""


def _time(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpurouter", usage=USAGE, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="tokens per batch, >= 1 (default 4096 on a GPU, 512 on a CPU)")
    parser.add_argument("--backend", choices=["all", "jax", "numba"], default="all",
                        help="which backends to route with (default all: jax, and numba where a GPU is)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                        help="dtype of the logits (default bfloat16)")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed runs per row, >= 1; the median is printed (default 5)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import gpurouter as gr
    from gpurouter import reference as ref
    from gpurouter._progress import progress
    from gpurouter.presets import DEMO_PRESETS, PRESETS

    backends, note = _available_backends(args.backend)
    if args.backend == "numba":
        problem = _numba_problem()
        if problem:
            parser.error(f"--backend numba: {problem}")
    tokens = args.tokens or (4096 if jax.default_backend() == "gpu" else 512)
    dtype = jnp.dtype(args.dtype)
    print(f"gpurouter {gr.__version__}: jax {jax.__version__} on {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}); {tokens} tokens, {args.dtype} logits")
    if note:
        print(note)
    header = (f"{'preset':<18}{'backend':<8}{'logits':<16}{'E/K':<8}{'fwd+bwd ms':>11}"
              f"{'max|d| ref':>12}{'load min/mean/max':>22}{'aux loss':>12}")
    rows = []
    jobs = [(p, b) for p in DEMO_PRESETS for b in backends]
    for name, backend in progress(jobs, len(jobs), "routing", enabled=not args.no_progress,
                                  describe=lambda job: f"{job[0]} ({job[1]})"):
        p = PRESETS[name]
        key = jax.random.PRNGKey(zlib.crc32(name.encode()))
        logits = jax.random.normal(key, (tokens, p.num_experts), jnp.float32).astype(dtype)
        bias = (jnp.linspace(-0.05, 0.05, p.num_experts, dtype=jnp.float32)
                if p.expert_bias else None)
        kw = p.router_kwargs()

        def step(x, kw=kw, bias=bias, backend=backend, p=p):
            def loss(x):
                probs, rmap = gr.fused_topk_with_score_function(x, expert_bias=bias, backend=backend, **kw)
                scores, aux_map = gr.fused_topk_with_score_function(
                    x, p.topk, score_function=p.score_function, compute_aux_scores=True,
                    backend=backend)
                counts = jnp.sum(aux_map, axis=0, dtype=jnp.int32)
                aux = gr.fused_moe_aux_loss(scores, counts, p.topk, p.aux_loss_coeff, backend=backend)
                return jnp.sum(probs.astype(jnp.float32)) + aux, (probs, rmap, aux)

            (_, (probs, rmap, aux)), grad = jax.value_and_grad(loss, has_aux=True)(x)
            return probs, rmap, aux, grad

        fn = jax.jit(step)
        seconds = _time(fn, logits, repeats=args.repeats)
        probs, rmap, aux, _ = fn(logits)
        want, _ = ref.fused_topk_with_score_function(logits, expert_bias=bias, **kw)
        if backend == "jax":
            diff = "(is ref)"  # the jax backend is the reference itself
        else:
            diff = f"{float(jnp.max(jnp.abs(probs.astype(jnp.float32) - want.astype(jnp.float32)))):.2e}"
        load = np.asarray(jnp.sum(rmap, axis=0))
        rows.append(f"{name:<18}{backend:<8}{str(tuple(logits.shape)):<16}"
                    f"{f'{p.num_experts}/{p.topk}':<8}{seconds * 1e3:>11.3f}{diff:>12}"
                    f"{f'{load.min()}/{load.mean():.1f}/{load.max()}':>22}{float(aux):>12.4e}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(r)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from .bench.router import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "moe-bench":
        from .bench.moe import main as moe_main

        return moe_main(argv[1:])
    if argv and argv[0] == "steps":
        from .bench.steps import main as steps_main

        return steps_main(argv[1:])
    if argv and argv[0] in ("cache", "coldstart"):  # the kernel cache (docs/cache.md)
        from . import _cache_cli, coldstart

        return (_cache_cli.main if argv[0] == "cache" else coldstart.main)(argv[1:])
    if argv and argv[0] == "check":
        from .testing._cli import main as check_main

        return check_main(argv[1:])
    if argv and argv[0] == "demo":
        argv = argv[1:]
    return demo(argv)


if __name__ == "__main__":
    sys.exit(main())
