"""The losses' tiling: the aux loss's (``AuxLossTiling``: ``column_tiling``
for its forward, ``fill_tiling`` for its backward, ``aux_loss.py``) and the
router z-loss's (``ZLossTiling``: ``z_loss_tiling`` for the unit kernels,
``z_loss.py``; ``z_loss_vec_tiling`` for the vector ones, ``z_loss_vec.py``).
Host code only: the plans call these and put the results in their ``Step``s.
"""

from __future__ import annotations

import dataclasses

from .._base.limits import pow2_at_least


@dataclasses.dataclass(frozen=True)
class AuxLossTiling:
    """The aux loss's knobs (the defaults are the library's, measured with
    ``tools/probes/aux_loss_probe.py``; tests and the probes pass others to the plans).

    - ``column_threads``, ``column_blocks``, ``column_min_rows``: the forward's column-sum
      kernel: threads per block (at most the kernel's compiled ``aux_loss._RED_WORDS``),
      blocks at most, rows per block at least;
    - ``fill_threads``, ``fill_blocks``: the backward's fill: threads per block, blocks at
      most (528: 4 blocks on each of 132 SMs; better than other grids and the driver's memset);
    - ``mask_stage_bytes``: the masked backward's bf16 and fp32 fill first stages a byte for each
      row it writes in shared memory (``aux_loss_bwd.staged_flag_bytes``): where that is over this
      many bytes (T over ~8.6 million at 528 blocks) its grid doubles until it is not (a block a row
      lane's row at the least).  The fp16 fill loads each row's flag three trips of 8 rows ahead of
      its store (``aux_loss_bwd.staged_fill``); the masked forward stages nothing: each row's mask
      byte is loaded with its values."""

    column_threads: int = 512
    column_blocks: int = 256
    column_min_rows: int = 64
    fill_threads: int = 128
    fill_blocks: int = 528
    mask_stage_bytes: int = 16384

    def __post_init__(self):
        if not 32 <= self.column_threads <= AuxLossTiling.column_threads:  # the kernel's compiled shared array
            raise ValueError(f"AuxLossTiling: column_threads must be in [32, {AuxLossTiling.column_threads}], "
                             f"got {self.column_threads}.")
        if self.mask_stage_bytes < 0:
            raise ValueError(f"AuxLossTiling: mask_stage_bytes must be >= 0, "
                             f"got {self.mask_stage_bytes}.")


#: the library's aux-loss tiling
AUX_LOSS_TILING = AuxLossTiling()


