"""Where the MoE block's GPU time goes, kernel by kernel (issue #38): the
jitted forward + backward step of ``moe-bench`` under ``jax.profiler``,
its device events summed by kernel name.

    python tools/probes/block_profile.py --shape deepseek-v3-like --grouped-matmul slots --json out.json
    python tools/probes/block_profile.py --tiny        # a toy shape (checks the script; a CPU has no GPU plane)

The step is ``gpurouter.bench.moe``'s block step (``backend``, default
``numba``). After warm-up, ``--steps`` steps run inside a trace; the GPU
plane's events (kernels and copies) are summed by name and divided by the
steps. Each kernel gets a kind from its name: ``gemm`` (cuBLAS / cuBLASLt /
CUTLASS / XLA's Triton GEMM), ``gather`` / ``scatter`` / ``reduce`` /
``loop`` (XLA fusions by their kind), ``numba`` (gpurouter's kernels),
``copy``, ``other``. Printed: the kinds' ms per step, then the top
kernels.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile


def kind_of(name: str) -> str:
    n = name.lower()
    if re.search(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|wgmma|triton_gemm|_dot", n):
        return "gemm"
    if "memcpy" in n or "memset" in n or n.startswith("copy"):
        return "copy"
    for k in ("gather", "scatter", "reduce", "sort", "transpose"):
        if k in n:
            return k
    if "fusion" in n or n.startswith("loop_") or n.startswith("input_"):
        return "loop"
    if n.startswith("_z") or "cudapy" in n or "numba" in n:
        return "numba"
    return "other"


def gpu_events(trace_dir: str):
    """``{name: total_ns}`` and the GPU plane's name, from the trace's xplane."""
    from jax.profiler import ProfileData

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {}, None
    data = ProfileData.from_file(paths[0])
    totals: dict[str, float] = collections.defaultdict(float)
    plane_name = None
    gpu_events.lines = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        plane_name = plane.name
        for line in plane.lines:
            gpu_events.lines.append(line.name)
            # the stream lines hold the kernels; skip XLA's op / module summary lines
            if "stream" not in line.name.lower():
                continue
            for ev in line.events:
                totals[ev.name] += ev.duration_ns
        break
    return totals, plane_name


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="deepseek-v3-like")
    parser.add_argument("--grouped-matmul", default="slots")
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import jax

    from gpurouter.bench.moe import block_steps

    steps, operands = block_steps(None if args.tiny else args.shape, args.backend, [args.grouped_matmul])
    step = steps[args.grouped_matmul]
    jax.block_until_ready(step(*operands))
    jax.block_until_ready(step(*operands))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.steps):
                out = step(*operands)
            jax.block_until_ready(out)
        totals, plane = gpu_events(d)
    per_step = {n: ns / args.steps / 1e6 for n, ns in totals.items()}
    kinds: dict[str, float] = collections.defaultdict(float)
    for n, ms in per_step.items():
        kinds[kind_of(n)] += ms
    head = dict(shape="tiny" if args.tiny else args.shape, grouped_matmul=args.grouped_matmul, backend=args.backend,
                device=jax.devices()[0].device_kind, plane=plane, steps=args.steps,
                total_ms=round(sum(per_step.values()), 3), lines=getattr(gpu_events, "lines", []))
    print(json.dumps(head))
    if plane is None:
        print("block_profile: the trace has no GPU plane (no GPU here): nothing to break down", file=sys.stderr)
    print(json.dumps({"kinds ms/step": {k_: round(v, 3) for k_, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}))
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[: args.top]
    for n, ms in top:
        print(f"{ms:9.3f} ms  {kind_of(n):8s} {n[:150]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(head, kinds=kinds, kernels=dict(top)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
