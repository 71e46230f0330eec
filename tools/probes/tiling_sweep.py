"""Kernel times of the router kernels of the model presets under other tilings
of the top-k families (``TokenTiling``, ``RowTiling``, ``BwdTiling`` in a
``TopkTiling``; GPU only): the measurements behind their defaults.

``python tools/probes/tiling_sweep.py [--presets deepseek-v3,qwen3] [--repeats 30]
[--settings '[{}, {"bwd.quad_threads": 64}]']``

A setting names fields of the parts of ``TopkTiling`` (``token.max_tokens``,
``bwd.quad_lanes_dense``, ...); each builds one ``TopkTiling``, passed to the
plans (their cache key): the top-k forward and backward and the aux-score
forward and backward plans of each preset, timed as the pointer transports
launch them (``gpurouter.bench.timing.time_plan``), each output checked bit for
bit against the defaults' (``same``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import ml_dtypes
import numpy as np
from numba import cuda

from gpurouter import kernels as K
from gpurouter.bench.timing import preset_cases, spin_kernel, time_plan
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base.plan import spec_of

SETTINGS = [
    {},
    {"token.max_tokens": 16},
    {"token.max_tokens": 8},
    {"token.min_threads": 128},
    {"bwd.quad_lanes_sparse": 16},
    {"bwd.quad_lanes_dense": 8},
    {"bwd.quad_threads": 256},
]


def tiling_of(setting: dict) -> K.TopkTiling:
    """The ``TopkTiling`` of a setting ``{"part.field": value}`` (the rest: the library's)."""
    parts = {}
    for key, value in setting.items():
        part, field = key.split(".")
        parts.setdefault(part, {})[field] = tuple(value) if isinstance(value, list) else value
    base = K.TopkTiling()
    return dataclasses.replace(base, **{p: dataclasses.replace(getattr(base, p), **f) for p, f in parts.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="deepseek-v3,qwen3")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--settings", help='JSON list of settings, e.g. \'[{}, {"bwd.quad_threads": 64}]\'')
    args = ap.parse_args()
    settings = json.loads(args.settings) if args.settings else SETTINGS
    spin = spin_kernel()
    t = args.tokens
    for name, (e, k, g, kg, sf, has_bias, pre) in preset_cases(args.presets.split(",")).items():
        rng = np.random.default_rng(0)
        x = cuda.to_device(rng.standard_normal((t, e), np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
        bias = cuda.to_device(np.linspace(-0.01, 0.01, e, dtype=np.float32))
        grad = cuda.to_device(rng.standard_normal((t, e), np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
        spec = spec_of((t, e), L.BF16)
        first = {}
        for setting in settings:
            tiling = tiling_of(setting)
            fwd = K.topk_with_score_function_fwd_plan(spec, has_bias, k, pre, g, kg, np.float32(2.5), sf,
                                                      tiling=tiling)
            row = {"setting": setting or "defaults", "preset": name}
            row["topk fwd"], outs = time_plan(fwd, [[x, bias] if has_bias else [x]], args.repeats, spin)
            d_map, d_saved = (cuda.to_device(o) for o in outs[1:3])
            bwd = K.topk_with_score_function_bwd_plan(spec, k, pre, np.float32(2.5), sf, tiling=tiling)
            row["topk bwd"], douts = time_plan(bwd, [[d_map, d_saved, grad]], args.repeats, spin)
            afwd = K.score_for_aux_loss_fwd_plan(spec, k, sf, tiling=tiling)
            row["aux fwd"], aouts = time_plan(afwd, [[x]], args.repeats, spin)
            abwd = K.score_for_aux_loss_bwd_plan(spec_of((t, e), L.F32), sf, L.BF16, tiling=tiling)
            g32 = cuda.to_device(rng.standard_normal((t, e), np.float32))
            row["aux bwd"], _ = time_plan(abwd, [[cuda.to_device(aouts[2]), g32]], args.repeats, spin)
            got = [o.view(np.uint8) for o in (*outs, *douts)]
            first = first or {"outs": got}
            row["same"] = all(np.array_equal(a, b) for a, b in zip(first["outs"], got, strict=True))
            print(json.dumps({key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
