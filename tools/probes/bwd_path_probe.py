"""Kernel time of the top-k backward's paths against the token count (GPU):
the warp-per-token kernel (``warp_topk_bwd``) and the quad kernel
(``quad_bwd``), chosen by the plans' ``path=`` argument, on the state of the
forward (the library's own, ``path="auto"``) and a random bf16 cotangent.

    python3 tools/probes/bwd_path_probe.py --json out.json
    python3 tools/probes/bwd_path_probe.py --cases deepseek-v4 --tokens 65536 --map-formats 0,1
    python3 tools/probes/bwd_path_probe.py --paths warp --knobs '[{}, {"warp_max_blocks": 4224}]'

``--knobs``: settings of ``BwdTiling`` fields (the warp kernel's launch knob
``warp_max_blocks``), each passed to the plans as a ``TopkTiling`` in turn.

Every row checks each path's gradients against the jnp reference (``max rel``:
the largest |difference| over the largest |reference gradient|; ``ok``: within
bf16's 1e-2) and counts the elements where the paths' bits differ (``bits
differ``: the token's sums run in different orders).  Times: CUDA events,
plans launched on raw pointers as the transports launch them (``gpurouter.bench.timing``).
"""

from __future__ import annotations

import argparse
import json
import sys

import ml_dtypes
import numpy as np
from numba import cuda
from path_probe import CASES

from gpurouter import kernels as K
from gpurouter import reference as ref
from gpurouter.bench.timing import report, save_rows, spin_kernel, time_plan
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan

SF_NAMES = {L.SIGMOID: "sigmoid", L.SOFTMAX: "softmax", L.SQRTSOFTPLUS: "sqrtsoftplus"}


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384,65536")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--cases", default="deepseek-v3,deepseek-v4,kimi-k2,nemotron-3-super,qwen3,llama-4")
    ap.add_argument("--paths", default="warp,quad")
    ap.add_argument("--map-formats", default="0", help="0 (BYTEMAP), 1 (BITMAP_U8), or both")
    ap.add_argument("--knobs", default="[{}]", help="JSON list of dicts of BwdTiling fields")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    settings = json.loads(args.knobs)
    unknown = [n for n in args.cases.split(",") if n not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; some of {sorted(CASES)}")
    spin = spin_kernel()
    rows = []
    failed = False
    for name in args.cases.split(","):
        e, k, g, kg, sf, has_bias, pre = CASES[name]
        scale = 2.5 if sf != L.SOFTMAX else 1.0
        for t in (int(v) for v in args.tokens.split(",")):
            for fmt in (int(v) for v in args.map_formats.split(",")):
                rng = np.random.default_rng(t)
                x = rng.standard_normal((t, e), np.float32).astype(ml_dtypes.bfloat16)
                bias = np.linspace(-0.01, 0.01, e, dtype=np.float32) if has_bias else None
                _, m, saved = K.topk_with_score_function_fwd(
                    cuda.to_device(x.view(np.uint16)), k, pre, g, kg, scale, sf,
                    None if bias is None else cuda.to_device(bias), fmt)
                gp = rng.standard_normal((t, e), np.float32).astype(ml_dtypes.bfloat16)
                d_gp = cuda.to_device(gp.view(np.uint16))
                want = np.asarray(ref.topk_with_score_function_bwd(
                    m.copy_to_host(), saved.copy_to_host(), gp, k, pre, scale, SF_NAMES[sf]), np.float32)
                spec = _plan.spec_of((t, e), L.BF16)
                row = {"case": name, "T": t, "map_format": fmt}
                outs = {}
                for i, setting in enumerate(settings):
                    tiling = K.TopkTiling(bwd=K.BwdTiling(**setting))
                    tag = "" if len(settings) == 1 else f"#{i} "
                    if tag:
                        row[f"{tag}knobs"] = setting
                    for path in args.paths.split(","):
                        if i and path != "warp":  # the knobs are the warp kernel's
                            continue
                        name_ = tag + path
                        try:
                            plan = K.topk_with_score_function_bwd_plan(spec, k, pre, np.float32(scale), sf, fmt,
                                                                       path, tiling)
                        except ValueError as err:  # path='warp' on a shape it does not take
                            row[f"{name_} error"] = str(err)
                            continue
                        row[name_], (out,) = time_plan(plan, [[m, saved, d_gp]], args.repeats, spin)
                        regs = plan.steps[0].kernel.get_regs_per_thread()
                        row[f"{name_} regs"] = sorted(regs.values()) if isinstance(regs, dict) else regs
                        got = out.view(ml_dtypes.bfloat16).astype(np.float32)
                        rel = float(np.nanmax(np.abs(got - want)) / max(np.nanmax(np.abs(want)), 1e-30))
                        row[f"{name_} max rel"] = rel
                        row[f"{name_} ok"] = ok = bool(rel <= 1e-2
                                                       and np.array_equal(np.isnan(got), np.isnan(want)))
                        failed |= not ok
                        outs[name_] = out
                first, *others = list(outs) or [None]
                for path in others:
                    row[f"bits differ ({path})"] = int(np.sum(outs[first] != outs[path]))
                report(rows, row)
    save_rows(args.json, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
