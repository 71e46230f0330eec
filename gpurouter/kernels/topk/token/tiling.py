"""The thread-per-token forwards' tiling (``fwd.py``, ``aux_fwd.py``):
``TokenTiling`` (the knobs), the fit rule (``token_path``, ``use_token_path``),
the selection's lanes (``lane_chunks``, ``token_lanes``) and ``token_layout``
-> ``TokenLayout``.  Host code only (no kernels): the plans call these and put
the results in their ``Step``s.
"""

from __future__ import annotations

import dataclasses

from ..._base.launch import simulator_enabled
from ..._base.limits import SMEM_BUDGET

#: experts a chunk lane takes (ungrouped); a compile-time size of ``chunk_lanes.py``
LANE_CHUNK = 32
#: ``TokenTiling.lanes_min_blocks`` on a GPU (132 SMs: the chunk lanes' tiles shrink until the grid fills them)
#: and on the simulator, where every thread is a Python thread: there the GPU's figure would make the
#: small inputs one token a block (the same bits, far slower)
GPU_LANES_MIN_BLOCKS, SIM_LANES_MIN_BLOCKS = 128, 2


@dataclasses.dataclass(frozen=True)
class TokenTiling:
    """The thread-per-token forwards' knobs (the defaults are the library's,
    measured with ``tools/probes/tiling_sweep.py``, ``tools/probes/lanes_probe.py`` and
    ``tools/probes/indices_probe.py``; tests and the sweeps pass others to the plans).

    - ``max_topk``: the token kernels take K <= this (register lists) and E % 4 == 0:
      faster than the W-lane ones at every K to 64 (E = 512, 2304); 0 turns them off;
    - ``max_tokens``: tokens per block at most; ``min_threads``: threads per block at least;
    - ``group_lanes_max_tokens``: T at most of the grouped lanes (``select.token_group_lists``);
    - ``chunk_lanes_max_tokens``: T at most of the chunk lanes (``chunk_lanes.py``), (ungrouped, grouped);
      -1 turns them off;
    - ``lanes_min_blocks``: the chunk lanes' tiles halve while the grid has fewer blocks
      (``GPU_LANES_MIN_BLOCKS``, ``SIM_LANES_MIN_BLOCKS`` under the simulator);
    - ``lanes_tree``: the chunk lanes merge their lists in a tree;
    - ``indices_way``: how the top-k forward writes its indices where E <= 256 and K <= 8
      (``fwd.token_topk_fwd_kernel``'s ``indices``): 2, the hits packed in a register by the
      selecting thread; 1, the hit lists in local memory (the only way elsewhere)."""

    max_topk: int = 64
    max_tokens: int = 256
    min_threads: int = 256
    group_lanes_max_tokens: int = 8192
    chunk_lanes_max_tokens: tuple[int, int] = (4096, 1024)
    lanes_min_blocks: int = SIM_LANES_MIN_BLOCKS if simulator_enabled() else GPU_LANES_MIN_BLOCKS
    lanes_tree: bool = True
    indices_way: int = 2


#: the library's token tiling
TOKEN_TILING = TokenTiling()


def _token_words(tb: int, num_experts: int, num_groups: int, has_bias: bool, lists: int = 0) -> int:
    """Shared-memory words of a thread-per-token block (see ``TokenLayout``)."""
    g = (num_groups | 1) if num_groups > 0 else 0
    chunks = lane_chunks(num_experts, num_groups)[0] if lists else 0
    return (tb * ((num_experts | 1) + token_flag_stride(num_experts) + g + 4 + lists * chunks)
            + (num_experts if has_bias else 0))


