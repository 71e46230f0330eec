"""Issue #36 on a GPU: where a cold first call's seconds go, as a timeline.

One fresh process with an empty kernel cache runs ``jax.jit(jax.value_and_grad(loss))``
of ``coldstart``'s router step (the top-k with the preset's bias, the aux
scores, the aux loss; bf16 logits) and prints, in seconds from the call's
start: each kernel compiled in this process and how long it took, each
lookup and how long it waited, each background worker's start and end
(``kernels/_base/parallel.py``), when the FFI handler was wanted and ready,
then the trace, XLA's compile and the run. docs/cache.md, "Background
compiles while the trace goes on", reads one of these. About 20 s on an H200.

    python tools/probes/cold_timeline.py [--preset deepseek-v3] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    os.environ["GPUROUTER_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpurouter-timeline-")
    t_start = [time.perf_counter()]

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_start[0]:7.2f}s {msg}", flush=True)

    import jax
    import jax.numpy as jnp

    import gpurouter as gr
    from gpurouter._transport import ffi_cache
    from gpurouter.kernels._base import kernel_cache, parallel
    from gpurouter.presets import PRESETS

    def name(kernel) -> str:
        return getattr(getattr(kernel, "py_func", None), "__qualname__", "?").split(".")[0]

    compile_, resolve, background, cached = (kernel_cache._compile, kernel_cache.resolve, parallel._background,
                                             ffi_cache.cached_cfunc)

    def timed_compile(kernel, argtypes, ordinal):
        t = time.perf_counter()
        out = compile_(kernel, argtypes, ordinal)
        log(f"compiled here: {name(kernel)} in {time.perf_counter() - t:.2f}s")
        return out

    def timed_resolve(kernel, argtypes, ordinal, cache, **kw):
        t = time.perf_counter()
        out = resolve(kernel, argtypes, ordinal, cache, **kw)
        log(f"resolved: {name(kernel)} in {time.perf_counter() - t:.2f}s")
        return out

    def timed_background(batch, done, *rest):
        kernels = [rec[1] for rec, _, _ in batch]
        log(f"worker start: {kernels}")
        background(batch, done, *rest)
        log(f"worker end: {kernels}")

    def timed_handler(compile_fn, cache=None):
        log("FFI handler wanted")
        out = cached(compile_fn, cache)
        log(f"FFI handler ready {ffi_cache.STATS}")
        return out

    kernel_cache._compile, kernel_cache.resolve = timed_compile, timed_resolve
    parallel._background, ffi_cache.cached_cfunc = timed_background, timed_handler

    p = PRESETS[args.preset]
    bias = jnp.linspace(-0.05, 0.05, p.num_experts, dtype=jnp.float32) if p.expert_bias else None

    def loss(x):
        probs, _ = gr.fused_topk_with_score_function(x, expert_bias=bias, backend="numba", **p.router_kwargs())
        scores, aux_map = gr.fused_topk_with_score_function(
            x, p.topk, score_function=p.score_function, compute_aux_scores=True, backend="numba")
        counts = jnp.sum(aux_map, axis=0, dtype=jnp.int32)
        return jnp.sum(probs.astype(jnp.float32)) + gr.fused_moe_aux_loss(
            scores, counts, p.topk, p.aux_loss_coeff, backend="numba")

    x = jax.random.normal(jax.random.PRNGKey(0), (args.tokens, p.num_experts), jnp.float32).astype(jnp.bfloat16)
    x = jax.block_until_ready(x)
    step = jax.jit(jax.value_and_grad(loss))
    t_start[0] = time.perf_counter()
    log(f"start: {args.preset}, {args.tokens} tokens, cache {os.environ['GPUROUTER_CACHE_DIR']}")
    t = time.perf_counter()
    lowered = step.lower(x)
    log(f"traced and lowered in {time.perf_counter() - t:.2f}s")
    t = time.perf_counter()
    compiled = lowered.compile()
    log(f"XLA compiled in {time.perf_counter() - t:.2f}s")
    t = time.perf_counter()
    jax.block_until_ready(compiled(x))
    log(f"first run in {time.perf_counter() - t:.2f}s")
    log(f"kernel_cache {kernel_cache.STATS}, parallel {parallel.STATS}")


if __name__ == "__main__":
    main()
