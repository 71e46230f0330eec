"""Tiling: the ONLY place that computes grids, block sizes and shared-memory
layouts of the kernels (the knobs measured on a GPU are module constants;
their figures live in docs/benchmarks.md).

- W-lane row forwards (``lane_topk_fwd.py``, ``lane_aux_scores_fwd.py``):
  ``row_lanes``, ``row_stride``, ``select_layout`` -> ``RowLayout``;
- thread-per-token forwards (``token_*_fwd.py``): ``token_path``,
  ``token_lanes``, ``token_layout`` -> ``TokenLayout``;
- backwards: ``stream_tiling`` (``stream_bwd.py``), ``quad_tiling``, ``quad_hold`` (``quad_bwd.py``);
- aux loss (``aux_loss.py``): ``column_tiling``, ``fill_tiling``;
- router z-loss: ``z_loss_tiling`` (``z_loss.py``), ``z_loss_vec_tiling`` (``z_loss_vec.py``).

Host code only (no numba): the planners call these and put the results in their ``Step``s.
"""

from __future__ import annotations

from ._base.limits import SMEM_BUDGET

# W-lane row kernels

#: threads per block of the row forward kernels before shared memory forces fewer
ROW_THREADS = 128
#: W doubles (up to 32) while a lane would scan more experts than this.
ROW_EXPERTS_PER_LANE = 32


def row_lanes(num_experts: int) -> int:
    """W, the lanes (threads) per token of the row kernels: a power of two in
    [1, 32], the smallest with ``W * 32 >= E`` (E <= 32: 1, E=128: 4,
    E=256: 8, E >= 1024: 32).  Fewer lanes cost fewer merge levels (the
    per-token instruction count of the selection falls with W) but need
    more tokens per block for the same threads, i.e. more shared memory."""
    w = 1
    while w < 32 and w * ROW_EXPERTS_PER_LANE < num_experts:
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


def _layout_init(self, **kw):
    for k in self.__slots__:
        setattr(self, k, kw.get(k, -1))


def _layout_repr(self):
    return type(self).__name__ + "(" + ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__) + ")"


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

    __slots__ = ("grid", "threads", "tb", "lanes", "stride", "list_stride", "group_lanes",
                 "o_list", "o_idx", "o_cnt", "o_grp", "o_keep", "o_flag", "shared")

    __init__, __repr__ = _layout_init, _layout_repr


def _select_words(tb: int, lanes: int, p: int, ls: int, groups: int):
    o_list = tb * p
    o_cnt = o_list + 2 * tb * lanes * ls  # (o_idx: o_list + threads * LS)
    o_grp = o_cnt + tb * lanes
    return o_list, o_list + tb * lanes * ls, o_cnt, o_grp, o_grp + tb * groups, o_grp + 2 * tb * groups


