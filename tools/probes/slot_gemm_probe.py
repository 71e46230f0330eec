"""The batched GEMMs of the slot FFN (``moe(..., grouped_matmul="slots")``,
issue #38) alone, by capacity ``C`` and by XLA's GEMM flags: which kernel
XLA picks (cuBLAS, cuBLASLt or its Triton GEMM), and how the time moves
with ``C`` (weight-bound GEMMs stay flat; a tiling that splits ``C`` steps).

    python tools/probes/slot_gemm_probe.py --json out.json                # every flag set, each in its own process
    python tools/probes/slot_gemm_probe.py --flags "--xla_gpu_enable_triton_gemm=false" --json out.json
    python tools/probes/slot_gemm_probe.py --tiny                         # a toy shape, any machine

Per shape ``(T, H, E, K, M)`` and capacity ``C`` (bf16, fp32 accumulation,
output bf16, ``E`` batches): ``fwd`` (``[E, C, H] x [E, H, M]``, ``x wi_0``),
``wo`` (``[E, C, M] x [E, M, H]``), ``d_lhs`` (``[E, C, M] x [E, H, M]^T``),
``d_rhs`` (``[E, C, H]^T x [E, C, M]``, a weight-sized output), beside
``weights read`` (a sum over one ``[E, H, M]``: the rate the weights stream
at) and ``weights copy`` (read and write one). Times: median of
``--repeats`` rounds of 5 queued calls (host dispatch hidden), ms per call.
``GB/s``: the weights' bytes over the time; ``kernel``: the GEMM kernels in
the optimized HLO. Then the slot FFN forward + backward at the balanced
routing, under the same flags.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

FLAG_SETS = ("", "--xla_gpu_enable_triton_gemm=false", "--xla_gpu_enable_cublaslt=true",
             "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true")
TINY = (64, 32, 8, 2, 16)


def queued_ms(fn, args, repeats: int, calls: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def kernels(fn, args) -> str:
    """The GEMM kernels of ``fn``'s optimized HLO: cuBLAS custom calls and Triton GEMM fusions."""
    text = fn.lower(*args).compile().as_text()
    found = sorted(set(re.findall(r'custom_call_target="(__cublas[^"]*)"', text))
                   | {"__triton_gemm" for _ in re.findall(r'"kind":"__triton_gemm"', text)[:1]})
    return ",".join(found) or "other"


def run_flags(shapes, caps_of, repeats: int, emit) -> None:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(__file__))
    from grouped_gemm_probe import routing_sizes
    from slot_ffn_probe import _fwd_bwd, _operands

    bf = jnp.bfloat16
    ops = {
        "fwd": ("gch,ghm->gcm", lambda e, c, h, m: ((e, c, h), (e, h, m))),
        "wo": ("gcm,gmh->gch", lambda e, c, h, m: ((e, c, m), (e, m, h))),
        "d_lhs": ("gcm,ghm->gch", lambda e, c, h, m: ((e, c, m), (e, h, m))),
        "d_rhs": ("gch,gcm->ghm", lambda e, c, h, m: ((e, c, h), (e, c, m))),
    }
    for name, (t, h, e, k, m) in shapes.items():
        key = jax.random.PRNGKey(0)
        w = jax.random.normal(key, (e, h, m), jnp.float32).astype(bf)
        wbytes = w.size * 2
        rd = jax.jit(lambda w: jnp.sum(w, dtype=jnp.float32))
        emit(dict(shape=name, row="weights read", ms=(ms := queued_ms(rd, (w,), repeats)),
                  GBps=round(wbytes / ms / 1e6)))
        cp = jax.jit(lambda w: w * bf(1.5))
        emit(dict(shape=name, row="weights copy", ms=(ms := queued_ms(cp, (w,), repeats)),
                  GBps=round(2 * wbytes / ms / 1e6)))
        del w
        for c in caps_of(name, t, e, k):
            for op, (spec, shp) in ops.items():
                a_shape, b_shape = shp(e, c, h, m)
                ka, kb = jax.random.split(jax.random.PRNGKey(c))
                a = jax.random.normal(ka, a_shape, jnp.float32).astype(bf)
                b = jax.random.normal(kb, b_shape, jnp.float32).astype(bf)
                f = jax.jit(lambda a, b, spec=spec: jnp.einsum(spec, a, b, preferred_element_type=bf))
                ms = queued_ms(f, (a, b), repeats)
                flops = 2.0 * e * c * h * m
                emit(dict(shape=name, C=c, row=op, ms=round(ms, 4), TFLOPs=round(flops / ms / 1e9, 1),
                          GBps=round(wbytes / ms / 1e6), kernel=kernels(f, (a, b))))
                del a, b
        x, wts, w_rows, dz = _operands(t, h, e, k, m)
        sizes = jnp.asarray(routing_sizes(t, e, k, False), jnp.int32)
        ms = queued_ms(_fwd_bwd(True), (x, wts, w_rows, sizes, dz), repeats, calls=1)  # its gradients are large
        emit(dict(shape=name, row="slot FFN fwd+bwd (balanced)", ms=round(ms, 3),
                  TFLOPs=round(18.0 * t * k * h * m / ms / 1e9, 1)))
        del x, wts, dz


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flags", default=None, help="one XLA_FLAGS set (default: each of FLAG_SETS, a process each)")
    parser.add_argument("--shapes", default="qwen3-like,deepseek-v3-like")
    parser.add_argument("--caps", default="", help="capacities for every shape, comma-separated "
                                                   "(default: the mean, the slots' pick, 2x the mean)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", help="append every row here, one JSON object a line")
    args = parser.parse_args(argv)
    if args.flags is None:
        rc = 0
        for flags in FLAG_SETS:
            cmd = [sys.executable, __file__, f"--flags={flags}", "--shapes", args.shapes, "--caps", args.caps,
                   "--repeats", str(args.repeats)] + (["--tiny"] if args.tiny else []) \
                + (["--json", args.json] if args.json else [])
            rc |= subprocess.call(cmd, env={**os.environ, "XLA_FLAGS": flags})
        return rc
    import jax

    from gpurouter.bench.moe import SHAPES
    from gpurouter.reference.slot_experts import slot_capacities

    sys.path.insert(0, os.path.dirname(__file__))
    from grouped_gemm_probe import routing_sizes

    shapes = {"tiny": TINY} if args.tiny else {n: SHAPES[n][:5] for n in args.shapes.split(",")}

    def caps_of(name, t, e, k):
        if args.caps:
            return [int(c) for c in args.caps.split(",")]
        mean = t * k // e
        largest = int(routing_sizes(t, e, k, False).max())
        pick = next(c for c in slot_capacities(t * k, e) if c >= largest)
        return sorted({mean, pick, 2 * mean})

    def emit(row):
        row = {"flags": args.flags or "(default)", **row}
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
          flush=True)
    run_flags(shapes, caps_of, args.repeats, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
