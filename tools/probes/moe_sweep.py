"""Tile-knob sweep of the token-level MoE kernels (GPU): each variant's
``kernel_us`` per op at one shape, the way ``moe_bench.py`` times them.

``python tools/probes/moe_sweep.py [--shape qwen3] [--repeats 30]
[--variants 'dbias.hold_rows=4;combine.hold=4,combine.max_regs=64'] [--ops dbias_dscales,dbias]``

A variant is a comma-separated list of ``part.field=int``: fields of
``grouped_dbias.DbiasTiling`` (``dbias.*``) or ``combine.CombineTiling``
(``combine.*``); each variant builds the two tilings and passes them to the
plans.  The first variant is the defaults.  ``--ops``: only these ops
(default: all six).
"""

from __future__ import annotations

import argparse

import numpy as np
from moe_bench import BF16, SHAPES, _dev, kernel_us  # tools/probes/moe_bench.py
from numba import cuda

from gpurouter import kernels as K
from gpurouter.bench.timing import spin_kernel
from gpurouter.kernels._base.plan import spec_for
from gpurouter.kernels.moe import plans as P


def tilings(variant: str) -> tuple[K.DbiasTiling, K.CombineTiling]:
    """The ``(DbiasTiling, CombineTiling)`` of a variant (module docstring)."""
    knobs = {"dbias": {}, "combine": {}}
    for kv in filter(None, variant.split(",")):
        name, v = kv.split("=")
        part, field = name.split(".")
        knobs[part][field] = int(v)
    return K.DbiasTiling(**knobs["dbias"]), K.CombineTiling(**knobs["combine"])


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

    def ops_of(db, cmb):
        """The ops' plans with these tilings and their argument lists, made only when timed."""
        return {  # name: (plan, argument lists)
            "dbias_dscales": lambda: (K.grouped_dbias_dscales_plan(zs, spec_for((n,), f32), spec_for((e, h), bf),
                                                                   spec_for((e + 1,), i32), tiling=db),
                                      [[d, sc, bias, d_off] for d in big]),
            "dbias": lambda: (K.grouped_dbias_dscales_plan(zs, None, None, spec_for((e + 1,), i32), tiling=db),
                              [[d, d_off] for d in big]),
            "combine_fwd": lambda: (P.token_combine_fwd_plan(zs, rs, ws, tiling=cmb), [[z, d_rid, d_w] for z in big]),
            "combine_bwd": lambda: (P.token_combine_bwd_plan(spec_for((t, h), bf), zs, rs, ws, tiling=cmb),
                                    [[g, z, d_rid, d_w] for g, z in zip(small, big, strict=True)]),
            "dispatch_fwd": lambda: (P.token_dispatch_fwd_plan(spec_for((t, h), bf), rs, n, tiling=cmb),
                                     [[x, d_rid] for x in small]),
            "dispatch_bwd": lambda: (P.token_combine_fwd_plan(zs, rs, tiling=cmb), [[z, d_rid] for z in big]),
        }

    spin = spin_kernel()
    for variant in [""] + [v for v in a.variants.split(";") if v]:
        ops = ops_of(*tilings(variant))
        wanted = [o for o in a.ops.split(",") if o] or list(ops)
        row = {}
        for name in wanted:
            plan, args = ops[name]()
            row[name] = kernel_us(plan, args, a.repeats, spin)
        print(f"{variant or 'defaults':<48} " + " ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
    cuda.synchronize()


if __name__ == "__main__":
    main()
