"""``tiled_ragged_dot`` on a GPU at the MoE issue's two full shapes (issue #38):
the same values and gradients as ``batched_ragged_dot`` in bf16, balanced and
skewed routing (the largest expert at 4x the mean load). Its times, and the
"no cliff" ratio of skewed over balanced forward + backward (at most 1.5),
are measured by tools/probes/grouped_gemm_probe.py (``skewed / balanced``
rows), not here: a test asserts values, a benchmark records times."""

from __future__ import annotations

import pytest
from gemm_gpu_helpers import SHAPES
from gemm_gpu_helpers import assert_matches as _assert_matches
from gemm_gpu_helpers import fwd_bwd as _fwd_bwd
from gemm_gpu_helpers import operands as _operands
from gemm_gpu_helpers import sizes as _sizes

from gpurouter.reference.grouped_matmul import batched_ragged_dot, tiled_ragged_dot

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_tiled_equals_batched_at_the_full_shapes(name, routing):
    (t, e, k), lhs, rhs, dy = _operands(name)
    sizes = _sizes(t, e, k, routing == "skewed")
    got = _fwd_bwd(tiled_ragged_dot)(lhs, rhs, sizes, dy)
    want = _fwd_bwd(batched_ragged_dot)(lhs, rhs, sizes, dy)
    _assert_matches(got, want, f"{name} {routing}")
