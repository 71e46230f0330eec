"""Resource report of the kernels a preset launches (GPU only): registers, local
memory, shared memory, resident blocks per SM and a SASS opcode census.

``python tools/probes/kernel_report.py [--preset deepseek-v3] [--tokens 65536]``

What costs no device time to read and answers most "why is it slow"
questions: spills (LDL/STL), calls that
were not inlined (CALL), barriers, and how many blocks fit on an SM.
"""

from __future__ import annotations

import argparse
import collections
import re

import numpy as np
from numba import cuda

from gpurouter import kernels as K
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan
from gpurouter.kernels._base import pointer as _pointer
from gpurouter.presets import PRESETS


def plans(preset: str, tokens: int):
    p = PRESETS[preset]
    kw = p.router_kwargs()
    sf = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}[kw["score_function"]]
    x = _plan.spec_of((tokens, p.num_experts), L.BF16)
    yield "topk fwd", K.topk_with_score_function_fwd_plan(
        x, p.expert_bias, p.topk, kw["use_pre_softmax"], kw["num_groups"] or -1, kw["group_topk"] or -1,
        np.float32(kw["scaling_factor"]), sf)
    yield "topk bwd", K.topk_with_score_function_bwd_plan(x, p.topk, kw["use_pre_softmax"],
                                                          np.float32(kw["scaling_factor"]), sf)
    yield "aux scores fwd", K.score_for_aux_loss_fwd_plan(x, p.topk, sf)
    yield "aux scores bwd", K.score_for_aux_loss_bwd_plan(_plan.spec_of(x.shape, L.F32), sf, L.BF16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--launch", action="store_true",
                    help="also run each kernel once on random inputs (for a profiler: ncu ... python3 this --launch)")
    args = ap.parse_args()
    ctx = cuda.current_context()
    rng = np.random.default_rng(0)
    for name, plan in plans(args.preset, args.tokens):
        specs = {"in": plan.ins, "out": plan.outs, "tmp": plan.tmps}
        for st in plan.steps:
            kern = st.kernel.compile(tuple(_pointer._numba_type(a, specs) for a in st.args))
            cufunc = kern._codelibrary.get_cufunc()
            blocks = ctx.get_active_blocks_per_multiprocessor(cufunc, st.block, st.shared)
            sass = kern.inspect_sass()
            ops = collections.Counter(m.group(1).split(".")[0] for m in
                                      re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)",
                                                  sass, re.M))
            print(f"{name}: grid {st.grid} x {st.block} threads, {st.shared} B dynamic shared; "
                  f"{kern.regs_per_thread} regs, {kern.local_mem_per_thread} B local; "
                  f"{blocks} blocks/SM ({blocks * st.block} threads)")
            print(f"  SASS {sum(ops.values())} instructions; " + ", ".join(
                f"{op} {n}" for op, n in ops.most_common(14)))
            print("  " + ", ".join(f"{op} {ops.get(op, 0)}" for op in ("LDL", "STL", "CALL", "BAR", "LDG", "STG",
                                                                       "LDS", "STS", "MUFU", "I2F", "F2I")))
        if args.launch:
            arrays = {"in": [], "out": [], "tmp": []}
            for role, sps in (("in", plan.ins), ("out", plan.outs), ("tmp", plan.tmps)):
                for sp in sps:
                    if sp.dtype == np.bool_:
                        h = rng.random(sp.shape) < 0.03
                    elif sp.kind == L.BF16:
                        h = (rng.standard_normal(sp.shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)
                    else:
                        h = rng.standard_normal(sp.shape).astype(sp.dtype)
                    arrays[role].append(cuda.to_device(h))
            for st in plan.steps:
                L.launch(st.kernel, st.grid, st.block, 0, st.shared,
                         *(_plan._resolve(a, arrays) for a in st.args))
            cuda.synchronize()


if __name__ == "__main__":
    main()