def lane_chunks(num_experts: int, num_groups: int, topk: int = 0):
    """``(C, chunk size, slot words S)`` of the chunk lanes: the G groups, or (G <= 0) runs of ``LANE_CHUNK``
    experts; a slot: K + 1 scores, a flag, a table entry, two masks per 32 experts."""
    c, size = (num_groups, num_experts // num_groups) if num_groups > 0 else (-(-num_experts // LANE_CHUNK), LANE_CHUNK)
    return c, size, topk + 3 + 2 * (-(-size // 32))


def token_lanes(num_tokens: int, num_experts: int, topk: int, num_groups: int, has_bias: bool,
                tiling: TokenTiling = TOKEN_TILING):
    """``(mode, slot words)`` of a top-k forward: 2 the chunk lanes, 1 the grouped lanes (G > 0), 0
    neither; each up to its T and where W >= C threads a token and the slots fit ``SMEM_BUDGET``."""
    g = num_groups > 0
    chunks, _, slot = lane_chunks(num_experts, num_groups, topk)
    for mode, cap, c, s, blocks in ((2, tiling.chunk_lanes_max_tokens[g], chunks, slot, tiling.lanes_min_blocks),
                                    (1, tiling.group_lanes_max_tokens if g else -1, num_groups, topk + 1, 0)):
        if num_tokens <= cap and 4 * _token_words(1, num_experts, num_groups, has_bias, s) <= SMEM_BUDGET:
            lay = token_layout(num_tokens, num_experts, num_groups, has_bias, s, blocks, tiling)
            if lay.threads // lay.tb >= c:
                return mode, s
    return 0, 0


def _token_threads(tb: int, num_experts: int, tiling: TokenTiling) -> int:
    """Threads of a thread-per-token block (see ``token_layout``)."""
    return -(-max(tb, min(tiling.min_threads, tb * num_experts // 4)) // 32) * 32


def token_flag_stride(num_experts: int) -> int:
    """Words per token of the token kernels' selection bits (odd: distinct banks)."""
    return -(-num_experts // 32) | 1


def token_path(num_experts: int, topk: int, num_groups: int = 0, has_bias: bool = False,
               tiling: TokenTiling = TOKEN_TILING) -> bool:
    """True when the thread-per-token forward kernels take ``(E, K)``: K <= ``tiling.max_topk``,
    E a multiple of 4, and one token's block fits ``SMEM_BUDGET``."""
    return (1 <= topk <= tiling.max_topk and num_experts % 4 == 0
            and 4 * _token_words(1, num_experts, max(0, int(num_groups)), has_bias) <= SMEM_BUDGET)


#: the forward kernel families a plan can take (``path=``)
PATHS = ("auto", "warp", "token", "lane")


def use_token_path(path: str, op: str, num_experts: int, topk: int, num_groups: int = 0,
                   has_bias: bool = False, tiling: TokenTiling = TOKEN_TILING) -> bool:
    """The forward's kernel family: ``"auto"`` the thread-per-token kernels
    where ``token_path`` takes the shape, else the W-lane ones; ``"token"`` or
    ``"lane"`` forces one (a kernel author's or a test's choice; a replay must
    take the path of the call it replays to give its bits). ``"token"`` on a
    shape the token kernels do not take is a ValueError naming ``op``."""
    if path not in PATHS:
        raise ValueError(f"{op}: path must be one of {', '.join(map(repr, PATHS))}, got {path!r}.")
    fits = token_path(num_experts, topk, num_groups, has_bias, tiling)
    if path == "token" and not fits:
        raise ValueError(f"{op}: path='token' needs K <= {tiling.max_topk}, E a multiple of 4 and one token's "
                         f"tile within {SMEM_BUDGET} bytes of shared memory (E={num_experts}, K={topk}).")
    return fits if path == "auto" else path == "token"


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Launch shape and shared memory of a thread-per-token kernel: ``tb``
    tokens per block (thread t owns tile row t), ``threads >= tb``.  Word
    offsets of the fp32 / int32 views of the one dynamic allocation::

        [0, tb*P)              fp32 tile, row stride P = E | 1
        o_flag + [tb * F]      selection bits (the bit way only), a bit per expert,
                               row stride F = ceil(E/32) | 1 words
        o_gs   + [tb * (G|1)]  fp32 group scores (grouped only), row stride G | 1
        o_red  + [2 * tb]      fp32 row statistics (softmax / normalisation / weights)
        o_thr  + [2 * tb]      per token: fp32 selection threshold (NaN: read the bits),
                               then int32 tie cutoff (``select.token_selector``)
        o_bias + [E]           fp32 expert bias
        o_lists + [tb * C * S] the chunk lanes' slots, S = ``lists`` (``chunk_lanes.py``)

    (Odd row strides: a warp's threads, one per row, hit distinct banks.)"""

    grid: int
    threads: int
    tb: int
    stride: int
    o_flag: int
    o_gs: int
    o_red: int
    o_thr: int
    o_bias: int
    o_lists: int
    shared: int


def token_layout(num_tokens: int, num_experts: int, num_groups: int = 0,
                 has_bias: bool = False, lists: int = 0, min_blocks: int = 0,
                 tiling: TokenTiling = TOKEN_TILING) -> TokenLayout:
    """Layout of the thread-per-token kernels (``token_path``): as many tokens per block (a power of two,
    at most ``tiling.max_tokens``, at most T) as fit ``SMEM_BUDGET``; threads: the tokens, at least
    ``tiling.min_threads`` (the coalesced phases want them) unless the tile has fewer quads, a multiple of
    32.  The bias (``has_bias``) takes E words, the lanes' slots (``lists`` words: ``token_lanes``) C a
    token; tokens halved while the grid has < ``min_blocks`` blocks."""
    g = max(0, int(num_groups))
    tb = tiling.max_tokens
    while tb > 1 and 4 * _token_words(tb, num_experts, g, has_bias, lists) > SMEM_BUDGET:
        tb //= 2
    if 4 * _token_words(tb, num_experts, g, has_bias, lists) > SMEM_BUDGET:
        raise NotImplementedError(f"E={num_experts}: one token does not fit "
                                  f"{SMEM_BUDGET} bytes of shared memory")
    tb = max(1, min(tb, num_tokens))
    while tb > 1 and -(-num_tokens // tb) < min_blocks:
        tb //= 2
    threads = _token_threads(tb, num_experts, tiling)
    p = num_experts | 1
    o_flag = tb * p
    o_gs = o_flag + tb * token_flag_stride(num_experts)
    o_red = o_gs + tb * ((g | 1) if g else 0)
    o_thr = o_red + 2 * tb
    o_bias = o_thr + 2 * tb
    o_lists = o_bias + (num_experts if has_bias else 0)
    return TokenLayout(grid=-(-num_tokens // tb), threads=threads, tb=tb, stride=p, o_flag=o_flag,
                       o_gs=o_gs, o_red=o_red, o_thr=o_thr, o_bias=o_bias, o_lists=o_lists,
                       shared=4 * (o_lists + tb * (lane_chunks(num_experts, g)[0] if lists else 0) * lists))
