"""BYTEMAP vs BITMAP_U8 routing maps on the GPU: the top-k forward and the
backward from each map, timed, and checked against each other at full size.

``python tools/probes/map_format_probe.py [--tokens 65536] [--repeats 100] [--json out.json]``

Cases: DeepSeek-V3 (E=256, K=8, 8 groups / 4, sigmoid + fp32 bias, scaling
2.5, bf16 logits: the thread-per-token forward and the quad backward) and
Nemotron-like (E=512, K=22, sigmoid + bias, scaling 5, bf16: the W-lane
forward).  Each plan runs the way the zero-copy transport runs it
(``_base/pointer.PointerLaunch`` on raw pointers of numba device arrays), inputs
rotated over three sets (more bytes than L2 holds).  Time: CUDA events around
each launch, the launches queued behind a sleeping kernel (so the host's
launch rate is not what is timed), the median of ``--repeats``.  The formats
are timed alternately, twice each (0, 1, 0, 1), to show the run-to-run
spread.  Checks: bitmap == ``np.packbits(bytemap, -1, bitorder="little")``,
probs / saved / grad_logits the same bytes.
"""

from __future__ import annotations

import argparse
import json

import ml_dtypes
import numpy as np
from numba import cuda

from gpurouter import kernels as K
from gpurouter.bench.timing import median_us as _time
from gpurouter.bench.timing import ptr as _ptr
from gpurouter.bench.timing import spin_kernel as _spin_kernel
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan
from gpurouter.kernels._base import pointer as _pointer

CASES = {  # name: (E, K, G, Kg, sf, bias, scale)
    "deepseek_v3": (256, 8, 8, 4, L.SIGMOID, True, 2.5),
    "nemotron_wlane": (512, 22, -1, -1, L.SIGMOID, True, 5.0),
}


def _device_like(spec):
    return cuda.device_array(spec.shape, dtype=spec.dtype)


def run_case(name, tokens, repeats, spin):
    E, k, G, Kg, sf, has_bias, scale = CASES[name]
    rng = np.random.default_rng(0)
    xs = [cuda.to_device(rng.standard_normal((tokens, E), np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
          for _ in range(3)]
    bias = cuda.to_device((rng.integers(-32, 33, E) / 256).astype(np.float32))
    grad = cuda.to_device(rng.standard_normal((tokens, E), np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
    spec = _plan.spec_of((tokens, E), L.BF16)
    res = {"case": name, "T": tokens, "E": E, "K": k, "fwd_us": {0: [], 1: []}, "bwd_us": {0: [], 1: []}}
    fwd, bwd, outs, gl = {}, {}, {}, {}
    for fmt in (0, 1):
        plan = K.topk_with_score_function_fwd_plan(spec, has_bias, k, False, G, Kg, np.float32(scale), sf, fmt)
        res.setdefault("fwd_kernel", {})[fmt] = plan.steps[0].kernel.py_func.__module__
        outs[fmt] = [_device_like(sp) for sp in plan.outs]
        fwd[fmt] = (_pointer.PointerLaunch(plan, 0),
                    [[_ptr(x)] + ([_ptr(bias)] if has_bias else []) + [_ptr(o) for o in outs[fmt]] for x in xs])
        bplan = K.topk_with_score_function_bwd_plan(spec, k, False, np.float32(scale), sf, fmt)
        gl[fmt] = _device_like(bplan.outs[0])
        bwd[fmt] = (_pointer.PointerLaunch(bplan, 0),
                    [[_ptr(outs[fmt][1]), _ptr(outs[fmt][2]), _ptr(grad), _ptr(gl[fmt])]])
    # correctness at full size: the first input set, both formats
    for fmt in (0, 1):
        fwd[fmt][0](fwd[fmt][1][0], 0)
    cuda.synchronize()
    for fmt in (0, 1):
        bwd[fmt][0](bwd[fmt][1][0], 0)
    cuda.synchronize()
    h = {fmt: [o.copy_to_host() for o in outs[fmt]] for fmt in (0, 1)}
    checks = {
        "bitmap_is_packed_bytemap": bool(np.array_equal(h[1][1], np.packbits(h[0][1], axis=-1, bitorder="little"))),
        "k_per_row": bool((h[0][1].sum(-1) == k).all()),
        "probs_same_bits": h[0][0].tobytes() == h[1][0].tobytes(),
        "saved_same_bits": h[0][2].tobytes() == h[1][2].tobytes(),
        "grad_same_bits": gl[0].copy_to_host().tobytes() == gl[1].copy_to_host().tobytes(),
    }
    res["checks"] = checks
    for fmt in (0, 1, 0, 1):
        res["fwd_us"][fmt].append(round(_time(*fwd[fmt], repeats, spin), 2))
    for fmt in (0, 1, 0, 1):
        res["bwd_us"][fmt].append(round(_time(*bwd[fmt], repeats, spin), 2))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spin = _spin_kernel()
    out = {"device": cuda.get_current_device().name.decode() if isinstance(
        cuda.get_current_device().name, bytes) else str(cuda.get_current_device().name), "results": []}
    print(f"device: {out['device']}")
    for name in args.cases.split(","):
        r = run_case(name, args.tokens, args.repeats, spin)
        out["results"].append(r)
        print(f"{name} T={r['T']} E={r['E']} K={r['K']} fwd kernel {r['fwd_kernel'][0]}")
        print(f"  checks: {r['checks']}")
        for what in ("fwd_us", "bwd_us"):
            print(f"  {what[:3]}  BYTEMAP {r[what][0]}  BITMAP_U8 {r[what][1]}  (median us, alternating runs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
