"""Kernel time of the thread-per-token top-k forward at small T against its
chunk lanes (``gpurouter/kernels/topk/token/chunk_lanes.py``) and their tiling (GPU).

For each preset and T: the forward with the lanes off (``TokenTiling``'s
``*_lanes_max_tokens`` set to 0) and on (the defaults), at each ``--min-blocks``
(``TokenTiling.lanes_min_blocks``, the grid the tile shrinks to reach),
plain and with ``return_indices``; every variant's outputs are checked bit
for bit against the first one's (``same``), and ``--save`` writes the
default variant's outputs (probs, map, indices) to compare across trees
(``--compare``: another run's file).  The floor: an empty kernel timed the same way.

    python3 tools/probes/lanes_probe.py --tokens 256,1024,4096 --min-blocks 128,264 --tree 0 --save out.npz
"""

from __future__ import annotations

import argparse
import json
import sys

import ml_dtypes
import numpy as np
from numba import cuda

from gpurouter import kernels as K
from gpurouter.bench.timing import floor_us, preset_cases, spin_kernel, time_plan
from gpurouter.kernels._base import launch as L
from gpurouter.kernels.topk import plans as T

CASES = preset_cases(("deepseek-v3", "qwen3", "kimi-k2"))  # name: (E, K, G, Kg, sf, bias, pre)


def cut_selector(cut: str):
    """``topk/token/chunk_lanes.lane_selector`` with phases taken out (a timing probe: the
    outputs are wrong): ``lists`` (only its barrier kept), ``merge``, ``masks``, ``token``
    (``keys`` and ``finish``: nothing selected), or ``all`` of them."""
    from gpurouter.kernels.topk.token import chunk_lanes as TL

    @cuda.jit(device=True)
    def no_lists(smem, tid, nthreads, nt, tile_tokens, stride, o_bias, num_experts, num_groups, group_topk, o_gs,
                 o_lists):
        cuda.syncthreads()

    @cuda.jit(device=True)
    def no_merge(smem, bits, tid, nthreads, nt, tile_tokens, num_experts, num_groups, group_topk, o_lists):
        pass

    @cuda.jit(device=True)
    def no_masks(smem, bits, tid, nthreads, nt, tile_tokens, stride, o_bias, num_experts, num_groups, o_lists, o_thr):
        pass

    @cuda.jit(device=True)
    def no_keys(smem, bits, tid, row, num_experts, num_groups, o_bias, o_lists, fword, keys, sel, rv, o_thr):
        keys[7] = np.float32(np.inf)
        return np.int32(0), np.float32(1), np.int32(0)

    @cuda.jit(device=True)
    def no_finish(smem, bits, tid, row, num_experts, num_groups, o_bias, o_lists, keys, need, total, n, sel, rv,
                  xarr, xb):
        return np.float32(1), np.float32(0), keys[7], np.int32(0)

    def make(*a):
        lists, rank, merge, keys_of, masks, finish, area = TL.lane_selector(*a)
        if cut in ("lists", "all"):
            lists = no_lists
        if cut in ("masks", "all"):
            masks = no_masks
        if cut in ("token", "all"):
            keys_of, finish = no_keys, no_finish
        if cut in ("merge", "all"):
            merge = no_merge
        return lists, rank, merge, keys_of, masks, finish, area

    return make


