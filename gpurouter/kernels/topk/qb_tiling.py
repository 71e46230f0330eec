"""The QB kernels' tiling and static checks (``qb.py``): ``QbTiling``, the
histogram kernel's grid (:func:`hist_tiling`) and :func:`check_qb_config`.
Host code only."""

from __future__ import annotations

import dataclasses

from .._base.launch import simulator_enabled
from .._base.limits import MAX_GROUPS, MAX_TOPK
from .qb_math import EXP_MODES

OP = "qb_counts"
GROUP_SCORES = ("sum_topk", "top2_sum", "max")


@dataclasses.dataclass(frozen=True)
class QbTiling:
    """The QB kernels' knobs (grids and blocks only: every tiling gives the same counts).

    - ``cutoff_threads``, ``cutoff_lanes``: threads per block of the cutoff kernel and threads a token
      (1 or grouping: a thread a token; a power of two dividing ``cutoff_threads``; 4: on an H200 at
      T = 65536, E = 384, K = 8 the cutoff took 129.9 / 80.8 / 78.9 / 93.2 / 133.0 us at 1 / 2 / 4 / 8 / 16
      lanes, lab/results/h200-96ca891-qb-breakdown.txt);
    - ``cutoff_quads``: with bf16 logits and ``E % 4 == 0`` the cutoff lanes read four experts a load
      (one 8-byte load; False: one expert a load; the same bits either way);
    - ``hist_threads``: threads per block of the histogram kernel (512: launchable at any register count
      up to 128; rounded down to whole token rows of the chunk);
    - ``hist_unroll``: token rows a histogram thread loads at once (their loads in flight together; 8:
      55 registers a thread by ptxas for sm_90, still two blocks of 504 threads an SM);
    - ``smem_bytes``: the histogram kernel's shared counts at most (48 KiB: no opt-in needed);
    - ``slab_tokens``: tokens a histogram block takes at least;
    - ``target_blocks``: histogram blocks at most (chunks x slabs, one wave: 264 = two on each of 132 SMs;
      fewer slabs, less partial scratch: slabs * E * B * 4 bytes written and summed by the reduce);
    - ``reduce_threads``, ``reduce_blocks``: the grid of the kernel that sums the slabs' partial counts;
    - ``zero_threads``, ``zero_blocks``: the zeroing kernel's grid (only without shared counts, or ``T = 0``).

    Under the CUDA simulator the defaults are small blocks (Python threads)."""

    cutoff_threads: int = 32 if simulator_enabled() else 128
    cutoff_lanes: int = 4
    cutoff_quads: bool = True
    hist_threads: int = 32 if simulator_enabled() else 512
    hist_unroll: int = 8
    smem_bytes: int = 48 * 1024
    slab_tokens: int = 256
    target_blocks: int = 264
    reduce_threads: int = 32 if simulator_enabled() else 256
    reduce_blocks: int = 4 if simulator_enabled() else 528
    zero_threads: int = 32 if simulator_enabled() else 256
    zero_blocks: int = 4 if simulator_enabled() else 528

    def __post_init__(self):
        for name in ("cutoff_threads", "hist_threads", "reduce_threads", "zero_threads"):
            v = getattr(self, name)
            if not 1 <= v <= 1024:
                raise ValueError(f"QbTiling: {name} must be in [1, 1024], got {v}.")
        if not 1 <= self.hist_unroll <= 16:
            raise ValueError(f"QbTiling: hist_unroll must be in [1, 16], got {self.hist_unroll}.")
        if self.cutoff_lanes < 1 or self.cutoff_threads % self.cutoff_lanes:
            raise ValueError(f"QbTiling: cutoff_lanes ({self.cutoff_lanes}) must divide cutoff_threads "
                             f"({self.cutoff_threads}).")
        if (self.smem_bytes < 0 or self.slab_tokens < 1 or self.target_blocks < 1 or self.reduce_blocks < 1
                or self.zero_blocks < 1):
            raise ValueError(f"QbTiling: smem_bytes >= 0 and slab_tokens, target_blocks, reduce_blocks, "
                             f"zero_blocks >= 1, got {self}.")


QB_TILING = QbTiling()


def check_qb_config(topk: int, num_experts: int, num_bins: int, num_groups: int, group_topk: int,
                    group_score: str, exp_mode: str) -> tuple[int, int]:
    """Validates the static configuration; returns ``(groups, group_topk)`` (0, 0 without grouping)."""
    if not 1 <= topk < num_experts:
        raise ValueError(f"{OP}: topk ({topk}) must satisfy 1 <= topk < num_experts ({num_experts}).")
    if topk + 1 > MAX_TOPK + 1:
        raise NotImplementedError(f"{OP}: topk ({topk}) must be at most {MAX_TOPK}.")
    if num_bins < 1:
        raise ValueError(f"{OP}: num_bins ({num_bins}) must be >= 1.")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"{OP}: group_score must be one of {GROUP_SCORES}, got {group_score!r}.")
    if exp_mode not in EXP_MODES:
        raise ValueError(f"{OP}: exp_mode must be one of {EXP_MODES}, got {exp_mode!r}.")
    if simulator_enabled() and exp_mode != "cephes":
        raise ValueError(f"{OP}: the CUDA simulator computes exp_mode 'cephes' only, got {exp_mode!r}.")
    grouped = num_groups > 0 and group_topk > 0
    if not grouped:
        return 0, 0
    if num_groups > MAX_GROUPS or num_experts % num_groups or not 1 <= group_topk <= num_groups:
        raise ValueError(f"{OP}: num_groups ({num_groups}) must divide num_experts ({num_experts}) and be at "
                         f"most {MAX_GROUPS}, and 1 <= group_topk ({group_topk}) <= num_groups.")
    size = num_experts // num_groups
    if group_score == "sum_topk" and (topk % group_topk or topk // group_topk > size):
        raise ValueError(f"{OP}: topk ({topk}) must be a multiple of group_topk ({group_topk}) with "
                         f"topk / group_topk <= num_experts / num_groups ({size}).")
    if group_score == "top2_sum" and size < 2:
        raise ValueError(f"{OP}: group_score 'top2_sum' needs num_experts / num_groups >= 2, got {size}.")
    if group_topk * size < topk + 1:
        raise ValueError(f"{OP}: the kept groups hold group_topk * num_experts / num_groups = "
                         f"{group_topk * size} experts, fewer than topk + 1 = {topk + 1}.")
    return num_groups, group_topk


def hist_tiling(num_tokens: int, num_experts: int, num_bins: int, tiling: QbTiling = QB_TILING):
    """``(grid, threads, shared_bytes, chunk, chunks, slab)`` of the histogram kernel."""
    fit = tiling.smem_bytes // (4 * num_bins)
    shared = fit >= 1
    chunk = max(1, min(num_experts, fit if shared else tiling.hist_threads, tiling.hist_threads))
    chunks = -(-num_experts // chunk)
    # at most target_blocks (one wave of the grid, not a wave and a sliver)
    slabs = max(1, min(-(-num_tokens // tiling.slab_tokens), tiling.target_blocks // chunks))
    slab = -(-max(num_tokens, 1) // slabs)
    slabs = -(-max(num_tokens, 1) // slab)
    threads = max(chunk, (tiling.hist_threads // chunk) * chunk)
    return chunks * slabs, threads, (4 * chunk * num_bins if shared else 0), chunk, chunks, slab


__all__ = ["GROUP_SCORES", "QB_TILING", "QbTiling", "check_qb_config", "hist_tiling"]
