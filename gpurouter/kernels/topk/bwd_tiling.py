"""The top-k and aux-score backwards' tiling: ``BwdTiling`` (the knobs of the
quad kernels, ``bwd_quad.py``, the streaming ones, ``bwd_stream.py``, and the
warp-per-token backward's grid cap, ``warp/bwd.py``), ``quad_tiling``,
``quad_hold`` and ``stream_tiling``.  Host code only: the plans call these and
put the results in their ``Step``s.
"""

from __future__ import annotations

import dataclasses

from .._base.limits import pow2_at_least


@dataclasses.dataclass(frozen=True)
class BwdTiling:
    """The backwards' knobs (the defaults are the library's, measured with
    ``tools/probes/tiling_sweep.py`` and ``tools/probes/bwd_path_probe.py``; tests and the sweeps
    pass others to the plans).

    - ``quad_lanes_sparse``, ``quad_lanes_sparse_small_t``, ``quad_lanes_dense``: lanes per token of the
      quad backwards at most: top-k (sparse; at T <= ``quad_small_t`` the ``_small_t`` one) and aux
      scores (dense);
    - ``quad_threads``: threads per block of the quad backwards;
    - ``quad_hold``: quads per lane held in registers by the aux-score backward (8 fp32 registers each);
    - ``quad_list``: selected experts per lane the sqrtsoftplus top-k backward lists in shared memory
      (0: none; ``bwd_quad.quad_bwd_kernel``);
    - ``stream_threads``: threads per block of the streaming backwards;
    - ``warp_max_blocks``: blocks at most of the warp-per-token backward (a grid-strided token loop:
      16 an SM of an H200's 132)."""

    quad_lanes_sparse: int = 8
    quad_lanes_sparse_small_t: int = 16
    quad_small_t: int = 8192
    quad_lanes_dense: int = 16
    quad_threads: int = 128
    quad_hold: int = 4
    quad_list: int = 4
    stream_threads: int = 256
    warp_max_blocks: int = 2112


#: the library's backward tiling
BWD_TILING = BwdTiling()


def stream_tiling(num_tokens: int, num_experts: int, tiling: BwdTiling = BWD_TILING):
    """``(grid, threads, lanes)`` of the streaming backward kernels: W lanes per
    token read its row from global memory, lane ``l`` experts ``l, l + W, ...``;
    W = 32 (a warp's access: one contiguous piece of a row) or, for E < 32, E
    rounded up to a power of two (a warp covers whole consecutive rows)."""
    w = 32
    if num_experts < 32:
        w = 1
        while w < num_experts:
            w *= 2
    tb = max(1, min(tiling.stream_threads // w, num_tokens))
    return -(-num_tokens // tb), tb * w, w


def quad_tiling(num_tokens: int, num_experts: int, dense: bool, tiling: BwdTiling = BWD_TILING):
    """``(grid, threads, lanes)`` of the quad backward kernels (E a multiple of
    4): W lanes per token, lane ``l`` quads ``l, l + W, ...``; W the smallest
    power of two >= E/4, at most ``quad_lanes_dense`` or ``_sparse`` (fewer lanes: fewer tree levels a
    token; at small T more lanes, a shorter walk each: the kernel is one wave's latency),
    ``quad_threads`` a block."""
    small = num_tokens <= tiling.quad_small_t
    cap = (tiling.quad_lanes_dense if dense
           else tiling.quad_lanes_sparse_small_t if small else tiling.quad_lanes_sparse)
    w = min(cap, pow2_at_least(max(1, num_experts // 4)))
    tb = max(1, min(tiling.quad_threads // w, num_tokens))
    return -(-num_tokens // tb), tb * w, w


def quad_hold(num_experts: int, lanes: int, tiling: BwdTiling = BWD_TILING) -> int:
    """Quads a lane of the aux-score backward loads at once and keeps in registers
    between its passes: all of its ``ceil(E / 4 / W)``, at most ``tiling.quad_hold``."""
    return min(tiling.quad_hold, -(-(num_experts // 4) // lanes))
