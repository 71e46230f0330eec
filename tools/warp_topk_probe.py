"""A warp per token for the DeepSeek-V3 top-k forward: how fast could it be? (GPU only; a probe,
not a library kernel.)

The library's thread-per-token forward (``kernels/topk/token/fwd.py``) is bound by one
thread's serial selection per token (docs/kernels.md).  This probe times another design
for the DeepSeek-V3 shape only (E = 256, 8 groups of 32, top 4 groups by the sum of their
2 largest, top 8, sigmoid + fp32 bias, scaling 2.5, bf16 logits, the byte map): one warp
a token, lane l holding experts 8 l ... 8 l + 7 (one 16-byte load), the group scores by two
``shfl_xor`` steps, the group ranks from 8 broadcasts, and the top 8 by 8 rounds of a
warp arg-max over 64-bit keys (the score's order bits, then 255 - expert: ties to the
lower expert); then the selected scores' sum in ascending expert order, and every
lane's 16-byte stores of probs, saved and map.  Its map is checked against the library
plan's (``same map``) and its probs too (``probs max abs diff``).

    python3 tools/warp_topk_probe.py --tokens 4096,65536 --warps 4,8
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
from _timing import median_us, report, save_rows, spin_kernel, time_plan
from numba import cuda, float32, int32, int64, uint32, uint64

from gpurouter import kernels as K
from gpurouter.kernels._base import launch as L
from gpurouter.kernels._base import plan as _plan
from gpurouter.kernels._base.device import EPS, ZERO, sigmoid

FULL = np.uint32(0xFFFFFFFF)
DROPPED = np.int64(-(2**63))
SCALE = np.float32(2.5)


@cuda.jit(device=True)
def order_key(r, e):
    """64-bit key: larger for a larger fp32 ``r`` (NaN as -inf), then for a lower expert ``e``;
    ``DROPPED`` is below every key."""
    if r != r:
        r = float32(-np.inf)
    u = np.uint32(np.float32(r).view(np.uint32))
    u = u ^ (np.uint32(0xFFFFFFFF) if (u >> np.uint32(31)) else np.uint32(0x80000000))
    v = np.uint32(u ^ np.uint32(0x80000000)).view(np.int32)  # signed order = u's unsigned order
    return (int64(v) << int64(32)) | int64(255 - e)  # int64: shfl has no uint64


@cuda.jit(device=True)
def bf16(w, i):
    return np.uint32(np.uint32((w >> uint64(16 * i)) & uint64(0xFFFF)) << np.uint32(16)).view(np.float32)


@cuda.jit(device=True)
def to_bf16(f):
    u = np.uint32(np.float32(f).view(np.uint32))
    return uint64((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@cuda.jit(device=True)
def cx(a, i, j):
    """Compare-exchange of ``a[i]``, ``a[j]`` (a sorting network's comparator; i, j constants)."""
    lo = min(a[i], a[j])
    a[j] = max(a[i], a[j])
    a[i] = lo
    return 0


@cuda.jit(device=True)
def merge2(a1, a2, b1, b2):
    return max(a1, b1), max(min(a1, b1), max(a2, b2))


@cuda.jit
def warp_topk(x, bias, probs, saved, rmap, num_tokens):
    # x: [T*64] uint64 (bf16 quads); probs: [T*64] uint64; saved: [T*256] fp32; rmap: [T*32] uint64
    lane = cuda.threadIdx.x & 31
    warp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) >> 5
    nwarps = (cuda.gridDim.x * cuda.blockDim.x) >> 5
    e0 = int32(8 * lane)
    b = cuda.local.array(8, float32)
    for j in range(8):
        b[j] = bias[e0 + j]
    t = warp
    while t < num_tokens:
        w0 = x[uint64(t) * uint64(64) + uint64(2 * lane)]
        w1 = x[uint64(t) * uint64(64) + uint64(2 * lane + 1)]
        s = cuda.local.array(8, float32)
        k = cuda.local.array(8, int64)
        m1 = float32(-np.inf)
        m2 = float32(-np.inf)
        for j in range(8):
            v = sigmoid(bf16(w0 if j < 4 else w1, j & 3))
            s[j] = v
            r = float32(v + b[j])
            if r != r:
                r = float32(-np.inf)
            m1, m2 = max(m1, r), max(m2, min(m1, r))
            k[j] = order_key(r, e0 + j)
        # the group's 2 largest over its 4 lanes, then its score (descending order sum)
        for off in (1, 2):
            o1 = cuda.shfl_xor_sync(FULL, m1, off)
            o2 = cuda.shfl_xor_sync(FULL, m2, off)
            m1, m2 = merge2(m1, m2, o1, o2)
        gs = float32(m1 + m2)
        g = lane >> 2
        rank = int32(0)
        for h in range(8):
            oh = cuda.shfl_sync(FULL, gs, 4 * h)
            if (oh > gs) | ((oh == gs) & (h < g)):
                rank += 1
        if rank >= 4:  # a dropped group: never selected
            for j in range(8):
                k[j] = DROPPED
        sel = cuda.local.array(8, int32)
        for q in range(8):
            best = k[0]
            for j in range(1, 8):
                best = max(best, k[j])
            for off in (16, 8, 4, 2, 1):
                best = max(best, cuda.shfl_xor_sync(FULL, best, off))
            e = int32(255 - int32(best & int64(0xFF)))
            sel[q] = e
            own = (e >> 3) == lane
            for j in range(8):  # static indices: k stays in registers
                if own & ((e & 7) == j):
                    k[j] = DROPPED
        # ascending expert order (uniform over the warp): a 19-comparator network
        cx(sel, 0, 2), cx(sel, 1, 3), cx(sel, 4, 6), cx(sel, 5, 7), cx(sel, 0, 4), cx(sel, 1, 5), cx(sel, 2, 6)
        cx(sel, 3, 7), cx(sel, 0, 1), cx(sel, 2, 3), cx(sel, 4, 5), cx(sel, 6, 7), cx(sel, 2, 4), cx(sel, 3, 5)
        cx(sel, 1, 4), cx(sel, 3, 6), cx(sel, 1, 2), cx(sel, 3, 4), cx(sel, 5, 6)
        total = ZERO
        mine = uint32(0)
        for q in range(8):
            e = sel[q]
            v = s[0]
            for j in range(1, 8):
                if (e & 7) == j:
                    v = s[j]
            total = float32(total + cuda.shfl_sync(FULL, v, e >> 3))
            if (e >> 3) == lane:
                mine |= uint32(1) << uint32(e & 7)
        inv = float32(SCALE / float32(total + EPS))
        pw0 = uint64(0)
        pw1 = uint64(0)
        mw = uint64(0)
        for j in range(8):
            on = (mine >> uint32(j)) & uint32(1)
            p = to_bf16(float32(s[j] * inv)) if on else uint64(0)
            if j < 4:
                pw0 |= p << uint64(16 * j)
            else:
                pw1 |= p << uint64(16 * (j - 4))
            mw |= uint64(on) << uint64(8 * j)
        base = uint64(t) * uint64(64) + uint64(2 * lane)
        probs[base] = pw0
        probs[base + uint64(1)] = pw1
        sb = uint64(t) * uint64(256) + uint64(e0)
        for j in range(8):
            saved[sb + uint64(j)] = s[j]
        rmap[uint64(t) * uint64(32) + uint64(lane)] = mw
        t += nwarps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,65536")
    ap.add_argument("--warps", default="4,8", help="warps per block")
    ap.add_argument("--blocks-per-sm", default="8,16", help="grid = SMs x this (a grid-strided token loop)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args()
    spin = spin_kernel()
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    rows = []
    for t in (int(v) for v in a.tokens.split(",")):
        rng = np.random.default_rng(0)
        xh = rng.standard_normal((t, 256), np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        x = cuda.to_device(xh)
        xq = cuda.to_device(xh.reshape(-1).view(np.uint64))
        bias = cuda.to_device(np.linspace(-0.01, 0.01, 256, dtype=np.float32))
        spec = _plan.spec_of((t, 256), L.BF16)
        plan = K.topk_with_score_function_fwd_plan(spec, True, 8, False, 8, 4, SCALE, L.SIGMOID, 0, False)
        lib_us, outs = time_plan(plan, [[x, bias]], a.repeats, spin)
        lib_probs, lib_map = outs[0].view(np.uint16), outs[1].view(np.uint8)
        row = {"T": t, "library us": round(lib_us, 2)}
        probs = cuda.device_array(t * 64, np.uint64)
        saved = cuda.device_array(t * 256, np.float32)
        rmap = cuda.device_array(t * 32, np.uint64)
        for wpb in (int(v) for v in a.warps.split(",")):
            for bps in (int(v) for v in a.blocks_per_sm.split(",")):
                grid = min(sms * bps, -(-t // wpb))
                args = [xq, bias, probs, saved, rmap, t]

                def launch(p, s, grid=grid, wpb=wpb, args=args):
                    warp_topk[grid, 32 * wpb](*args)

                us = median_us(launch, [[0]], a.repeats, spin)
                m = rmap.copy_to_host().view(np.uint8).reshape(t, 256)
                p = probs.copy_to_host().view(np.uint16).reshape(t, 256)
                pf = (p.astype(np.uint32) << 16).view(np.float32)
                lf = (lib_probs.reshape(t, 256).astype(np.uint32) << 16).view(np.float32)
                tag = f"warp {wpb}w x {grid}"
                row[tag + " us"] = round(us, 2)
                row[tag + " same map"] = bool(np.array_equal(m != 0, lib_map.reshape(t, 256) != 0))
                row[tag + " probs max abs diff"] = float(np.max(np.abs(pf - lf)))
        report(rows, row)
    save_rows(a.json, rows)


if __name__ == "__main__":
    main()
