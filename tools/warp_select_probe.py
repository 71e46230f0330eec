"""A warp per token that selects by a bound and a 32-candidate sort: how fast could the
ungrouped large-E forwards be? (GPU only; a probe, not a library kernel.)

The thread-per-token forward spends most of Nemotron-3 Super's 380 µs (E = 512, K = 22,
T = 65536) in one thread's 23-slot register list, and an SM holds only 3 warps of
selecting threads (docs/benchmarks.md, "Large K").  This probe keeps a token's scores in
the registers of one warp (lane l holds the bf16 quads l, l + 32, ...: each load a
warp makes is 256 contiguous bytes) and selects without a list:

1. each lane keeps its two largest ranking scores (score + bias, NaN as -inf);
2. a bitonic sort of those 64 values gives a bound ``b``, their (K+1)-th largest: the
   (K+1)-th largest of any subset of a row is at most the row's, so every expert of the
   top K has a ranking score ``>= b``;
3. the candidates (ranking score ``>= b``: about K + 2 of them for random logits) are
   compacted to shared memory by a prefix count; when there are at most 32, a bitonic
   sort of (score descending, expert ascending) pairs puts the K-th selected expert in
   lane K - 1: its score is the threshold, its expert the tie cutoff (the contract's
   order: the lower expert wins a tie);
4. otherwise (more than 32 candidates: ties, or the top experts crowded into a few lanes)
   K rounds of a warp arg-max over every expert give the same threshold and cutoff.

Then every lane writes its quads: the fp32 scores (``saved``), the bf16 probs (the
selected scores times ``scale / (sum + 1e-20)``) and the byte map.  Cases: sigmoid + fp32
bias, bf16 logits, no groups, K <= 31.  The library's plan runs in the same call; the map
and ``saved`` must equal its own, the probs agree within one bf16 ulp (the sum's order
differs).

    python3 tools/warp_select_probe.py --presets nemotron-3-super,kimi-k2 --tokens 4096,65536

Its figures in docs/benchmarks.md ("A warp a token") were taken at 7532931, when this
file had its own copy of the sorts, scans and bf16 helpers; it now takes the library's
(``kernels/topk/warp/lanes.py``, the same stages) and ``warp_topk_probe.py``'s (not run on a GPU since).
"""

from __future__ import annotations

import argparse
import functools

import ml_dtypes
import numpy as np
from _timing import median_us, report, sass_counts, save_rows, spin_kernel, time_plan
from numba import cuda, float32, int32, uint32, uint64
from warp_topk_probe import bf16, to_bf16

from gpurouter import kernels as K
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan
from gpurouter.kernels._base.device import EPS, sigmoid
from gpurouter.kernels._base.vec import quad_f32
from gpurouter.kernels.topk.warp.lanes import ahead, warp_scans, warp_sorts
from gpurouter.presets import PRESETS

QUAD_STORE = quad_f32()[1]  # 16-byte stores of saved
FULL = np.uint32(0xFFFFFFFF)
NEG_INF = np.float32(-np.inf)
NO_EXPERT = np.int32(0x7FFFFFFF)


@cuda.jit(device=True)
def warp_sum(v):
    v = float32(v + cuda.shfl_xor_sync(FULL, v, 16))
    v = float32(v + cuda.shfl_xor_sync(FULL, v, 8))
    v = float32(v + cuda.shfl_xor_sync(FULL, v, 4))
    v = float32(v + cuda.shfl_xor_sync(FULL, v, 2))
    return float32(v + cuda.shfl_xor_sync(FULL, v, 1))