def column_tiling(num_rows: int, num_cols: int, tiling: AuxLossTiling = AUX_LOSS_TILING):
    """``(grid, threads, col_lanes, rows_per_block)`` of a column-sum kernel over ``[num_rows, num_cols]``:
    blocks of RL row lanes x CL column lanes (CL a multiple of 32, at most 256; RL a power of two, RL * CL
    <= ``tiling.column_threads``; no more row lanes than a block has rows: tiny problems get small blocks)."""
    cl = min(256, max(32, -(-num_cols // 32) * 32))
    grid = max(1, min(tiling.column_blocks, -(-num_rows // tiling.column_min_rows)))
    rows = -(-max(num_rows, 1) // grid)
    rl = 1
    while rl * 2 * cl <= tiling.column_threads and rl * 2 <= rows:
        rl *= 2
    return grid, rl * cl, cl, rows


def fill_tiling(num_rows: int, num_quads: int, tiling: AuxLossTiling = AUX_LOSS_TILING):
    """``(grid, threads, col_lanes)`` of a grid-strided kernel writing ``num_quads``
    column quads down ``num_rows`` rows: RL row lanes x CL column-quad lanes (CL
    as in ``column_tiling``; RL a power of two, RL * CL <= ``tiling.fill_threads``, RL
    <= rows), block b's lane rl writing rows ``b RL + rl + k grid RL``."""
    cl = min(256, max(32, -(-num_quads // 32) * 32))
    rl = 1
    while rl * 2 * cl <= tiling.fill_threads and rl * 2 <= num_rows:
        rl *= 2
    return max(1, min(tiling.fill_blocks, -(-num_rows // rl))), rl * cl, cl


@dataclasses.dataclass(frozen=True)
class ZLossTiling:
    """The router z-loss's knobs (the defaults are the library's, measured with
    ``tools/probes/z_loss_probe.py --sweep``; tests and the probe pass others to the plans).

    - ``threads``, ``hold``: the forward unit kernel's threads per block (TB rows x W lanes)
      and the units (four experts) a lane loads at once;
    - ``bwd_threads``, ``bwd_hold``: the same for the backward;
    - ``max_lanes``: lanes per row at most (E >= 4 * hold * max_lanes: several steps per lane);
    - ``final_threads``: threads of the final single-block kernel at most (at most the kernel's
      compiled ``z_loss._FINAL_WORDS``);
    - ``vec_fwd``, ``vec_bwd``: the vector kernels' (threads, held vectors, blocks at most (528:
      4 x 256 threads on each of 132 SMs), prefetch, hints);
    - ``vec_max_hold``: more held vectors than this: the unit kernels."""

    threads: int = 128
    hold: int = 16
    bwd_threads: int = 128
    bwd_hold: int = 8
    max_lanes: int = 32
    final_threads: int = 1024
    vec_fwd: tuple[int, int, int, bool, bool] = (256, 4, 1056, False, True)
    vec_bwd: tuple[int, int, int, bool, bool] = (128, 2, 1024, True, True)
    vec_max_hold: int = 8

    def __post_init__(self):
        if not 1 <= self.final_threads <= ZLossTiling.final_threads:  # the final kernel's compiled shared array
            raise ValueError(f"ZLossTiling: final_threads must be in [1, {ZLossTiling.final_threads}], "
                             f"got {self.final_threads}.")


#: the library's z-loss tiling
Z_LOSS_TILING = ZLossTiling()


def z_loss_vec_tiling(num_tokens: int, num_experts: int, itemsize: int, backward: bool = False,
                      tiling: ZLossTiling = Z_LOSS_TILING):
    """``(grid, threads, lanes, vecs, hold, iters)`` of a vector kernel (None: a
    row is no whole number of ``vecs`` 16-byte vectors, or too long).  W: the least
    power of two (<= 32) with ``W * hold >= vecs``; TB = threads / W rows (<= T)
    a group; a block walks ``iters`` groups, the fewest that keep its grid cap."""
    threads, hold, blocks = (tiling.vec_bwd if backward else tiling.vec_fwd)[:3]
    if (num_experts * itemsize) % 16 or num_tokens < 1:
        return None
    vecs = num_experts * itemsize // 16
    lanes = min(32, pow2_at_least(-(-vecs // hold)))
    hold = -(-vecs // lanes)
    if hold > tiling.vec_max_hold:
        return None
    tb = max(1, min(threads // lanes, num_tokens))
    iters = -(-((num_tokens + tb - 1) // tb) // blocks)
    return -(-num_tokens // (tb * iters)), tb * lanes, lanes, vecs, hold, iters


def z_loss_tiling(num_tokens: int, num_experts: int, backward: bool = False, tiling: ZLossTiling = Z_LOSS_TILING):
    """``(grid, threads, lanes, units, quads)`` of the z-loss unit kernels (forward
    rows, or ``backward``): ``units = ceil(E / 4)``; ``quads``: E % 4 == 0 (a unit
    is one vector access, else four masked ones); W the least power of two with
    ``W * hold >= units`` (at most ``tiling.max_lanes``); TB = threads / W rows (at
    most T) a block; ``grid = ceil(T / TB)`` (0 when T == 0)."""
    hold, threads = (tiling.bwd_hold, tiling.bwd_threads) if backward else (tiling.hold, tiling.threads)
    units = -(-int(num_experts) // 4)
    lanes = min(tiling.max_lanes, pow2_at_least(-(-units // hold)))
    tb = max(1, min(max(1, threads // lanes), int(num_tokens)))
    grid = -(-int(num_tokens) // tb)
    return grid, tb * lanes, lanes, units, num_experts % 4 == 0
