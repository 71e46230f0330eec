"""Fixtures shared by the kernel tests: the tiling knobs of ``gpurouter/kernels/_tiling.py``
forced for a test (plans forgotten around it)."""

from __future__ import annotations

import pytest


def _clear_row_plans():
    """Forget the cached plans of the row forward kernels (their layouts depend on the tiling knobs)."""
    from gpurouter.kernels.topk import aux_plans as aux_scores
    from gpurouter.kernels.topk import plans as topk

    for f in (topk.topk_with_score_function_fwd_plan, aux_scores.score_for_aux_loss_fwd_plan):
        f.cache_clear()


@pytest.fixture
def tiling(monkeypatch):
    """``tiling(lanes, threads=None)`` forces W = ``lanes`` threads per token (and
    ``threads`` per block, hence ``threads // lanes`` tokens per tile) on the
    W-lane row forward kernels for the test (the thread-per-token kernels are
    switched off; the backwards stream: ``stream_tiling``)."""
    pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
    from gpurouter.kernels import _tiling

    def force(lanes, threads=None):
        monkeypatch.setattr(_tiling, "TOKEN_MAX_TOPK", 0)  # the W-lane kernels, not the token ones
        monkeypatch.setattr(_tiling, "row_lanes", lambda num_experts: lanes)
        if threads is not None:
            monkeypatch.setattr(_tiling, "ROW_THREADS", threads)
        _clear_row_plans()

    yield force
    monkeypatch.undo()
    _clear_row_plans()


@pytest.fixture
def token_tiling(monkeypatch):
    """``token_tiling(tokens, threads=32, lanes=None)`` caps the thread-per-token kernels'
    tokens per block (and their minimum threads) for the test: small caps give
    several blocks and a partial last tile on tiny inputs. The chunk lanes'
    tiles keep that size (``TOKEN_LANES_MIN_BLOCKS`` off: on tiny inputs it
    would shrink them to one token a block, the tile the test means to avoid).
    ``lanes`` picks the selection that the library picks by T (``_tiling.token_lanes``):
    None the library's rule (on tiny inputs the chunk lanes), ``"group"`` no chunk
    lanes (grouped: the grouped lanes, mode 1), ``"row"`` no lanes at all (mode 0, the
    token's thread scans its row: every T above the lanes' caps on a GPU)."""
    pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
    from gpurouter.kernels import _tiling

    def force(tokens, threads=32, lanes=None):
        assert lanes in (None, "chunk", "group", "row"), lanes
        monkeypatch.setattr(_tiling, "TOKEN_MAX_TOKENS", tokens)
        monkeypatch.setattr(_tiling, "TOKEN_MIN_THREADS", threads)
        monkeypatch.setattr(_tiling, "TOKEN_LANES_MIN_BLOCKS", 0)
        if lanes in ("group", "row"):
            monkeypatch.setattr(_tiling, "TOKEN_CHUNK_LANES_MAX_TOKENS", (-1, -1))
        if lanes == "row":
            monkeypatch.setattr(_tiling, "TOKEN_GROUP_LANES_MAX_TOKENS", -1)
        _clear_row_plans()

    yield force
    monkeypatch.undo()
    _clear_row_plans()


@pytest.fixture(params=[1, 4], ids=["hold1", "hold4"])
def quad_lanes(monkeypatch, request):
    """Forces the quad backwards to W = 2 lanes per token and 4 tokens per block
    (several quads per lane, a partial last block), a lane holding 1 of its
    quads in registers (the others loaded again in pass 2) or all of them,
    plans forgotten around it."""
    pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
    from gpurouter.kernels import _tiling
    from gpurouter.kernels.topk import aux_plans as aux_scores
    from gpurouter.kernels.topk import plans as topk

    def clear():
        topk.topk_with_score_function_bwd_plan.cache_clear()
        aux_scores.score_for_aux_loss_bwd_plan.cache_clear()

    monkeypatch.setattr(_tiling, "QUAD_LANES_SPARSE", 2)
    monkeypatch.setattr(_tiling, "QUAD_LANES_SPARSE_SMALL_T", 2)
    monkeypatch.setattr(_tiling, "QUAD_LANES_DENSE", 2)
    monkeypatch.setattr(_tiling, "QUAD_THREADS", 8)
    monkeypatch.setattr(_tiling, "QUAD_HOLD", request.param)
    clear()
    yield
    monkeypatch.undo()
    clear()
