"""The streaming backward (``gpurouter/kernels/topk/bwd_stream.py``, E not a
multiple of 4) of the top-k and aux-score ops against the reference: lanes
wrapping past E, idle lanes, partial blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

K = pytest.importorskip("gpurouter.kernels", reason="numba-cuda is not installed")

from gpurouter import reference as ref  # noqa: E402
from gpurouter.testing.strategies import random_cotangent, tie_free_rows_np  # noqa: E402
from gpurouter.testing.tolerances import assert_close  # noqa: E402

from .._helpers import FWD_MODES, check_topk_bwd, check_topk_fwd, host  # noqa: E402
from .._helpers import cfg as _cfg  # noqa: E402

pytestmark = pytest.mark.cuda


# Each shape with two of the four modes in the fast suite (by turns: every mode runs on one of
# the two lane layouts; the streaming backward's score-function code is the same on both), the
# other two under slow (``make test-slow``).
STREAM_CASES = [
    pytest.param(sf, pre, *shape, id="{}-{}-{}-{}-{}".format(*shape, sf, pre),
                 marks=() if (i + j) % 2 == 0 else pytest.mark.slow)
    for i, (sf, pre) in enumerate(FWD_MODES) for j, shape in enumerate([(11, 40, 5), (37, 6, 2)])
]


@pytest.mark.parametrize("sf,pre,T,E,k", STREAM_CASES)
def test_streaming_bwd_lanes_and_partial_blocks(sf, pre, T, E, k):
    """The streaming backwards: E=40 -> a warp per token, lanes wrapping past
    E, 8 tokens per block (a partial second block); E=6 -> 8 lanes per token,
    two of them idle, 32 tokens per block (a partial second block)."""
    from gpurouter.kernels.topk.bwd_tiling import stream_tiling

    grid, threads, lanes = stream_tiling(T, E)
    assert grid == 2 and threads % lanes == 0
    cfg = _cfg(T, E, k, sf, pre)
    x = tie_free_rows_np(8, cfg)
    _, m, s = check_topk_fwd(K, x, "float32", cfg.kwargs())
    check_topk_bwd(K, m, s, random_cotangent(9, x.shape), "float32", cfg.kwargs())
    _, _, sv = K.score_for_aux_loss_fwd(x, k, sf)
    g = random_cotangent(10, x.shape)
    assert_close(K.score_for_aux_loss_bwd(sv, g, sf),
                 host(ref.score_for_aux_loss_bwd(sv, g, sf)), "grads", np.float32, E=E)
