"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest


def _clear_row_plans():
    """Forget the cached plans of the row forward kernels (their layouts depend on the tiling knobs)."""
    from gpurouter.kernels import aux_scores, topk

    for f in (topk.topk_with_score_function_fwd_plan, aux_scores.score_for_aux_loss_fwd_plan):
        f.cache_clear()


@pytest.fixture
def tiling(monkeypatch):
    """``tiling(lanes, threads=None)`` forces W = ``lanes`` threads per token (and
    ``threads`` per block, hence ``threads // lanes`` tokens per tile) on the
    W-lane row forward kernels for the test (the thread-per-token kernels are
    switched off; the backwards stream: ``stream_tiling``)."""
    pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
    from gpurouter.kernels import _launch

    def force(lanes, threads=None):
        monkeypatch.setattr(_launch, "TOKEN_MAX_TOPK", 0)  # the W-lane kernels, not token_rows
        monkeypatch.setattr(_launch, "row_lanes", lambda num_experts: lanes)
        if threads is not None:
            monkeypatch.setattr(_launch, "ROW_THREADS", threads)
        _clear_row_plans()

    yield force
    monkeypatch.undo()
    _clear_row_plans()


@pytest.fixture
def token_tiling(monkeypatch):
    """``token_tiling(tokens, threads=32)`` caps the thread-per-token kernels'
    tokens per block (and their minimum threads) for the test: small caps give
    several blocks and a partial last tile on tiny inputs."""
    pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
    from gpurouter.kernels import _launch

    def force(tokens, threads=32):
        monkeypatch.setattr(_launch, "TOKEN_MAX_TOKENS", tokens)
        monkeypatch.setattr(_launch, "TOKEN_MIN_THREADS", threads)
        _clear_row_plans()

    yield force
    monkeypatch.undo()
    _clear_row_plans()
