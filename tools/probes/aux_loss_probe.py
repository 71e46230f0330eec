"""Kernel time of the aux loss's forward and backward plans against T and the
column tiling's knobs (GPU).

For each T (C = 256 columns of fp32 aux scores, int32 counts, the aux path
of ``python -m gpurouter steps``): the forward plan's kernel time (CUDA
events around plan launches on raw pointers, queued behind a sleep kernel,
inputs rotated over 4 buffers) at each ``--knobs`` setting of
``AuxLossTiling.column_blocks`` / ``column_min_rows``, its loss checked against a
float64 NumPy sum (``rel err``), and the backward once. Run it on two trees
(``PYTHONPATH``) to compare kernels. The floor: an empty kernel timed the same way.

    python3 tools/probes/aux_loss_probe.py --tokens 4096,8192,65536 --knobs 256:64,512:16,1024:16
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from numba import cuda

from gpurouter.bench.timing import floor_us, report, save_rows, spin_kernel, time_plan
from gpurouter.kernels._base.plan import spec_for
from gpurouter.kernels.losses import aux_loss as A
from gpurouter.kernels.losses.tiling import AUX_LOSS_TILING, AuxLossTiling


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,8192,65536")
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--knobs", default="", help="column_blocks:column_min_rows settings besides the defaults")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args()
    spin = spin_kernel()

    rows = [{"floor us (empty kernel)": round(floor_us(a.repeats, spin), 2)}]
    print(json.dumps(rows[0]), flush=True)
    default = (AUX_LOSS_TILING.column_blocks, AUX_LOSS_TILING.column_min_rows)
    settings = [default] + [tuple(int(v) for v in k.split(":")) for k in a.knobs.split(",") if k]
    c = a.cols
    for t in (int(v) for v in a.tokens.split(",")):
        rng = np.random.default_rng(0)
        host = [rng.random((t, c), np.float32) for _ in range(4)]
        tpe = rng.integers(0, 2 * t, c).astype(np.int32)
        d_tpe = cuda.to_device(tpe)
        sets = [[cuda.to_device(h), d_tpe] for h in host]
        coeff = np.float32(1e-2 * c / (8.0 * t * t))
        row = {"T": t, "C": c}
        for blocks, min_rows in settings:
            tiling = AuxLossTiling(column_blocks=blocks, column_min_rows=min_rows)
            plan = A.moe_aux_loss_fwd_plan(spec_for((t, c), np.float32), spec_for((c,), np.int32), coeff, tiling)
            us, outs = time_plan(plan, sets, a.repeats, spin)
            want = float(coeff) * float(np.sum(host[0].astype(np.float64) * tpe))
            tag = f"fwd {blocks}:{min_rows}"
            row[tag] = round(us, 2)
            row[tag + " grid"] = plan.steps[0].grid
            row[tag + " rel err"] = float(abs(float(outs[0][()]) - want) / abs(want))
        bwd = A.moe_aux_loss_bwd_plan(spec_for((c,), np.int32), spec_for((), np.float32), t)
        g = [cuda.to_device(np.array([coeff], np.float32)), d_tpe, cuda.to_device(np.ones(1, np.float32))]
        row["bwd"] = round(time_plan(bwd, [g], a.repeats, spin)[0], 2)
        report(rows, row)
    save_rows(a.json, rows)


if __name__ == "__main__":
    main()