@functools.cache
def make_kernel(num_experts: int, topk: int, warps: int, max_registers: int = 0):
    Q = num_experts // 128  # quads a lane
    N = 4 * Q
    Q4 = num_experts // 4
    KB = np.int32(topk)  # the bound's place in the 64-sort (0-based): the (K+1)-th largest
    KL = np.int32(topk - 1)  # the K-th selected's lane in the 32-sort
    SLOTS = 32 * warps  # the block's candidates in shared memory
    sort64, sort32, _ = warp_sorts()  # the library's (GPU: shuffles; their shared arrays unread)
    inclusive_sum, arg_max = warp_scans()

    jit = cuda.jit(max_registers=max_registers) if max_registers else cuda.jit

    @jit
    def warp_select(x, bias, probs, saved, rmap, num_tokens, scale, force_fallback, stats):
        cand_v = cuda.shared.array(SLOTS, float32)
        cand_e = cuda.shared.array(SLOTS, int32)
        tid = int32(cuda.threadIdx.x)
        lane = int32(tid & 31)
        lane4 = int32(4 * lane)
        base = int32((cuda.threadIdx.x >> 5) * 32)
        warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5
        nwarps = (cuda.gridDim.x * cuda.blockDim.x) >> 5
        b = cuda.local.array(N, float32)
        for q in range(Q):
            for i in range(4):
                b[4 * q + i] = bias[lane4 + int32(128 * q + i)]
        s = cuda.local.array(N, float32)
        r = cuda.local.array(N, float32)
        fallbacks = int32(0)
        t = warp
        while t < num_tokens:
            row = uint64(t) * uint64(Q4)
            m1 = NEG_INF
            m2 = NEG_INF
            for q in range(Q):
                w = x[row + uint64(lane + 32 * q)]
                for i in range(4):
                    v = sigmoid(bf16(w, i))
                    s[4 * q + i] = v
                    rr = float32(v + b[4 * q + i])
                    if rr != rr:
                        rr = NEG_INF
                    r[4 * q + i] = rr
                    m1, m2 = max(m1, rr), max(m2, min(m1, rr))
            # 2: the bound, the (K+1)-th largest of the lanes' two largest (item 2 lane + h)
            a0, a1 = sort64(m1, m2, cand_v, tid)
            bound = cuda.shfl_sync(FULL, a1 if (KB & 1) else a0, KB >> 1)
            # 3: the candidates' count, their places
            cnt = int32(0)
            for n in range(N):
                cnt += int32(r[n] >= bound)
            incl = inclusive_sum(cnt, cand_e, tid)
            total = cuda.shfl_sync(FULL, incl, 31)
            if total <= 32 and force_fallback == 0:
                pos = base + incl - cnt
                for q in range(Q):
                    for i in range(4):
                        if r[4 * q + i] >= bound:
                            cand_v[pos] = r[4 * q + i]
                            cand_e[pos] = int32(lane4 + int32(128 * q + i))
                            pos += 1
                cuda.syncwarp(FULL)
                cv = NEG_INF
                ce = NO_EXPERT
                if lane < total:
                    cv = cand_v[base + lane]
                    ce = cand_e[base + lane]
                cuda.syncwarp(FULL)
                cv, ce = sort32(cv, ce, cand_v, cand_e, tid)
                thr = cuda.shfl_sync(FULL, cv, KL)
                cut = cuda.shfl_sync(FULL, ce, KL)
            else:  # 4: K rounds of a warp arg-max
                fallbacks += 1
                taken = uint32(0)
                thr = NEG_INF
                cut = NO_EXPERT
                for _ in range(topk):
                    bv = NEG_INF
                    be = NO_EXPERT
                    for q in range(Q):
                        for i in range(4):
                            n = 4 * q + i
                            e = int32(lane4 + int32(128 * q + i))
                            if ((taken >> uint32(n)) & uint32(1)) == 0 and ahead(r[n], e, bv, be):
                                bv = r[n]
                                be = e
                    bv, be = arg_max(bv, be, cand_v, cand_e, tid)
                    for q in range(Q):
                        for i in range(4):
                            if be == int32(lane4 + int32(128 * q + i)):
                                taken |= uint32(1) << uint32(4 * q + i)
                    thr = bv
                    cut = be
            # the selected scores' sum, then every lane's quads
            part = float32(0.0)
            for q in range(Q):
                for i in range(4):
                    n = 4 * q + i
                    e = int32(lane4 + int32(128 * q + i))
                    if (r[n] > thr) | ((r[n] == thr) & (e <= cut)):
                        part = float32(part + s[n])
            part = warp_sum(part)
            inv = float32(scale / float32(part + EPS))
            for q in range(Q):
                pw = uint64(0)
                mw = uint32(0)
                for i in range(4):
                    n = 4 * q + i
                    e = int32(lane4 + int32(128 * q + i))
                    on = (r[n] > thr) | ((r[n] == thr) & (e <= cut))
                    if on:
                        pw |= to_bf16(float32(s[n] * inv)) << uint64(16 * i)
                        mw |= uint32(1) << uint32(8 * i)
                QUAD_STORE(saved, row + uint64(lane + 32 * q), s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3])
                probs[row + uint64(lane + 32 * q)] = pw
                rmap[row + uint64(lane + 32 * q)] = mw
            t += nwarps
        if lane == 0 and fallbacks > 0:
            cuda.atomic.add(stats, 0, fallbacks)

    return warp_select


