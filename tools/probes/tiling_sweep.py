"""Kernel times of the DeepSeek-V3 and Qwen3 router kernels under other tiling
knobs of ``kernels/_tiling.py`` (GPU only): the measurements behind the
knobs' defaults.

``python tools/tiling_sweep.py [--presets deepseek-v3,qwen3] [--repeats 30]``

Each setting patches the knobs, forgets the cached plans and runs the
benchmark's kernel rows (checked against the reference first).
"""

from __future__ import annotations

import argparse
import json

from gpurouter import bench
from gpurouter.kernels import _tiling as L
from gpurouter.kernels.topk import aux_plans as aux_scores
from gpurouter.kernels.topk import plans as topk

SETTINGS = [
    {},
    {"TOKEN_MAX_TOKENS": 16},
    {"TOKEN_MAX_TOKENS": 8},
    {"TOKEN_MIN_THREADS": 128},
    {"QUAD_LANES_SPARSE": 16},
    {"QUAD_LANES_DENSE": 8},
    {"QUAD_THREADS": 256},
]


def _clear():
    for f in (topk.topk_with_score_function_fwd_plan, topk.topk_with_score_function_bwd_plan,
              aux_scores.score_for_aux_loss_fwd_plan, aux_scores.score_for_aux_loss_bwd_plan):
        f.cache_clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="deepseek-v3,qwen3")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--settings", help='JSON list of knob dicts, e.g. \'[{}, {"QUAD_THREADS": 64}]\'')
    args = ap.parse_args()
    settings = json.loads(args.settings) if args.settings else SETTINGS
    defaults = {k: getattr(L, k) for s in settings for k in s}
    for setting in settings:
        for k, v in defaults.items():
            setattr(L, k, setting.get(k, v))
        _clear()
        for name in args.presets.split(","):
            rows = bench.bench_preset(name, args.tokens, ["kernel"], args.repeats, 4.0, 0)
            cells = "  ".join(f"{r.op} {r.phase} {r.us:7.1f}" for r in rows if r.op != "aux_loss")
            print(f"{setting or 'defaults'!s:<28} {name:<12} {cells}", flush=True)


if __name__ == "__main__":
    main()
