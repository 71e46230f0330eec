"""Fixtures shared by the kernel tests: tilings other than the library's, passed to
the launchers as their ``tiling`` argument (it is part of the plans' cache key:
no plan outlives its test's tiling, nothing is patched).

Each fixture gives a ``Tiled``: ``gpurouter.kernels`` with the top-k and
aux-score launchers' ``tiling`` bound, which a test uses where it would use the
module (``K = tiling(4, 8)``, then ``K.topk_with_score_function_fwd(...)`` or
``check_topk_fwd(K, ...)``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest


class Tiled:
    """``gpurouter.kernels`` with ``tiling`` (a ``TopkTiling``) bound to its top-k and
    aux-score launchers and plans; every other name is the module's."""

    LAUNCHERS = tuple(f"{op}_{d}{plan}" for op in ("topk_with_score_function", "score_for_aux_loss")
                      for d in ("fwd", "bwd") for plan in ("", "_plan"))

    def __init__(self, tiling):
        self.tiling = tiling

    def __getattr__(self, name):
        from gpurouter import kernels

        value = getattr(kernels, name)
        return functools.partial(value, tiling=self.tiling) if name in self.LAUNCHERS else value

    def replace(self, **parts):
        """This ``Tiled`` with some parts of its ``TopkTiling`` replaced (``dataclasses.replace``)."""
        return Tiled(dataclasses.replace(self.tiling, **parts))


@pytest.fixture
def tiling():
    """``tiling(lanes, threads=None)``: a ``Tiled`` whose W-lane row forwards take W = ``lanes``
    threads per token (and ``threads`` per block, hence ``threads // lanes`` tokens per
    tile; None: the library's), the thread-per-token kernels switched off
    (``TokenTiling.max_topk = 0``)."""
    K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

    def force(lanes, threads=None):
        row = K.RowTiling(lanes=lanes) if threads is None else K.RowTiling(lanes=lanes, threads=threads)
        return Tiled(K.TopkTiling(token=K.TokenTiling(max_topk=0), row=row))

    return force


@pytest.fixture
def token_tiling():
    """``token_tiling(tokens, threads=32, lanes=None, **knobs)``: a ``Tiled`` whose thread-per-token
    kernels take at most ``tokens`` tokens a block (and at least ``threads`` threads): small
    caps give several blocks and a partial last tile on tiny inputs. The chunk lanes' tiles
    keep that size (``lanes_min_blocks = 0``: on tiny inputs the library's would shrink them
    to one token a block, the tile the test means to avoid). ``lanes`` picks the selection
    that the library picks by T (``topk/token/tiling.token_lanes``): None the library's
    rule (on tiny inputs the chunk lanes), ``"group"`` no chunk lanes (grouped: the grouped
    lanes, mode 1), ``"row"`` no lanes at all (mode 0, the token's thread scans its row:
    every T above the lanes' caps on a GPU). ``knobs``: other ``TokenTiling`` fields."""
    K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

    def force(tokens, threads=32, lanes=None, **knobs):
        assert lanes in (None, "chunk", "group", "row"), lanes
        off = dict(knobs)
        if lanes in ("group", "row"):
            off["chunk_lanes_max_tokens"] = (-1, -1)
        if lanes == "row":
            off["group_lanes_max_tokens"] = -1
        token = K.TokenTiling(max_tokens=tokens, min_threads=threads, lanes_min_blocks=0, **off)
        return Tiled(K.TopkTiling(token=token))

    return force


@pytest.fixture(params=[1, 4], ids=["hold1", "hold4"])
def quad_lanes(request):
    """A ``Tiled`` whose quad backwards take W = 2 lanes per token and 4 tokens per block
    (several quads per lane, a partial last block), a lane holding 1 of its quads in
    registers (the others loaded again in pass 2) or all of them."""
    K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
    bwd = K.BwdTiling(quad_lanes_sparse=2, quad_lanes_sparse_small_t=2, quad_lanes_dense=2, quad_threads=8,
                      quad_hold=request.param)
    return Tiled(K.TopkTiling(bwd=bwd))


@pytest.fixture
def library_lane_blocks():
    """A ``Tiled`` with a GPU's ``lanes_min_blocks`` (``GPU_LANES_MIN_BLOCKS``; the library's
    default under the simulator is ``SIM_LANES_MIN_BLOCKS``)."""
    K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")
    from gpurouter.kernels.topk.token.tiling import GPU_LANES_MIN_BLOCKS

    return Tiled(K.TopkTiling(token=K.TokenTiling(lanes_min_blocks=GPU_LANES_MIN_BLOCKS)))