def logits_for(case, t, e, rng):
    x = rng.standard_normal((t, e), np.float32)
    if case == "ties":  # few distinct values: long runs of ties at the threshold
        x = np.round(x * 2) / 2
    elif case == "crowded":  # the top experts in a few lanes
        x[:, :48] += 4.0
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def run_shape(row, kern, launch, outs, lib, forced, tag, timing):
    """One launch shape: its outputs against the library's (``lib``: probs as fp32, map, saved)."""
    probs, saved, rmap, stats = outs
    t, e = lib[1].shape
    stats.copy_to_device(np.zeros(1, np.int32))
    launch(None, 0)
    cuda.synchronize()
    m = rmap.copy_to_host().view(np.uint8).reshape(t, e)
    pf = (probs.copy_to_host().view(np.uint16).reshape(t, e).astype(np.uint32) << 16).view(np.float32)
    row[tag + " same map"] = bool(np.array_equal(m != 0, lib[1] != 0))
    row[tag + " same saved"] = bool(np.array_equal(saved.copy_to_host(), lib[2].reshape(-1)))
    row[tag + " probs max rel diff"] = float(np.max(np.abs(pf - lib[0]) / np.maximum(np.abs(lib[0]), 1e-30)))
    row[tag + " fallback tokens"] = int(stats.copy_to_host()[0])
    if timing is not None:
        row[tag + " us"] = round(median_us(launch, [[0]], *timing), 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="nemotron-3-super,kimi-k2")
    ap.add_argument("--tokens", default="4096,65536")
    ap.add_argument("--cases", default="normal,ties,crowded", help="logits: normal, ties, crowded")
    ap.add_argument("--warps", default="4,8", help="warps per block")
    ap.add_argument("--blocks-per-sm", default="4,8,16", help="grid = SMs x this (a grid-strided token loop)")
    ap.add_argument("--max-registers", default="0", help="register caps a thread (0: the compiler's choice)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--sass", action="store_true", help="instruction counts of the SASS (needs nvdisasm)")
    ap.add_argument("--sass-out", help="with --sass: write each kernel's SASS to this folder")
    ap.add_argument("--json")
    a = ap.parse_args()
    spin = spin_kernel()
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    warps = [int(v) for v in a.warps.split(",")]
    bpss = [int(v) for v in a.blocks_per_sm.split(",")]
    rows = []
    for name in a.presets.split(","):
        p = PRESETS[name]
        e, k, scale = p.num_experts, p.topk, np.float32(p.scaling_factor)
        assert e % 128 == 0 and k <= 31 and p.score_function == "sigmoid" and p.expert_bias, name
        for case in a.cases.split(","):
            for t in (int(v) for v in a.tokens.split(",")):
                xh = logits_for(case, t, e, np.random.default_rng(0))
                xq = cuda.to_device(xh.reshape(-1).view(np.uint64))
                bias = cuda.to_device(np.linspace(-0.01, 0.01, e, dtype=np.float32))
                spec = _plan.spec_of((t, e), L.BF16)
                plan = K.topk_with_score_function_fwd_plan(spec, True, k, False, None, None, scale, L.SIGMOID, 0, False)
                lib_us, lib = time_plan(plan, [[cuda.to_device(xh), bias]], a.repeats, spin)
                lib = ((lib[0].view(np.uint16).reshape(t, e).astype(np.uint32) << 16).view(np.float32),
                       lib[1].view(np.uint8).reshape(t, e), lib[2])
                row = {"preset": name, "case": case, "T": t, "library us": round(lib_us, 2)}
                outs = (cuda.device_array(t * e // 4, np.uint64), cuda.device_array(t * e, np.float32),
                        cuda.device_array(t * e // 4, np.uint32), cuda.to_device(np.zeros(1, np.int32)))
                # the fallback alone (every token) must give the same answer; then the timed shapes
                regs = [int(v) for v in a.max_registers.split(",")]
                shapes = [(1, warps[0], bpss[0], regs[0])] + [(0, w, b, m) for w in warps for b in bpss for m in regs]
                for forced, wpb, bps, maxreg in shapes:
                    kern = make_kernel(e, k, wpb, maxreg)
                    grid = min(sms * bps, -(-t // wpb))
                    args = [xq, bias, outs[0], outs[1], outs[2], t, scale, forced, outs[3]]

                    def launch(ptrs, stream, grid=grid, wpb=wpb, args=args, kern=kern):
                        kern[grid, 32 * wpb](*args)

                    tag = f"{'fallback ' if forced else ''}{wpb}w x {grid}" + (f" r{maxreg}" if maxreg else "")
                    run_shape(row, kern, launch, outs, lib, forced, tag, None if forced else (a.repeats, spin))
                    if a.sass and not forced and bps == bpss[0]:
                        out = a.sass_out and f"{a.sass_out}/{name}-{wpb}w-r{maxreg}.sass"
                        row[tag + " sass"] = sass_counts(kern, out)
                report(rows, row)
    save_rows(a.json, rows)


if __name__ == "__main__":
    main()