def knobs(lanes: bool, min_blocks: int | None, tree: bool | None = None) -> K.TopkTiling:
    """The plans' tiling: the lanes of every kind on (the defaults) or off; ``min_blocks``
    and ``tree`` where given."""
    token = {} if lanes else dict(group_lanes_max_tokens=0, chunk_lanes_max_tokens=(0, 0))
    if min_blocks is not None:
        token["lanes_min_blocks"] = min_blocks
    if tree is not None:
        token["lanes_tree"] = tree
    return K.TopkTiling(token=K.TokenTiling(**token))


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,4096,8192,16384,65536")
    ap.add_argument("--min-blocks", default="128", help="lanes_min_blocks values (the first: --save's)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--tree", default="", help="lanes_tree values (0/1) to time besides the default")
    ap.add_argument("--cuts", default="", help="phases to take out (cut_selector), timed at the default knobs")
    ap.add_argument("--save")
    ap.add_argument("--compare")
    args = ap.parse_args(argv)
    spin = spin_kernel()
    print(json.dumps({"floor us (empty kernel)": floor_us(args.repeats, spin)}), flush=True)
    saved = {}
    ref = dict(np.load(args.compare)) if args.compare else {}
    mbs = [int(v) for v in args.min_blocks.split(",")]
    for name in args.cases.split(","):
        e, k, g, kg, sf, has_bias, pre = CASES[name]
        for t in (int(v) for v in args.tokens.split(",")):
            rng = np.random.default_rng(0)
            x = cuda.to_device(rng.standard_normal((t, e), np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
            bias = cuda.to_device(np.linspace(-0.01, 0.01, e, dtype=np.float32))
            arrays = [x, bias] if has_bias else [x]
            spec = T.spec_of((t, e), L.BF16)
            row = {"case": name, "T": t}
            first = {}
            variants = [(True, mb) for mb in mbs] + [(False, None)]
            for idx in (False, True):
                for lanes, mb in variants:
                    plan = K.topk_with_score_function_fwd_plan(spec, has_bias, k, pre, g, kg, np.float32(2.5), sf,
                                                               0, idx, tiling=knobs(lanes, mb))
                    st = plan.steps[0]
                    tag = (f"lanes@{mb}" if lanes else "off") + (" +idx" if idx else "")
                    us, outs = time_plan(plan, [arrays], args.repeats, spin)
                    row[tag] = round(us, 2)
                    row[tag + " grid"] = f"{st.grid}x{st.block}"
                    outs = [o.view(np.uint8) for o in outs if o.shape != (t, e) or o.dtype != np.float32]
                    if idx not in first:
                        first[idx] = outs
                        if (lanes, mb) == variants[0]:
                            for i, o in enumerate(outs):
                                saved[f"{name}/{t}/{int(idx)}/{i}"] = o
                    else:
                        row[tag + " same"] = all(np.array_equal(a, b) for a, b in zip(first[idx], outs, strict=True))
            for th in (bool(int(v)) for v in args.tree.split(",") if v):
                plan = K.topk_with_score_function_fwd_plan(spec, has_bias, k, pre, g, kg, np.float32(2.5), sf, 0,
                                                           tiling=knobs(True, mbs[0], th))
                us, outs = time_plan(plan, [arrays], args.repeats, spin)
                tag = f"lanes@{mbs[0]} tree {th}"
                row[tag] = round(us, 2)
                row[tag + " grid"] = f"{plan.steps[0].grid}x{plan.steps[0].block}"
                outs = [o.view(np.uint8) for o in outs if o.shape != (t, e) or o.dtype != np.float32]
                row[tag + " same"] = all(np.array_equal(a, b) for a, b in zip(first[False], outs, strict=True))
            for cut in [v for v in args.cuts.split(",") if v]:
                from gpurouter.kernels.topk.token import fwd as R
                orig = R.lane_selector
                R.lane_selector = cut_selector(cut)
                R.token_topk_fwd_kernel.cache_clear()
                T.topk_with_score_function_fwd_plan.cache_clear()  # (its kernel changed, not its tiling)
                plan = K.topk_with_score_function_fwd_plan(spec, has_bias, k, pre, g, kg, np.float32(2.5), sf, 0,
                                                           tiling=knobs(True, mbs[0]))
                row[f"cut {cut}"] = round(time_plan(plan, [arrays], args.repeats, spin)[0], 2)
                R.lane_selector = orig
                R.token_topk_fwd_kernel.cache_clear()
                T.topk_with_score_function_fwd_plan.cache_clear()
            if ref:
                row["same as --compare"] = all(
                    np.array_equal(ref[key], saved[key]) for key in saved if key.startswith(f"{name}/{t}/"))
            print(json.dumps(row), flush=True)
    if args.save:
        np.savez(args.save, **saved)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
