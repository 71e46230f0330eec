"""The W-lane row forwards' tiling (``fwd.py``, ``aux_fwd.py``): ``RowTiling``
(the knobs), ``row_lanes``, ``row_stride`` and ``select_layout`` ->
``RowLayout``.  Host code only (no numba): the plans call these and put the
results in their ``Step``s.
"""

from __future__ import annotations

import dataclasses

from ..._base.limits import SMEM_BUDGET


@dataclasses.dataclass(frozen=True)
class RowTiling:
    """The row forwards' knobs (the defaults are the library's; tests and
    ``tools/probes/tiling_sweep.py`` pass others to the plans).

    - ``threads``: threads per block before shared memory forces fewer;
    - ``experts_per_lane``: W doubles (up to 32) while a lane would scan more
      experts than this;
    - ``lanes``: W forced (0: ``row_lanes``'s rule)."""

    threads: int = 128
    experts_per_lane: int = 32
    lanes: int = 0


#: the library's row tiling
ROW_TILING = RowTiling()


def row_lanes(num_experts: int, tiling: RowTiling = ROW_TILING) -> int:
    """W, the lanes (threads) per token of the row kernels: ``tiling.lanes``
    where set, else a power of two in [1, 32], the smallest with ``W * 32 >= E``
    (E <= 32: 1, E=128: 4, E=256: 8, E >= 1024: 32).  Fewer lanes cost fewer
    merge levels (the per-token instruction count of the selection falls with
    W) but need more tokens per block for the same threads, i.e. more shared
    memory."""
    if tiling.lanes:
        return int(tiling.lanes)
    w = 1
    while w < 32 and w * tiling.experts_per_lane < num_experts:
        w *= 2
    return w


def row_stride(num_experts: int, lanes: int = 1) -> int:
    """Shared-memory row stride P (4-byte words) of a tile row.

    Lane ``l`` of the token in tile row ``t`` reads words ``t*P + l + i*W``;
    a warp holds ``32/W`` tokens.  With ``P`` a multiple of ``W`` and ``P/W``
    odd, ``(t*P + l) % 32`` differs for every thread of a warp: the lane
    scans are bank-conflict-free.  (W = 32: one token per warp, any P.)
    """
    if lanes >= 32:
        return num_experts
    m = -(-num_experts // lanes)
    return (m | 1) * lanes


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Launch shape and dynamic shared-memory layout of one row kernel.

    ``tb`` tokens per block, ``lanes`` (W) threads per token, ``threads = tb*W``.
    Word offsets (fp32 / int32 views of the one dynamic allocation):

    - forward (``select_layout``)::

        [0, tb*P)        fp32 tile: the scores of the block's tokens, row stride P
        o_list  + [threads * LS]   fp32 per-lane top-K values (LS = K | 1);
                                    also the lane partials of the row statistics
        o_idx   + [threads * LS]   int32 per-lane top-K expert indices
        o_cnt   + [threads]        int32 per-lane list lengths
        o_grp   + [tb * G]         fp32 group scores (grouped only)
        o_keep  + [tb * G]         int32 kept-group flags (grouped only)
        o_flag  (bytes) + [tb*P]   uint8 selection flags
    """

    grid: int
    threads: int
    tb: int
    lanes: int
    stride: int
    list_stride: int
    group_lanes: int
    o_list: int
    o_idx: int
    o_cnt: int
    o_grp: int
    o_keep: int
    o_flag: int
    shared: int


def _select_words(tb: int, lanes: int, p: int, ls: int, groups: int):
    o_list = tb * p
    o_cnt = o_list + 2 * tb * lanes * ls  # (o_idx: o_list + threads * LS)
    o_grp = o_cnt + tb * lanes
    return o_list, o_list + tb * lanes * ls, o_cnt, o_grp, o_grp + tb * groups, o_grp + 2 * tb * groups


def select_layout(num_tokens: int, num_experts: int, topk: int, num_groups: int = 0,
                  tiling: RowTiling = ROW_TILING) -> RowLayout:
    """Layout of the forward row kernels (top-k fwd, aux scores fwd). ``num_groups``:
    G when grouping is on, else 0.  W = ``row_lanes(E, tiling)``; the block takes
    ``tiling.threads / W`` tokens, fewer (then fewer lanes) until the shared
    memory fits ``SMEM_BUDGET``.  ``W / G`` lanes share a group in the
    group-score pass when G divides W, else 1 lane takes whole groups."""
    w = row_lanes(num_experts, tiling)
    ls = topk | 1  # odd list stride: lanes reading slot q of their lists hit distinct banks
    g = max(0, int(num_groups))
    tb = max(1, tiling.threads // w)
    while True:
        p = row_stride(num_experts, w)
        end = _select_words(tb, w, p, ls, g)[-1]
        if end * 4 + tb * p <= SMEM_BUDGET:
            break
        if tb > 1:
            tb //= 2
        elif w > 1:
            w //= 2
        else:
            raise NotImplementedError(f"E={num_experts}, K={topk}: one token does not fit "
                                      f"{SMEM_BUDGET} bytes of shared memory")
    tb = max(1, min(tb, num_tokens))
    o_list, o_idx, o_cnt, o_grp, o_keep, end = _select_words(tb, w, p, ls, g)
    glanes = w // g if 0 < g <= w and w % g == 0 else 1
    return RowLayout(grid=-(-num_tokens // tb), threads=tb * w, tb=tb, lanes=w, stride=p,
                     list_stride=ls, group_lanes=glanes, o_list=o_list, o_idx=o_idx,
                     o_cnt=o_cnt, o_grp=o_grp, o_keep=o_keep, o_flag=end * 4,
                     shared=end * 4 + tb * p)
