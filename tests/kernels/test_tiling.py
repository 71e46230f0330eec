"""The top-k families' tilings (host code: ``topk/lane/tiling.py``,
``topk/token/tiling.py``, ``topk/bwd_tiling.py``): every layout up to the
kernel limits fits the shared-memory budget; the model presets' shapes; the
default ``Tiling`` objects are the library's figures.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")


pytestmark = pytest.mark.cuda


def test_row_layouts_fit_shared_memory():
    """Every valid config up to the limits fits the 48 KiB budget (pure host code)."""
    from gpurouter.kernels._base.limits import SMEM_BUDGET
    from gpurouter.kernels.topk.lane import tiling as L

    for E in (1, 8, 20, 128, 256, 1000, 1024, 4096, 8192):
        for k in (1, 8, 64):
            if k > E:
                continue
            for G in (0, 8, 64):
                if G > E:
                    continue
                lay = L.select_layout(65536, E, k, G)
                assert lay.shared <= SMEM_BUDGET, (E, k, G, lay)
                assert lay.threads == lay.tb * lay.lanes and lay.lanes & (lay.lanes - 1) == 0
                assert lay.o_flag >= 4 * (lay.o_keep + lay.tb * G)
    lay = L.select_layout(65536, 256, 8, 8)
    assert (lay.lanes, lay.tb, lay.group_lanes) == (8, 16, 1)  # DeepSeek-V3
    assert L.row_stride(256, 8) % 32 == 8  # P / W odd: conflict-free lane scans


def test_token_layouts_fit_shared_memory():
    """Every token-path config up to the limits fits the 48 KiB budget (host code)."""
    from gpurouter.kernels._base.limits import MAX_EXPERTS, SMEM_BUDGET
    from gpurouter.kernels.topk.token import tiling as L

    for E in (4, 8, 128, 256, 1024, 4096, MAX_EXPERTS):
        for G in (0, 8, 64):
            for bias in (False, True):
                if not L.token_path(E, 8, G, bias):
                    assert (E, bias) == (MAX_EXPERTS, True)  # the W-lane kernels take it
                    with pytest.raises(NotImplementedError, match="does not fit"):
                        L.token_layout(1, E, G, bias)
                    continue
                for T in (1, 7, 65536):
                    lay = L.token_layout(T, E, G, bias)
                    assert lay.shared <= SMEM_BUDGET, (E, G, lay)
                    assert lay.threads >= lay.tb and lay.threads % 32 == 0
                    assert lay.stride % 2 == 1 and lay.grid * lay.tb >= T
    lay = L.token_layout(65536, 256, 8, True)
    assert (lay.tb, lay.threads) == (32, 256)  # DeepSeek-V3



def test_token_lanes():
    """The lanes of the grouped top-k forward (``token_lanes``: mode and slot words): the chunk lanes
    (2) up to their T, then the grouped lanes (1, W >= G and the lists fit) up to theirs, else none;
    ungrouped shapes only the chunk lanes; the chunk lanes' tiles shrink until the grid has
    ``lanes_min_blocks`` blocks (a GPU's value, not the simulator's default); the slots
    sit after the bias."""
    from gpurouter.kernels._base.limits import SMEM_BUDGET
    from gpurouter.kernels.topk.token import tiling as L

    small, mid = L.TOKEN_TILING.chunk_lanes_max_tokens
    assert L.token_lanes(mid, 256, 8, 8, True) == (2, 13)  # DeepSeek-V3: groups of 32, K + 3 + 2 words
    assert L.lane_chunks(256, 8, 8) == (8, 32, 13)
    assert L.token_lanes(mid + 1, 256, 8, 8, True) == (1, 9)  # the grouped lanes: K + 1 words a group
    assert L.token_lanes(L.TOKEN_TILING.group_lanes_max_tokens + 1, 256, 8, 8, True) == (0, 0)  # large T: no
    lay = L.token_layout(65536, 256, 8, True, 9)
    assert (lay.tb, lay.threads) == (32, 256) and lay.o_lists == lay.o_bias + 256
    assert lay.shared == 4 * (lay.o_lists + 32 * 8 * 9) <= SMEM_BUDGET
    assert L.lane_chunks(384, 0)[:2] == (12, 32) and L.token_lanes(small, 384, 8, 0, True)[0] == 2  # Kimi-K2
    assert L.token_lanes(small + 1, 384, 8, 0, True) == (0, 0)
    assert L.token_lanes(mid, 64, 8, 32, False) == (0, 0)  # W = 4 < G = 32
    assert L.token_lanes(4096, 8192, 8, 8, True) == (0, 0)  # one token's slots exceed the budget
    assert L.token_layout(65536, 256, 8, True).shared < lay.shared  # (lists = 0: none)
    tiny = L.token_layout(256, 256, 8, True, 13, L.GPU_LANES_MIN_BLOCKS)
    assert tiny.grid >= L.GPU_LANES_MIN_BLOCKS and tiny.threads // tiny.tb >= 8 and tiny.shared <= SMEM_BUDGET


def test_quad_tiling_lanes_by_token_count():
    # the top-k (sparse) backward: 16 lanes a token up to QUAD_SMALL_T tokens (one wave's latency),
    # 8 above (fewer tree levels); the aux-score (dense) one 16 at every T; never more than E / 4
    from gpurouter.kernels.topk import bwd_tiling as _tiling

    small, large = _tiling.BWD_TILING.quad_small_t, _tiling.BWD_TILING.quad_small_t + 1
    assert _tiling.quad_tiling(small, 256, dense=False) == (small // 8, 128, 16)
    assert _tiling.quad_tiling(large, 256, dense=False) == (-(-large // 16), 128, 8)
    assert _tiling.quad_tiling(large, 256, dense=True)[2] == _tiling.quad_tiling(small, 256, dense=True)[2] == 16
    assert _tiling.quad_tiling(100, 16, dense=False) == (4, 128, 4)


def test_default_tilings_are_the_library_figures():
    """The ``Tiling`` objects' defaults are the figures the kernels were tuned with (a GPU's; the
    token forwards' ``lanes_min_blocks`` has its simulator figure under the simulator), so a
    plan made with ``tiling=None`` and one made with the default object launch the same steps."""
    from gpurouter.kernels._base import launch as L
    from gpurouter.kernels._base import plan as _plan
    from gpurouter.kernels.topk.token.tiling import GPU_LANES_MIN_BLOCKS, SIM_LANES_MIN_BLOCKS

    token = K.TokenTiling()
    assert (token.max_topk, token.max_tokens, token.min_threads, token.group_lanes_max_tokens,
            token.chunk_lanes_max_tokens, token.lanes_tree, token.indices_way) == (64, 256, 256, 8192,
                                                                                   (4096, 1024), True, 2)
    assert token.lanes_min_blocks == (SIM_LANES_MIN_BLOCKS if L.simulator_enabled() else GPU_LANES_MIN_BLOCKS)
    assert K.RowTiling() == K.RowTiling(threads=128, experts_per_lane=32, lanes=0)
    assert K.BwdTiling() == K.BwdTiling(8, 16, 8192, 16, 128, 4, 4, 256, 2112)
    assert K.AuxLossTiling() == K.AuxLossTiling(512, 256, 64, 128, 528, 16384)
    assert K.ZLossTiling() == K.ZLossTiling(128, 16, 128, 8, 32, 1024, (256, 4, 1056, False, True),
                                            (128, 2, 1024, True, True), 8)
    assert K.CombineTiling() == K.CombineTiling(256, 2, 8, 4, 0, 256, 1024, 64)
    assert K.DbiasTiling() == K.DbiasTiling(1, 4, 256, 0, 4, 128, 64, 512, 128, 8, 256)
    args = (_plan.spec_of((70, 256), L.BF16), True, 8, False, 8, 4, np.float32(2.5), L.SIGMOID)
    plan = K.topk_with_score_function_fwd_plan(*args)
    again = K.topk_with_score_function_fwd_plan(*args, tiling=K.TopkTiling())
    def launches(p):
        return [(s.kernel, s.grid, s.block, s.shared, s.args) for s in p.steps]

    assert again is not plan and launches(again) == launches(plan)  # kernel, grid, block, memory, arguments
    with pytest.raises(ValueError, match="column_threads"):
        K.AuxLossTiling(column_threads=1024)  # past the kernel's compiled shared array
    with pytest.raises(ValueError, match="mask_stage_bytes"):
        K.AuxLossTiling(mask_stage_bytes=-1)
    with pytest.raises(ValueError, match="final_threads"):
        K.ZLossTiling(final_threads=2048)