def select_layout(num_tokens: int, num_experts: int, topk: int, num_groups: int = 0,
                  lanes: int | None = None) -> RowLayout:
    """Layout of the forward row kernels (top-k fwd, aux scores fwd). ``num_groups``:
    G when grouping is on, else 0.  W = ``row_lanes(E)`` (or ``lanes``); the
    block takes ``ROW_THREADS / W`` tokens, fewer (then fewer lanes) until the
    shared memory fits ``SMEM_BUDGET``.  ``W / G`` lanes share a group in the
    group-score pass when G divides W, else 1 lane takes whole groups."""
    w = row_lanes(num_experts) if lanes is None else int(lanes)
    ls = topk | 1  # odd list stride: lanes reading slot q of their lists hit distinct banks
    g = max(0, int(num_groups))
    tb = max(1, ROW_THREADS // w)
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


#: the token forwards take K <= this (register lists) and E % 4 == 0: faster than the
#: W-lane ones at every K to 64 (E = 512, 2304: docs/benchmarks.md, "Large K")
TOKEN_MAX_TOPK = 64
#: tokens per block of the thread-per-token kernels at most, threads at least
TOKEN_MAX_TOKENS = 256
TOKEN_MIN_THREADS = 256  # measured: docs/benchmarks.md (tools/tiling_sweep.py)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _token_words(tb: int, num_experts: int, num_groups: int, has_bias: bool, lists: int = 0) -> int:
    """Shared-memory words of a thread-per-token block (see ``TokenLayout``)."""
    g = (num_groups | 1) if num_groups > 0 else 0
    chunks = lane_chunks(num_experts, num_groups)[0] if lists else 0
    return (tb * ((num_experts | 1) + token_flag_stride(num_experts) + g + 4 + lists * chunks)
            + (num_experts if has_bias else 0))


#: T at most of the grouped lanes (``_token_select.token_group_lists``) and of the chunk lanes (ungrouped,
#: grouped; ``_token_lanes.py``: an ungrouped chunk's experts, the blocks their tiles shrink to, their tree)
TOKEN_GROUP_LANES_MAX_TOKENS, TOKEN_CHUNK_LANES_MAX_TOKENS = 8192, (4096, 1024)
LANE_CHUNK, TOKEN_LANES_MIN_BLOCKS, TOKEN_LANES_TREE = 32, 128, True


def lane_chunks(num_experts: int, num_groups: int, topk: int = 0):
    """``(C, chunk size, slot words S)`` of the chunk lanes: the G groups, or (G <= 0) runs of ``LANE_CHUNK``
    experts; a slot: K + 1 scores, a flag, a table entry, two masks per 32 experts."""
    c, size = (num_groups, num_experts // num_groups) if num_groups > 0 else (-(-num_experts // LANE_CHUNK), LANE_CHUNK)
    return c, size, topk + 3 + 2 * (-(-size // 32))


def token_lanes(num_tokens: int, num_experts: int, topk: int, num_groups: int, has_bias: bool):
    """``(mode, slot words)`` of a top-k forward: 2 the chunk lanes, 1 the grouped lanes (G > 0), 0
    neither; each up to its T and where W >= C threads a token and the slots fit ``SMEM_BUDGET``."""
    g = num_groups > 0
    chunks, _, slot = lane_chunks(num_experts, num_groups, topk)
    for mode, cap, c, s, blocks in ((2, TOKEN_CHUNK_LANES_MAX_TOKENS[g], chunks, slot, TOKEN_LANES_MIN_BLOCKS),
                                    (1, TOKEN_GROUP_LANES_MAX_TOKENS if g else -1, num_groups, topk + 1, 0)):
        if num_tokens <= cap and 4 * _token_words(1, num_experts, num_groups, has_bias, s) <= SMEM_BUDGET:
            lay = token_layout(num_tokens, num_experts, num_groups, has_bias, s, blocks)
            if lay.threads // lay.tb >= c:
                return mode, s
    return 0, 0


def _token_threads(tb: int, num_experts: int) -> int:
    """Threads of a thread-per-token block (see ``token_layout``)."""
    return -(-max(tb, min(TOKEN_MIN_THREADS, tb * num_experts // 4)) // 32) * 32


def token_flag_stride(num_experts: int) -> int:
    """Words per token of the token kernels' selection bits (odd: distinct banks)."""
    return -(-num_experts // 32) | 1


def token_path(num_experts: int, topk: int, num_groups: int = 0, has_bias: bool = False) -> bool:
    """True when the thread-per-token forward kernels take ``(E, K)``: K <= ``TOKEN_MAX_TOPK``,
    E a multiple of 4, and one token's block fits ``SMEM_BUDGET``."""
    return (1 <= topk <= TOKEN_MAX_TOPK and num_experts % 4 == 0
            and 4 * _token_words(1, num_experts, max(0, int(num_groups)), has_bias) <= SMEM_BUDGET)


#: the forward kernel families a plan can take (``path=``)
PATHS = ("auto", "warp", "token", "lane")


def use_token_path(path: str, op: str, num_experts: int, topk: int, num_groups: int = 0,
                   has_bias: bool = False) -> bool:
    """The forward's kernel family: ``"auto"`` the thread-per-token kernels
    where ``token_path`` takes the shape, else the W-lane ones; ``"token"`` or
    ``"lane"`` forces one (a kernel author's or a test's choice; a replay must
    take the path of the call it replays to give its bits). ``"token"`` on a
    shape the token kernels do not take is a ValueError naming ``op``."""
    if path not in PATHS:
        raise ValueError(f"{op}: path must be one of {', '.join(map(repr, PATHS))}, got {path!r}.")
    fits = token_path(num_experts, topk, num_groups, has_bias)
    if path == "token" and not fits:
        raise ValueError(f"{op}: path='token' needs K <= {TOKEN_MAX_TOPK}, E a multiple of 4 and one token's "
                         f"tile within {SMEM_BUDGET} bytes of shared memory (E={num_experts}, K={topk}).")
    return fits if path == "auto" else path == "token"


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
                               then int32 tie cutoff (``_token_select.token_selector``)
        o_bias + [E]           fp32 expert bias
        o_lists + [tb * C * S] the chunk lanes' slots, S = ``lists`` (``_token_lanes.py``)

    (Odd row strides: a warp's threads, one per row, hit distinct banks.)"""

    __slots__ = ("grid", "threads", "tb", "stride", "o_flag", "o_gs", "o_red", "o_thr", "o_bias",
                 "o_lists", "shared")

    __init__, __repr__ = _layout_init, _layout_repr


def token_layout(num_tokens: int, num_experts: int, num_groups: int = 0,
                 has_bias: bool = False, lists: int = 0, min_blocks: int = 0) -> TokenLayout:
    """Layout of the thread-per-token kernels (``token_path``): as many tokens per block (a power of two,
    at most ``TOKEN_MAX_TOKENS``, at most T) as fit ``SMEM_BUDGET``; threads: the tokens, at least
    ``TOKEN_MIN_THREADS`` (the coalesced phases want them) unless the tile has fewer quads, a multiple of
    32.  The bias (``has_bias``) takes E words, the lanes' slots (``lists`` words: ``token_lanes``) C a
    token; tokens halved while the grid has < ``min_blocks`` blocks."""
    g = max(0, int(num_groups))
    tb = TOKEN_MAX_TOKENS
    while tb > 1 and 4 * _token_words(tb, num_experts, g, has_bias, lists) > SMEM_BUDGET:
        tb //= 2
    if 4 * _token_words(tb, num_experts, g, has_bias, lists) > SMEM_BUDGET:
        raise NotImplementedError(f"E={num_experts}: one token does not fit "
                                  f"{SMEM_BUDGET} bytes of shared memory")
    tb = max(1, min(tb, num_tokens))
    while tb > 1 and -(-num_tokens // tb) < min_blocks:
        tb //= 2
    threads = _token_threads(tb, num_experts)
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


#: threads per block of the streaming backward kernels
STREAM_THREADS = 256


def stream_tiling(num_tokens: int, num_experts: int):
    """``(grid, threads, lanes)`` of the streaming backward kernels: W lanes per
    token read its row from global memory, lane ``l`` experts ``l, l + W, ...``;
    W = 32 (a warp's access: one contiguous piece of a row) or, for E < 32, E
    rounded up to a power of two (a warp covers whole consecutive rows)."""
    w = 32
    if num_experts < 32:
        w = 1
        while w < num_experts:
            w *= 2
    tb = max(1, min(STREAM_THREADS // w, num_tokens))
    return -(-num_tokens // tb), tb * w, w


#: lanes per token of the quad backwards at most, top-k (sparse; at T <= ``QUAD_SMALL_T``: ``_SMALL_T``)
#: and aux scores (dense), and threads per block (``tools/tiling_sweep.py``; docs/benchmarks.md)
QUAD_LANES_SPARSE, QUAD_LANES_SPARSE_SMALL_T, QUAD_SMALL_T, QUAD_LANES_DENSE, QUAD_THREADS = 8, 16, 8192, 16, 128
#: quads per lane held in registers by the aux-score backward (8 fp32 registers each)
QUAD_HOLD = 4
#: selected experts per lane the sqrtsoftplus top-k backward lists in shared memory (0: none; quad_bwd.py)
QUAD_LIST = 4


def quad_tiling(num_tokens: int, num_experts: int, dense: bool):
    """``(grid, threads, lanes)`` of the quad backward kernels (E a multiple of
    4): W lanes per token, lane ``l`` quads ``l, l + W, ...``; W the smallest
    power of two >= E/4, at most ``QUAD_LANES_DENSE`` or ``_SPARSE`` (fewer lanes: fewer tree levels a
    token; at small T more lanes, a shorter walk each: the kernel is one wave's latency), ``QUAD_THREADS`` a block."""
    small = num_tokens <= QUAD_SMALL_T
    cap = QUAD_LANES_DENSE if dense else (QUAD_LANES_SPARSE_SMALL_T if small else QUAD_LANES_SPARSE)
    w = min(cap, pow2_at_least(max(1, num_experts // 4)))
    tb = max(1, min(QUAD_THREADS // w, num_tokens))
    return -(-num_tokens // tb), tb * w, w


def quad_hold(num_experts: int, lanes: int) -> int:
    """Quads a lane of the aux-score backward loads at once and keeps in registers
    between its passes: all of its ``ceil(E / 4 / W)``, at most ``QUAD_HOLD``."""
    return min(QUAD_HOLD, -(-(num_experts // 4) // lanes))


#: the aux loss's column-sum kernel: threads per block, blocks at most, rows per block at least
#: (measured: docs/benchmarks.md, "The aux loss's forward in one kernel")
COLUMN_THREADS, COLUMN_BLOCKS, COLUMN_MIN_ROWS = 512, 256, 64


def column_tiling(num_rows: int, num_cols: int, block: int = COLUMN_THREADS):
    """``(grid, threads, col_lanes, rows_per_block)`` of a column-sum kernel over ``[num_rows, num_cols]``:
    blocks of RL row lanes x CL column lanes (CL a multiple of 32, at most 256; RL a power of two, RL * CL
    <= ``block``; no more row lanes than a block has rows: tiny problems get small blocks)."""
    cl = min(256, max(32, -(-num_cols // 32) * 32))
    grid = max(1, min(COLUMN_BLOCKS, -(-num_rows // COLUMN_MIN_ROWS)))
    rows = -(-max(num_rows, 1) // grid)
    rl = 1
    while rl * 2 * cl <= block and rl * 2 <= rows:
        rl *= 2
    return grid, rl * cl, cl, rows


#: the aux-loss backward's fill: threads per block, blocks at most (the sweep
#: against other grids and the driver's memset: docs/benchmarks.md).
FILL_THREADS = 128
FILL_BLOCKS = 528


def fill_tiling(num_rows: int, num_quads: int):
    """``(grid, threads, col_lanes)`` of a grid-strided kernel writing ``num_quads``
    column quads down ``num_rows`` rows: RL row lanes x CL column-quad lanes (CL
    as in ``column_tiling``; RL a power of two, RL * CL <= ``FILL_THREADS``, RL
    <= rows), block b's lane rl writing rows ``b RL + rl + k grid RL``."""
    cl = min(256, max(32, -(-num_quads // 32) * 32))
    rl = 1
    while rl * 2 * cl <= FILL_THREADS and rl * 2 <= num_rows:
        rl *= 2
    return max(1, min(FILL_BLOCKS, -(-num_rows // rl))), rl * cl, cl


# Router z-loss

#: the unit kernels: threads per block of the forward's (TB rows x W lanes) and
#: the units (four experts) a lane loads at once (``tools/z_loss_probe.py --sweep``)
Z_THREADS = 128
Z_HOLD = 16
#: the backward's threads per block and held units
Z_BWD_THREADS = 128
Z_BWD_HOLD = 8
#: lanes per row at most (E >= 4 * Z_HOLD * Z_MAX_LANES: several steps per lane)
Z_MAX_LANES = 32
#: threads of the final single-block kernel at most
Z_FINAL_THREADS = 1024
#: vector kernels (``z_loss_vec.py``): (threads, held vectors, blocks at most (528: 4 x 256
#: threads on each of 132 SMs), prefetch, hints); more held than Z_VEC_MAX_HOLD: unit kernels
Z_VEC_FWD = (256, 4, 1056, False, True)
Z_VEC_BWD = (128, 2, 1024, True, True)
Z_VEC_MAX_HOLD = 8


def z_loss_vec_tiling(num_tokens: int, num_experts: int, itemsize: int, backward: bool = False):
    """``(grid, threads, lanes, vecs, hold, iters)`` of a vector kernel (None: a
    row is no whole number of ``vecs`` 16-byte vectors, or too long).  W: the least
    power of two (<= 32) with ``W * hold >= vecs``; TB = threads / W rows (<= T)
    a group; a block walks ``iters`` groups, the fewest that keep its grid cap."""
    threads, hold, blocks = (Z_VEC_BWD if backward else Z_VEC_FWD)[:3]
    if (num_experts * itemsize) % 16 or num_tokens < 1:
        return None
    vecs = num_experts * itemsize // 16
    lanes = min(32, pow2_at_least(-(-vecs // hold)))
    hold = -(-vecs // lanes)
    if hold > Z_VEC_MAX_HOLD:
        return None
    tb = max(1, min(threads // lanes, num_tokens))
    iters = -(-((num_tokens + tb - 1) // tb) // blocks)
    return -(-num_tokens // (tb * iters)), tb * lanes, lanes, vecs, hold, iters


def z_loss_tiling(num_tokens: int, num_experts: int, backward: bool = False):
    """``(grid, threads, lanes, units, quads)`` of the z-loss unit kernels (forward
    rows, or ``backward``): ``units = ceil(E / 4)``; ``quads``: E % 4 == 0 (a unit
    is one vector access, else four masked ones); W the least power of two with
    ``W * hold >= units`` (at most ``Z_MAX_LANES``); TB = threads / W rows (at
    most T) a block; ``grid = ceil(T / TB)`` (0 when T == 0)."""
    hold, threads = (Z_BWD_HOLD, Z_BWD_THREADS) if backward else (Z_HOLD, Z_THREADS)
    units = -(-int(num_experts) // 4)
    lanes = min(Z_MAX_LANES, pow2_at_least(-(-units // hold)))
    tb = max(1, min(max(1, threads // lanes), int(num_tokens)))
    grid = -(-int(num_tokens) // tb)
    return grid, tb * lanes, lanes, units, num_experts % 4 == 0
