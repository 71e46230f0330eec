"""Tile-knob sweep of the token-level MoE kernels (GPU): each variant's
``kernel_us`` per op at one shape, the way ``moe_bench.py`` times them.

``python tools/moe_sweep.py [--shape qwen3] [--repeats 30] [--variants 'DB_HOLD_ROWS=4;CMB_HOLD=4,CMB_MAX_REGS=64']
[--ops dbias_dscales,dbias]``

A variant is a comma-separated list of ``NAME=int`` module constants of
``moe_grouped_dbias`` (``DB_*``) or ``moe_combine`` (``CMB_*``); the plans are
re-made for each.  The first variant is the modules' defaults.  ``--ops``: only
these ops (default: all six).
"""

from __future__ import annotations

import argparse

import numpy as np
from _timing import spin_kernel
from moe_bench import BF16, SHAPES, _dev, kernel_us  # tools/moe_bench.py
from numba import cuda

from gpurouter import kernels as K
from gpurouter.kernels._base.plan import spec_for
from gpurouter.kernels.moe import combine as C
from gpurouter.kernels.moe import grouped_dbias as G
from gpurouter.kernels.moe import plans as P


def _set(variant: str) -> dict:
    old = {}
    for kv in filter(None, variant.split(",")):
        name, v = kv.split("=")
        mod = G if name.startswith("DB_") else C
        old[name] = (mod, getattr(mod, name))
        setattr(mod, name, int(v))
    for f in (P.grouped_dbias_dscales_plan, P.token_combine_fwd_plan, P.token_combine_bwd_plan,
              P.token_dispatch_fwd_plan):
        f.cache_clear()
    return old


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", default="")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    a = ap.parse_args()
    sh = SHAPES[a.shape]
    t, h, e, k = sh["T"], sh["H"], sh["E"], sh["K"]
    n = t * k
    rng = np.random.default_rng(0)
    rid = np.full((t, e), -1, np.int32)
    sizes = np.zeros(e, np.int64)
    chosen = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    for ex in range(e):  # rows grouped by expert, tokens ascending inside one
        toks = np.nonzero((chosen == ex).any(1))[0]
        rid[toks, ex] = sizes.sum() + np.arange(len(toks))
        sizes[ex] = len(toks)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    probs = np.where(rid >= 0, rng.random((t, e)), 0).astype(np.float32)
    big = [_dev(rng.standard_normal((n, h)).astype(BF16)) for _ in range(2)]
    small = [_dev(rng.standard_normal((t, h)).astype(BF16)) for _ in range(2)]
    sc, bias = _dev(rng.random(n).astype(np.float32)), _dev(rng.standard_normal((e, h)).astype(BF16))
    d_off, d_rid, d_w = _dev(offsets), _dev(rid), _dev(probs)
    bf, f32, i32 = np.uint16, np.float32, np.int32
    zs, rs, ws = spec_for((n, h), bf), spec_for((t, e), i32), spec_for((t, e), f32)
    spin = spin_kernel()
    for variant in [""] + [v for v in a.variants.split(";") if v]:
        old = _set(variant)
        ops = {  # name: (plan, argument lists), made only when timed
            "dbias_dscales": lambda: (K.grouped_dbias_dscales_plan(zs, spec_for((n,), f32), spec_for((e, h), bf),
                                                                   spec_for((e + 1,), i32)),
                                      [[d, sc, bias, d_off] for d in big]),
            "dbias": lambda: (K.grouped_dbias_dscales_plan(zs, None, None, spec_for((e + 1,), i32)),
                              [[d, d_off] for d in big]),
            "combine_fwd": lambda: (P.token_combine_fwd_plan(zs, rs, ws), [[z, d_rid, d_w] for z in big]),
            "combine_bwd": lambda: (P.token_combine_bwd_plan(spec_for((t, h), bf), zs, rs, ws),
                                    [[g, z, d_rid, d_w] for g, z in zip(small, big, strict=True)]),
            "dispatch_fwd": lambda: (P.token_dispatch_fwd_plan(spec_for((t, h), bf), rs, n),
                                     [[x, d_rid] for x in small]),
            "dispatch_bwd": lambda: (P.token_combine_fwd_plan(zs, rs), [[z, d_rid] for z in big]),
        }
        wanted = [o for o in a.ops.split(",") if o] or list(ops)
        row = {}
        for name in wanted:
            plan, args = ops[name]()
            row[name] = kernel_us(plan, args, a.repeats, spin)
        print(f"{variant or 'defaults':<48} " + " ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
        for name, (mod, v) in old.items():
            setattr(mod, name, v)
    cuda.synchronize()


if __name__ == "__main__":
    main()
