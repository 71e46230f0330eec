"""Kernel time of the two top-k forward paths against the token count (GPU).

The thread-per-token kernels (``token_topk_fwd``: one thread routes one
token, up to 256 tokens a block) win at large T; at small T a block per
256 tokens leaves most SMs idle and one thread's whole row is the latency.
The W-lane kernels (``lane_topk_fwd``: W threads per token) have more
threads per token. This times both, per preset, over T (CUDA events, plans
launched on raw pointers as the transports launch them), through the plans'
``path=`` argument.

    python3 tools/probes/path_probe.py --json out.json
    python3 tools/probes/path_probe.py --cases large-k --tokens 65536 --token-max-topk 64
    python3 tools/probes/path_probe.py --cases deepseek-v4,llama-4 --paths token,warp
    python3 tools/probes/path_probe.py --cases nemotron-3-super --paths warp --sass

``--cases large-k`` times the issue's large-K shapes (E = 512 at K = 8 ... 64,
and E = 2304, K = 36); ``--token-max-topk`` lifts the token kernels' K limit
(``TokenTiling.max_topk``, the plans' ``tiling``) for the run, and every row checks that the two
paths wrote the same routing map (``same map``) and counts the probs that
differ in their bits (``probs differ``: the paths may sum a token's weights
in different orders).
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np
from numba import cuda

from gpurouter import kernels as K
from gpurouter.bench.timing import preset_cases, report, sass_counts, save_rows, spin_kernel, time_plan
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan

CASES = preset_cases()  # name: (E, K, G, Kg, sf, bias, pre), the bench's presets
LARGE_K = {f"e512-k{k}": (512, k, -1, -1, L.SIGMOID, True, False) for k in (8, 16, 22, 32, 64)}
LARGE_K["e2304-k36"] = (2304, 36, -1, -1, L.SIGMOID, True, False)


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,2048,4096,8192,16384,65536")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--cases", default="presets", help="presets, large-k, or names from either (comma-separated)")
    ap.add_argument("--token-max-topk", type=int, help="lift TokenTiling.max_topk for this run")
    ap.add_argument("--token-min-threads", type=int, help="set TokenTiling.min_threads for this run")
    ap.add_argument("--paths", default="token,lane", help="the kernel families to time (default token,lane)")
    ap.add_argument("--sass", action="store_true", help="the warp kernel's SASS counts (needs nvdisasm)")
    ap.add_argument("--sass-out", help="with --sass: write each warp kernel's SASS to this folder")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    token = {name: v for name, v in (("max_topk", args.token_max_topk), ("min_threads", args.token_min_threads))
             if v is not None}
    tiling = K.TopkTiling(token=K.TokenTiling(**token))
    spin = spin_kernel()
    rows = []
    known = {**CASES, **LARGE_K}
    names = {"presets": list(CASES), "large-k": list(LARGE_K)}.get(args.cases, args.cases.split(","))
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; presets, large-k or some of {sorted(known)}")
    cases = {n: known[n] for n in names}
    for name, (e, k, g, kg, sf, has_bias, pre) in cases.items():
        for t in (int(v) for v in args.tokens.split(",")):
            rng = np.random.default_rng(0)
            x = cuda.to_device(rng.standard_normal((t, e), np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
            bias = cuda.to_device(np.linspace(-0.01, 0.01, e, dtype=np.float32))
            spec = _plan.spec_of((t, e), L.BF16)
            row = {"case": name, "T": t, "token min threads": tiling.token.min_threads}
            outs = {}
            for path in args.paths.split(","):
                try:
                    plan = K.topk_with_score_function_fwd_plan(spec, has_bias, k, pre, g, kg, np.float32(1.0), sf,
                                                               0, path=path, tiling=tiling)
                    aplan = None if path == "warp" else K.score_for_aux_loss_fwd_plan(spec, k, sf, 0, path=path,
                                                                                      tiling=tiling)
                except ValueError as err:  # path='token' on a shape it does not take
                    row[f"{path} error"] = str(err)
                    continue
                row[f"{path} topk"], outs[path] = time_plan(plan, [[x, bias] if has_bias else [x]], args.repeats,
                                                              spin)
                kern = plan.steps[0].kernel
                regs = kern.get_regs_per_thread()
                row[f"{path} regs"] = sorted(regs.values()) if isinstance(regs, dict) else regs
                if args.sass and path == "warp":
                    out = args.sass_out and f"{args.sass_out}/{name}.sass"
                    row[f"{path} sass"] = sass_counts(kern, out)
                if aplan is not None:  # (the aux scores have no warp kernel)
                    row[f"{path} aux"], _ = time_plan(aplan, [[x]], args.repeats, spin)
            first, *others = list(outs) or [None]
            for path in others:  # (outs[2], saved, is only written where the backward reads it)
                row[f"same map ({path})"] = bool(np.array_equal(outs[first][1], outs[path][1]))
                row[f"probs differ ({path})"] = int(np.sum(outs[first][0] != outs[path][0]))
            report(rows, row)
    save_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
