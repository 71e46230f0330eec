"""The warp-per-token forward's groups (``warp_topk_fwd.py``, step 0; docs/kernels.md,
"The warp path"): which groupings it takes, and the device function that drops the
groups outside the best ``group_topk``.

Lane ``l`` holds the quads ``l, l + 32, ...`` of a token's row, so a quad row (128
experts) spans the 32 lanes, and a group of 4, 8, ..., 128 experts is the quads of
``LG`` neighbouring lanes in every quad row it covers.  A group's score is the sum of
its ``K // group_topk`` (1 or 2) largest ranking scores, in descending order (the
thread-per-token kernel's); groups rank by (larger score, NaN as -inf, then lower
group); a dropped group's experts get the ranking score -inf and a key after every
kept expert's (``DROPPED``: they are never selected, not even as -inf fillers).

The group-score rule (docs/contract.md section 9) is a compile-time constant of the
kernel: ``"sum_topk"`` sums ``K // group_topk`` values as above, ``"top2_sum"`` the
2 largest, ``"max"`` takes the largest (1): the same top-2 merge, one add or none.
"""

from __future__ import annotations

from ..._base import compat as _compat  # noqa: F401  (first: patches NumPy before numba.cuda loads)

# isort: split

import numpy as np
from numba import cuda

from ..._base.device import NEG_INF, ONE, ZERO, inline_device, nan_as_neg_inf
from .lanes import exchanges

#: added to a dropped group's experts' keys: after every kept one in the order
DROPPED = np.int32(1 << 10)


def warp_groups(num_experts: int, topk: int, num_groups: int, group_topk: int) -> bool:
    """Whether the warp kernel takes the grouping (``num_groups`` 0: none): at
    most 32 groups of 4, 8, ..., 128 experts (a group's experts are whole
    quads of lanes next to each other), whose score sums at most 2 experts
    (``topk // group_topk``), the kept groups holding at least K experts."""
    if num_groups <= 0:
        return True
    size = num_experts // num_groups
    return (num_experts % num_groups == 0 and size % 4 == 0 and 128 % size == 0 and num_groups <= 32
            and 1 <= group_topk <= num_groups and 1 <= topk // group_topk <= 2 and group_topk * size >= topk)


#: the group-score rules the warp kernel computes (docs/contract.md section 9)
WARP_GROUP_SCORES = ("sum_topk", "top2_sum", "max")


def group_per(topk: int, group_topk: int, group_score: str = "sum_topk") -> int:
    """The values a group's score sums under ``group_score`` (1 or 2 here)."""
    if group_score == "top2_sum":
        return 2
    if group_score == "max":
        return 1
    return topk // group_topk


def group_dropper(num_experts: int, topk: int, num_groups: int, group_topk: int, group_score: str = "sum_topk"):
    """``dropped(r, lane, wg, gsc, red, tid) -> uint32``: bit n set where a lane's
    slot n (expert ``4 (lane + 32 (n // 4)) + n % 4``) is in a dropped group, whose
    ranking scores ``r[n]`` it sets to -inf.  ``wg``: the warp's 64 shared words;
    ``gsc``: a local array of 4; ``num_groups`` 0: no groups (nothing dropped);
    ``group_score``: one of ``WARP_GROUP_SCORES``."""
    if group_score not in WARP_GROUP_SCORES:
        raise ValueError(f"group_dropper: group_score must be one of {WARP_GROUP_SCORES}, got {group_score!r}.")
    Q = num_experts // 128  # quads a lane
    N = 4 * Q
    G = max(0, num_groups)
    LG = num_experts // G // 4 if G else 32  # lanes a group spans in a quad row
    GQ = 32 // LG  # groups a quad row
    PER = group_per(topk, group_topk, group_score) if G else 1  # the experts a group's score sums
    KG = np.int32(group_topk if G else 0)
    xor, _, _, _, warp_sync = exchanges()

    @inline_device
    def merge_top2(g1, g2, m, red, tid):
        """The two largest of this lane's pair and lane ``l ^ m``'s."""
        o1 = xor(g1, m, red, tid)
        o2 = xor(g2, m, red, tid)
        return max(g1, o1), max(min(g1, o1), max(g2, o2))

    @inline_device
    def group_score(r, q, red, tid):
        """The score of this lane's group in quad row ``q``: the sum of its PER
        largest ranking scores in descending order."""
        g1 = NEG_INF
        g2 = NEG_INF
        for i in range(4):
            v = r[4 * q + i]
            g1, g2 = max(g1, v), max(g2, min(g1, v))
        if LG > 1:  # the stages written out: numba does not unroll a loop of shuffles
            g1, g2 = merge_top2(g1, g2, 1, red, tid)
        if LG > 2:
            g1, g2 = merge_top2(g1, g2, 2, red, tid)
        if LG > 4:
            g1, g2 = merge_top2(g1, g2, 4, red, tid)
        if LG > 8:
            g1, g2 = merge_top2(g1, g2, 8, red, tid)
        if LG > 16:
            g1, g2 = merge_top2(g1, g2, 16, red, tid)
        return np.float32(g1 + g2) if PER == 2 else g1

    @cuda.jit(device=True)
    def no_slots(r, lane, wg, gsc, red, tid):
        return np.uint32(0)

    @cuda.jit(device=True)
    def dropped_slots(r, lane, wg, gsc, red, tid):
        gsc[0] = group_score(r, 0, red, tid)
        if Q > 1:
            gsc[1] = group_score(r, 1, red, tid)
        if Q > 2:
            gsc[2] = group_score(r, 2, red, tid)
        if Q > 3:
            gsc[3] = group_score(r, 3, red, tid)
        mine = np.int32(lane // np.int32(LG))
        for q in range(Q):
            if (lane & np.int32(LG - 1)) == 0:
                wg[np.uint32(q * GQ + mine)] = gsc[q]
        warp_sync()
        # lane h < G ranks group h (G compares a lane, whatever Q), and says so in wg[32 + h]
        v = nan_as_neg_inf(wg[np.uint32(min(lane, np.int32(G - 1)))])
        rank = np.int32(0)
        for h in range(G):
            u = nan_as_neg_inf(wg[h])
            rank = np.int32(rank + np.int32((u > v) | ((u == v) & (h < lane))))
        if lane < G:
            wg[np.uint32(32 + lane)] = ONE if rank < KG else ZERO
        warp_sync()
        drop = np.uint32(0)
        for q in range(Q):
            if wg[np.uint32(32 + q * GQ + mine)] == ZERO:
                drop |= np.uint32(15) << np.uint32(4 * q)
        warp_sync()
        for n in range(N):
            if (drop >> np.uint32(n)) & np.uint32(1):
                r[n] = NEG_INF
        return drop

    return dropped_slots if G else no_slots
