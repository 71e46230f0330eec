"""Top-k indices (``return_indices``) and routing replay (``forced_indices``)
on the GPU: the top-k forward plain, with indices, and replayed, timed and
checked at full size.  ``--ways 2,1``: the indices timed for each way
of the thread-per-token kernel (``TokenTiling.indices_way``; variants
``indices@w``).

``python tools/probes/indices_probe.py [--tokens 65536] [--repeats 50] [--ways 2] [--json out.json]``

Cases (bf16 logits, BYTEMAP): DeepSeek-V3 (E=256, K=8, 8 groups / 4,
sigmoid + fp32 bias, scaling 2.5), Qwen3 (E=128, K=8, softmax), Mixtral
(E=8, K=2, softmax).  Each plan runs the way the zero-copy transport runs it
(``_base/pointer.PointerLaunch`` on raw pointers), inputs rotated over three sets;
time: CUDA events around each launch, the launches queued behind a sleeping
kernel, the median of ``--repeats``; the variants alternate, twice each.
Checks: the plain call's outputs are the indices call's; the replay of the
returned indices gives the same bytes (probs, map, saved); every row's
indices are its map's K experts, in non-increasing order of ``s + bias``.
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
    "qwen3": (128, 8, -1, -1, L.SOFTMAX, False, 1.0),
    "mixtral": (8, 2, -1, -1, L.SOFTMAX, False, 1.0),
}


def _device_like(spec):
    return cuda.device_array(spec.shape, dtype=spec.dtype)


def _indices_plan(args, way):
    tiling = K.TopkTiling(token=K.TokenTiling(indices_way=way))
    return K.topk_with_score_function_fwd_plan(*args, return_indices=True, tiling=tiling)


def run_case(name, tokens, repeats, spin, ways=(2,)):
    E, k, G, Kg, sf, has_bias, scale = CASES[name]
    rng = np.random.default_rng(0)
    xs_h = [rng.standard_normal((tokens, E), np.float32).astype(ml_dtypes.bfloat16) for _ in range(3)]
    xs = [cuda.to_device(x.view(np.uint16)) for x in xs_h]
    bias_h = (rng.integers(-32, 33, E) / 256).astype(np.float32)
    bias = cuda.to_device(bias_h)
    spec = _plan.spec_of((tokens, E), L.BF16)
    args = (spec, has_bias, k, False, G, Kg, np.float32(scale), sf, 0)
    plans = {"plain": K.topk_with_score_function_fwd_plan(*args),
             "indices": _indices_plan(args, ways[0]),
             "replay": K.topk_with_score_function_fwd_plan(*args, forced=True)}
    for w in ways[1:]:
        plans[f"indices@{w}"] = _indices_plan(args, w)
    outs = {v: [_device_like(sp) for sp in p.outs] for v, p in plans.items()}
    b = [_ptr(bias)] if has_bias else []
    idx = outs["indices"][3]
    ptrs = {v: [[_ptr(x)] + b + [_ptr(o) for o in outs[v]] for x in xs] for v in plans if v.startswith("indices")}
    ptrs |= {"plain": [[_ptr(x)] + b + [_ptr(o) for o in outs["plain"]] for x in xs],
            # replays the first set's indices on every set (the same work)
            "replay": [[_ptr(x), _ptr(idx)] + [_ptr(o) for o in outs["replay"]] for x in xs]}
    launches = {v: _pointer.PointerLaunch(p, 0) for v, p in plans.items()}
    res = {"case": name, "T": tokens, "E": E, "K": k,
           "kernel": {v: p.steps[0].kernel.py_func.__module__ for v, p in plans.items()}}
    for v in ["plain", "indices", "replay"] + [v for v in plans if "@" in v]:  # the replay reads "indices"
        launches[v](ptrs[v][0], 0)
        cuda.synchronize()
    h = {v: [o.copy_to_host() for o in outs[v]] for v in plans}
    ih = h["indices"][3]
    m = h["plain"][1]
    x0 = xs_h[0].astype(np.float32)
    r = (1 / (1 + np.exp(-x0)) + bias_h) if sf == L.SIGMOID else x0
    rs = np.take_along_axis(r, ih.astype(np.int64), 1)
    res["checks"] = {
        "indices_call_same_outputs": all(a.tobytes() == c.tobytes()
                                         for a, c in zip(h["plain"], h["indices"][:3], strict=True)),
        "replay_same_bytes": all(a.tobytes() == c.tobytes() for a, c in zip(h["plain"], h["replay"], strict=True)),
        "indices_are_the_map": bool((np.sort(ih, 1) == np.sort(np.nonzero(m)[1].reshape(tokens, k), 1)).all()),
        "indices_in_order": bool((np.diff(rs, axis=1) <= 1e-6).all()),
        "ways_same_indices": all(h[v][3].tobytes() == ih.tobytes() for v in plans if "@" in v),
    }
    res["fwd_us"] = {v: [] for v in plans}
    for _ in range(2):
        for v in plans:
            res["fwd_us"][v].append(round(_time(launches[v], ptrs[v], repeats, spin), 2))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--ways", default="2", help="TokenTiling.indices_way values, the first is 'indices'")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    spin = _spin_kernel()
    dev = cuda.get_current_device().name
    out = {"device": dev.decode() if isinstance(dev, bytes) else str(dev), "results": []}
    print(f"device: {out['device']}")
    for name in a.cases.split(","):
        r = run_case(name, a.tokens, a.repeats, spin, tuple(int(w) for w in a.ways.split(",")))
        out["results"].append(r)
        print(f"{name} T={r['T']} E={r['E']} K={r['K']} kernels {r['kernel']}")
        print(f"  checks: {r['checks']}")
        print(f"  fwd median us (twice, alternating): {r['fwd_us']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
